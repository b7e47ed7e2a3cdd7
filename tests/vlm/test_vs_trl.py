"""The building blocks of ``python -m benchmarks.vs_trl`` at a tiny size (the benchmark itself is not a test), on both
tasks: shapes VQA with a LoRA, and the shapes-math reasoning world with full fine-tuning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from benchmarks import vs_trl
from mmrl.checkpoint import load_trainable
from mmrl.config import ConfigError
from mmrl.vlm.trainer import VLMRLVRTrainer, load_examples


def _cfg(variant: str, seed: int = 0, train_limit: int = 2000, task: str = "vqa"):
    cfg = vs_trl._config(vs_trl.TASKS[task].config, variant, seed, threads=1)
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
    # a recipe's process credit stays with single, mmrl's own algorithm; group is GRPO as TRL runs it
    from mmrl.config import load_config
    from mmrl.vlm.config import VLMRLVRConfig

    recipe = vs_trl.TASKS["reason"].config
    credited = {
        variant: load_config(
            VLMRLVRConfig,
            recipe,
            ["trainer.process_credit.reward=steps", *vs_trl.config_overrides(variant, 0, 1)],
        ).trainer.process_credit.reward
        for variant in ("mmrl_single", "mmrl_group")
    }
    assert credited == {"mmrl_single": "steps", "mmrl_group": None}
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
    assert (args.reward_weights, args.max_completion_length) == ([1.0], 8)


def test_mmrl_variants_walk_shuffled_passes_as_trls_sampler_unless_told_the_recipes_order():
    """TRL's sampler walks the questions in shuffled passes; by default the mmrl variants do the same, and
    ``--order recipe`` keeps the demo's uniform draw with replacement."""
    for variant in ("mmrl_single", "mmrl_group"):
        assert _cfg(variant).allocation.selection == "shuffled"
        config = vs_trl.TASKS["reason"].config
        assert vs_trl._config(config, variant, 0, 1, order="recipe").allocation.selection == "uniform"
    with pytest.raises(ValueError, match="unknown order 'random'"):
        vs_trl.config_overrides("mmrl_single", 0, 1, order="random")


def test_recipe_overrides_reach_every_variant_and_the_variants_own_settings_win():
    """``--set``: the recipe changed for all three variants (TRL reads its lr from the same config), except what a
    variant itself fixes (group's process credit is off, single stays single); a bad key stops the benchmark
    before any run."""
    config = vs_trl.TASKS["reason"].config
    recipe = ["trainer.process_credit.single_groups=kind", "trainer.lr=1e-4", "trainer.mode=group"]
    single = vs_trl._config(config, "mmrl_single", 0, 1, recipe_overrides=recipe)
    group = vs_trl._config(config, "mmrl_group", 0, 1, recipe_overrides=recipe)
    trl = vs_trl._config(config, "trl", 0, 1, recipe_overrides=recipe)
    assert single.trainer.process_credit.single_groups == "kind" and single.trainer.mode == "single"
    assert group.trainer.process_credit.reward is None and group.trainer.mode == "group"
    assert single.trainer.lr == group.trainer.lr == trl.trainer.lr == 1e-4
    with pytest.raises(ConfigError, match=r"trainer\.lrr"):
        vs_trl.main(["--task", "reason", "--set", "trainer.lrr=1", "--seeds", "1"])


def test_reason_variants_take_the_reasoning_demo_recipe():
    """The reason task reads configs/demo/vlm_shapes_reason.yaml: every variant trains the full model (no LoRA) at
    its lr, samples 48 tokens at T = 1, and TRL weighs the three rewards 0.6 / 0.3 / 0.1 in one sum before its
    group advantage (mmrl's weighted_sum)."""
    single, group, trl_cfg = (_cfg(v, task="reason") for v in vs_trl.VARIANTS)
    assert [spec.key for spec in single.rewards] == ["answer", "steps", "format"]
    assert single.data.train == "shapes_math:train" and single.model.lora is None
    assert (single.trainer.mode, single.rollouts_per_step) == ("single", 64)
    assert (group.trainer.mode, group.rollouts_per_step, group.trainer.num_generations) == ("group", 64, 8)
    args = vs_trl.trl_config(trl_cfg, steps=3, output_dir="unused", suppressed_token_ids=[7])
    assert args.reward_weights == [0.6, 0.3, 0.1]
    assert args.multi_objective_aggregation == "sum_then_normalize"
    assert (args.temperature, args.max_completion_length, args.top_p, args.top_k) == (1.0, 48, 1.0, 0)
    assert (args.learning_rate, args.loss_type, args.beta) == (
        trl_cfg.trainer.lr,
        "dapo",
        trl_cfg.trainer.beta,
    )
    bad = trl_cfg.model_copy(
        update={"trainer": trl_cfg.trainer.model_copy(update={"loss_agg": "seq_mean_token_sum_norm"})}
    )
    with pytest.raises(ValueError, match=r"trainer\.loss_agg='seq_mean_token_sum_norm'"):
        vs_trl.trl_config(bad, steps=3, output_dir="unused", suppressed_token_ids=[7])


@pytest.mark.parametrize("task", ["vqa", "reason"])
def test_trl_rows_carry_mmrl_prompt_tokens_and_image(task):
    """TRL's own path (``prepare_multimodal_messages`` + the processor's chat template, as in
    ``GRPOTrainer._tokenize_prompts``) gives the same prompt tokens and pixels as mmrl's rollout path."""
    import datasets
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    from pipelines.vlm.inputs import prepare_prompts

    cfg = _cfg("trl", seed=3, train_limit=6, task=task)
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
        ex.question for ex in load_examples(_cfg("trl", 4, 6, task=task), "train")
    ]


def test_trl_reward_is_the_registry_verifier():
    funcs, weights = vs_trl.trl_rewards(_cfg("trl"))
    completions = [[{"role": "assistant", "content": c}] for c in ("3", "three", " 3.", "4")]
    columns = {"answer": ["3"] * 4, "reference": [""] * 4}  # VQA rows have no reference solution
    assert [f(completions=completions, prompts=None, **columns) for f in funcs] == [[1.0, 0.0, 1.0, 0.0]]
    assert [f.__name__ for f in funcs] == ["exact_match"] and weights == [1.0]


@pytest.mark.parametrize("with_steps", [False, True])
def test_reason_trl_rewards_equal_mmrl_verify(with_steps):
    """On real shapes-math rows, TRL's reward functions, fed the row columns as TRL feeds them and weighted by its
    reward_weights (TRL's sum_then_normalize sum), give the trainer's own ``verify`` values: per verifier and in
    total, hand-checked for the demo's 0.6 x answer + 0.3 x reasoning_steps + 0.1 x format (TRL's rows carry the
    reference solutions reasoning_steps reads) and for the recipe without reasoning_steps."""
    from pipelines.vlm.backend import GenerationSample

    cfg = _cfg("trl", seed=1, train_limit=4, task="reason")
    if not with_steps:
        cfg = cfg.model_copy(update={"rewards": [r for r in cfg.rewards if r.name != "reasoning_steps"]})
    trainer = VLMRLVRTrainer(cfg)
    trainer.setup(for_training=False)
    examples = load_examples(cfg, "train")
    by_id = {row["prompt_id"]: row for row in vs_trl.trl_rows(examples)}
    samples, expected = [], []
    for ex in examples:
        right, wrong = ex.answer, str(int(ex.answer) + 1)
        for text, value in (
            # answer and format terms (0.6 and 0.1); the steps term is checked on its own below
            (f"<think>{ex.reference}</think><answer>{right}</answer>", 0.7),  # the reference completion
            (f"<think>shapes 3</think><answer>{wrong}</answer>", 0.1),  # wrong, well formed
            (f"<answer>{right}</answer>", 0.6),  # right, no think block
            (f"<think>x</think> {right}", 0.0),  # no answer span: the numeric check needs one
        ):
            samples.append((ex, text))
            expected.append(value)
    pairs = [
        (ex, GenerationSample(0, ex.prompt_id, 0, [], [], torch.zeros(0), "stop", text, weight_version=0))
        for ex, text in samples
    ]
    total, raw = trainer.verify(pairs)
    # TRL passes every dataset column but the prompt to each reward function, one value per completion
    rows = [by_id[ex.prompt_id] for ex, _ in samples]
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    completions = [[{"role": "assistant", "content": text}] for _, text in samples]
    funcs, weights = vs_trl.trl_rewards(cfg)
    per_func = torch.tensor([f(completions=completions, prompts=None, **columns) for f in funcs]).T
    torch.testing.assert_close(per_func, raw)
    theirs = (per_func * torch.tensor(weights)).sum(dim=1)
    torch.testing.assert_close(theirs, total)
    if with_steps:
        assert [f.__name__ for f in funcs] == ["answer", "steps", "format"]
        assert per_func[::4, 1].tolist() == [1.0] * len(examples)  # the reference trace matches itself
        assert per_func[2::4, 1].tolist() == [0.0] * len(examples)  # no think block, no steps
        torch.testing.assert_close(theirs - 0.3 * per_func[:, 1], torch.tensor(expected))
    else:
        assert [f.__name__ for f in funcs] == ["answer", "format"]
        torch.testing.assert_close(theirs, torch.tensor(expected))


def test_a_cosine_recipe_decays_both_sides_alike():
    """With ``trainer.lr_schedule: cosine`` TRL's scheduler gives the lr mmrl's schedule gives at every step of
    the run (train_worker sets trainer.steps to the run's steps)."""
    from transformers import get_scheduler

    from mmrl.schedule import learning_rate

    cfg = vs_trl._config(vs_trl.TASKS["reason"].config, "trl", 0, threads=1, steps=16)
    assert cfg.trainer.steps == 16
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"lr_schedule": "cosine"})})
    args = vs_trl.trl_config(cfg, steps=16, output_dir="unused", suppressed_token_ids=[])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, args.max_steps)
    theirs = []
    for _ in range(16):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    mine = [learning_rate(k, cfg.trainer.lr, cfg.trainer.steps, schedule="cosine") for k in range(16)]
    assert theirs == pytest.approx(mine, rel=1e-9)
    assert mine[0] == cfg.trainer.lr and mine[8] == pytest.approx(cfg.trainer.lr / 2)


def test_reason_trl_trainer_trains_and_samples_as_mmrl():
    """TRL's trainer for the reason task trains exactly mmrl's parameters (the whole model but the vision tower),
    stops on mmrl's stop tokens and suppresses mmrl's vision tokens while sampling."""
    cfg = _cfg("trl", train_limit=64, task="reason")
    mine = VLMRLVRTrainer(cfg)
    mine.setup(for_training=False)
    theirs = vs_trl.trl_trainer(cfg, steps=1)
    trained = {n for n, p in mine.model.named_parameters() if p.requires_grad}
    assert trained and any(mine.family.is_vision_parameter(n) for n, _ in mine.model.named_parameters())
    assert {n for n, p in theirs.model.named_parameters() if p.requires_grad} == trained
    assert sorted(theirs.eos_token_ids) == mine.backend.stop_token_ids
    assert theirs.generation_config.suppress_tokens == mine.backend.suppressed_token_ids
    assert (theirs.generation_config.max_new_tokens, theirs.generation_config.temperature) == (48, 1.0)


@pytest.mark.parametrize("task", ["vqa", "reason"])
def test_trl_loss_forward_marks_the_image_tokens_of_every_prompt(task):
    """TRL's scored batch (its own generate-and-score path): the ``mm_token_type_ids`` its loss forward gets mark
    exactly the ``<|image_pad|>`` positions of the left-padded prompts (and nothing over the completions), for
    prompts of different lengths."""
    cfg = _cfg("trl", train_limit=64, task=task)
    trainer = vs_trl.trl_trainer(cfg, steps=1)
    rows = next(iter(trainer.get_train_dataloader()))
    scored = trainer._generate_and_score_completions(rows)
    prompt_ids, prompt_mask = scored["prompt_ids"], scored["prompt_mask"]
    assert prompt_mask.sum(1).unique().numel() > 1  # prompts of several lengths in the batch
    image_pad = trainer.processing_class.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    types = scored["mm_token_type_ids"]
    assert torch.equal(types[:, : prompt_ids.shape[1]], (prompt_ids == image_pad).to(types.dtype))
    assert not types[:, prompt_ids.shape[1] :].any()


@pytest.mark.parametrize(
    ("task", "variant"), [("vqa", "mmrl_group"), ("vqa", "trl"), ("reason", "mmrl_group"), ("reason", "trl")]
)
def test_runs_time_every_step_and_save_loadable_weights_at_the_marks(task, variant):
    """Two steps of 64 rollouts: one time per step, trained weights saved after steps 1 and 2 that load into
    mmrl's evaluation model and differ from the start (the LoRA B matrices off their zero init; with full
    fine-tuning, language weights moved and no vision weight saved)."""
    torch.manual_seed(0)
    cfg = _cfg(variant, train_limit=64, task=task)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    run = vs_trl.run_trl if variant == "trl" else vs_trl.run_mmrl
    times = run(cfg, vs_trl.mark_steps([64, 128]), lambda step, state: saved.__setitem__(step, state))
    assert len(times.wall) == len(times.cpu) == 2 and all(t > 0 for t in times.wall + times.cpu)
    assert sorted(saved) == [1, 2]
    evaluator = VLMRLVRTrainer(cfg)
    evaluator.setup(for_training=False)
    start = {n: p.detach().clone() for n, p in evaluator.model.named_parameters()}
    if task == "vqa":
        lora_b = [n for n in saved[2] if "lora_B" in n]
        assert lora_b and all(saved[2][n].abs().sum() > 0 for n in lora_b)
    else:
        assert saved[2].keys() == {n for n, p in evaluator.model.named_parameters() if p.requires_grad}
        assert not any(evaluator.family.is_vision_parameter(n) for n in saved[2])
        assert any(not torch.equal(saved[2][n], start[n]) for n in saved[2])
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


def test_summary_judges_goals_on_the_first_score_and_averages_the_others():
    """A reason results file: lenient accuracy first (the goals), held-out templates beside it."""
    records = [
        {"kind": "train", "variant": v, "seed": seed, "step_s": [1.0], "rollouts": 64, "peak_rss_mib": 1000.0}
        for v in vs_trl.VARIANTS
        for seed in (0, 1)
    ]
    for seed, single_at_64 in ((0, 0.50), (1, 0.70)):
        lenient = {
            "mmrl_single": {"0": 0.4, "64": single_at_64, "128": 0.7},
            "mmrl_group": {"0": 0.4, "64": 0.45, "128": 0.5},
            "trl": {"0": 0.4, "64": 0.5, "128": 0.6},
        }
        templates = {v: {"0": 0.3, "64": 0.3, "128": 0.2 + 0.1 * seed} for v in vs_trl.VARIANTS}
        records.append(
            {
                "kind": "eval",
                "seed": seed,
                "accuracy": lenient,
                "scores": {"lenient": lenient, "templates": templates},
            }
        )
    summary = vs_trl.summarize(records)
    assert summary["accuracy"]["mmrl_single"] == pytest.approx({0: 0.4, 64: 0.6, 128: 0.7})
    assert summary["scores"]["templates"]["trl"] == pytest.approx({0: 0.3, 64: 0.3, 128: 0.25})
    assert summary["single_reach"] == 64  # mean 0.6 >= TRL's final mean 0.6 after half its rollouts


def test_every_worker_runs_under_the_wait_policy_the_driver_chose(monkeypatch):
    """A worker that chose its own OpenMP wait policy from the load at its start could run TRL spinning and mmrl
    sleeping: the driver passes its choice, libgomp's default spin written out on an idle machine."""
    seen = []

    def fake_run(command, env, **_):
        seen.append({key: env.get(key) for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")})
        return type("Done", (), {"returncode": 0, "stdout": '{"ok": 1}\n', "stderr": ""})()

    monkeypatch.setattr(vs_trl.subprocess, "run", fake_run)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert vs_trl._spawn(["--worker", "trl"], 2, vs_trl.LIBGOMP_DEFAULT_WAIT) == {"ok": 1}
    assert vs_trl._spawn(["--worker", "eval"], 1, {"OMP_WAIT_POLICY": "PASSIVE"}) == {"ok": 1}
    assert seen == [
        {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": "2"},
        {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": "1"},
    ]
