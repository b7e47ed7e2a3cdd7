"""The building blocks of ``python -m benchmarks.vs_trl`` at a tiny size (the benchmark itself is not a test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from benchmarks import vs_trl
from mmrl.checkpoint import load_trainable
from mmrl.vlm.trainer import VLMRLVRTrainer, load_examples


def _cfg(variant: str, seed: int = 0, train_limit: int = 2000):
    cfg = vs_trl._config(vs_trl.CONFIG, variant, seed, threads=1)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_limit": train_limit})})


def test_mark_steps_count_64_rollouts_per_step():
    assert vs_trl.mark_steps([2048, 1024, 6144]) == {16: 1024, 32: 2048, 96: 6144}
    assert vs_trl.mark_steps([64]) == {1: 64}
    with pytest.raises(ValueError, match=r"\[1000\]"):
        vs_trl.mark_steps([1000, 1024])
    with pytest.raises(ValueError, match="multiples"):
        vs_trl.mark_steps([0])


def test_variants_put_64_completions_in_each_step():
    single = _cfg("mmrl_single")
    group = _cfg("mmrl_group")
    assert (single.trainer.mode, single.rollouts_per_step) == ("single", 64)
    assert (group.trainer.mode, group.rollouts_per_step) == ("group", 64)
    assert not group.trainer.entropy_shaping.enabled
    args = vs_trl.trl_config(_cfg("trl"), steps=5, output_dir="unused", suppressed_token_ids=[1, 2])
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64
    assert args.num_generations == 8 and args.max_steps == 5
    assert (args.epsilon, args.epsilon_high, args.beta, args.loss_type) == (0.2, 0.28, 0.0, "dapo")
    assert (args.learning_rate, args.lr_scheduler_type, args.gradient_checkpointing) == (
        1e-3,
        "constant",
        False,
    )
    assert args.generation_kwargs == {"suppress_tokens": [1, 2]}


def test_trl_rows_carry_mmrl_prompt_tokens_and_image():
    """TRL's own path (``prepare_multimodal_messages`` + the processor's chat template, as in
    ``GRPOTrainer._tokenize_prompts``) gives the same prompt tokens and pixels as mmrl's rollout path."""
    import datasets
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    from pipelines.vlm.inputs import prepare_prompts

    cfg = _cfg("trl", seed=3, train_limit=6)
    examples = load_examples(cfg, "train")
    rows = datasets.Dataset.from_list(vs_trl.trl_rows(examples))  # stored as TRL reads it
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    trainer = VLMRLVRTrainer(cfg)
    prepared, skipped = prepare_prompts(processor, [trainer._prompt(ex) for ex in examples])
    assert not skipped and len(rows) == len(examples) == 6
    for ex, row, mine in zip(examples, rows, prepared, strict=True):
        assert (row["prompt"][0]["content"], row["answer"], row["prompt_id"]) == (
            ex.question,
            ex.answer,
            ex.prompt_id,
        )
        np.testing.assert_array_equal(np.asarray(row["image"]), np.asarray(ex.images[0]))
        messages = prepare_multimodal_messages(row["prompt"], images=[row["image"]])
        theirs = processor.apply_chat_template(
            conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        assert list(theirs["input_ids"][0]) == mine.input_ids
        torch.testing.assert_close(theirs["pixel_values"], mine.features["pixel_values"])
    # the seed picks the questions, as in the trainer
    assert [ex.question for ex in examples] != [
        ex.question for ex in load_examples(_cfg("trl", 4, 6), "train")
    ]


def test_trl_reward_is_the_registry_verifier():
    reward = vs_trl.trl_reward(_cfg("trl"))
    completions = [[{"role": "assistant", "content": c}] for c in ("3", "three", " 3.", "4")]
    assert reward(completions=completions, answer=["3", "3", "3", "3"], prompts=None) == [1.0, 0.0, 1.0, 0.0]
    assert reward.__name__ == "exact_match"


@pytest.mark.parametrize("variant", ["mmrl_group", "trl"])
def test_runs_time_every_step_and_save_loadable_adapters_at_the_marks(variant):
    """Two steps of 64 rollouts: one time per step, adapters saved after steps 1 and 2 that load into mmrl's
    evaluation model, the LoRA B matrices moved off their zero init."""
    torch.manual_seed(0)
    cfg = _cfg(variant, train_limit=64)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    run = vs_trl.run_trl if variant == "trl" else vs_trl.run_mmrl
    times = run(cfg, vs_trl.mark_steps([64, 128]), lambda step, state: saved.__setitem__(step, state))
    assert len(times.wall) == len(times.cpu) == 2 and all(t > 0 for t in times.wall + times.cpu)
    assert sorted(saved) == [1, 2]
    lora_b = [n for n in saved[2] if "lora_B" in n]
    assert lora_b and all(saved[2][n].abs().sum() > 0 for n in lora_b)
    evaluator = VLMRLVRTrainer(cfg)
    evaluator.setup(for_training=False)
    load_trainable(evaluator.model, saved[2])
    params = dict(evaluator.model.named_parameters())
    for name, value in saved[2].items():
        torch.testing.assert_close(params[name].detach(), value)


def test_summary_figures_and_goals():
    records = [
        {"kind": "train", "variant": v, "seed": 0, "step_s": [1.0, 2.0], "rollouts": 128, "peak_rss_mib": rss}
        for v, rss in (("mmrl_single", 900.0), ("mmrl_group", 1000.0), ("trl", 950.0))
    ]
    records[1]["step_s"] = [0.5, 1.0]  # mmrl group at half TRL's time
    records[1]["step_cpu_s"], records[2]["step_cpu_s"] = [1.0, 1.0], [4.0, 4.0]  # and a quarter of its CPU
    records.append(
        {
            "kind": "eval",
            "seed": 0,
            "accuracy": {
                "mmrl_single": {"0": 0.3, "64": 0.6, "128": 0.7},
                "mmrl_group": {"0": 0.3, "64": 0.4, "128": 0.5},
                "trl": {"0": 0.3, "64": 0.45, "128": 0.55},
            },
        }
    )
    summary = vs_trl.summarize(records)
    assert summary["per_1k_s"]["trl"] == pytest.approx(1000 * 3.0 / 128)
    assert summary["group_time_ratio"] == pytest.approx(0.5)
    assert summary["group_cpu_ratio"] == pytest.approx(0.25)
    assert summary["single_reach"] == 64  # 0.6 >= TRL's final 0.55 after 64 of TRL's 128 rollouts
