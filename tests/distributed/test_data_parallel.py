"""Data-parallel training on two CPU processes (gloo), launched by torchrun as `accelerate launch` launches on GPUs:
ranks stay identical under DDP, FSDP sharding trains the same weights as DDP, and only rank 0 writes the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def fsdp_env() -> dict[str, str]:
    """The environment `accelerate launch --config_file configs/accelerate/fsdp.yaml` gives each process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    command = ["--config_file", str(ROOT / "configs/accelerate/fsdp.yaml"), "--num_processes", "2", "x.py"]
    env = prepare_multi_gpu_env(_validate_launch_command(launch_command_parser().parse_args(command))[0])
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_USE_FSDP", "FSDP_"))}


def launch(
    tmp_path: Path, recipe: str, tag: str, *overrides: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Train on 2 ranks; returns each rank's final ``{"weights", "metrics"}``."""
    prefix = tmp_path / tag
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        recipe,
        str(prefix),
        f"run.output_dir={tmp_path}",
        f"run.name={tag}",
        "run.progress=false",
        "run.tensorboard=false",
        *overrides,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    results = [Path(f"{prefix}.rank{r}.pt") for r in range(2)]
    for result in results:  # a relaunch under the same tag must not read the last launch's results
        result.unlink(missing_ok=True)
    done = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(result, weights_only=False) for result in results]


FLOW = (
    "model.family=shapes",
    "model.path=checkpoints/shapes_flow",
    "model.device=cpu",
    "train_prompts=shapes:train",
    "eval_prompts=shapes:heldout@8",
    "rewards=[{name: shapes, options: {partial: true}}]",
    "sampling.num_steps=4",
    "sampling.eval_num_steps=4",
    "sampling.sde_window=2",
    "allocation.prompts_per_step=2",
    "allocation.rollouts_per_step=8",
    "trainer.steps=2",
    "trainer.eval_every=2",
    "trainer.eval_prompts=8",
    "trainer.minibatch_size=8",
    "trainer.lr=1e-3",
    "trainer.drop_zero_advantage=false",
)


def test_flow_ddp_lora_ranks_stay_identical_and_rank0_writes(tmp_path):
    ranks = launch(
        tmp_path,
        "flow_grpo",
        "ddp",
        *FLOW,
        "trainer.objective=nft",
        "trainer.old_policy_decay=0.5",
        "run.save_every=1",
    )
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert w0 and all("lora" in n for n in w0)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)  # same start (rank 0's LoRA init), same averaged steps
    assert any(w0[n].abs().sum() > 0 for n in w0 if "lora_B" in n)  # B starts at zero: it trained
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # metrics are reduced over the ranks
    assert ranks[0]["metrics"]["nfe/rollout"] == 8 * 4  # each rank: its own 8 samples x 4 steps
    lines = [json.loads(x) for x in (tmp_path / "ddp/metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]  # one writer
    state = torch.load(tmp_path / "ddp/checkpoints/step_00000002/state.pt", weights_only=False)
    assert all(torch.equal(state["trainable"][n], w0[n]) for n in w0)


def assert_fsdp_two_steps_equal_ddp(tmp_path, ddp: list[dict], fsdp: list[dict], atol: float = 1e-6) -> dict:
    """FSDP's two steps (runs full_fsdp) equal DDP's first two (full_ddp's step-2 checkpoint) to ``atol``; returns
    the initial weights."""
    assert fsdp[0]["sharded"] and not ddp[0]["sharded"]
    base = ddp[0]["initial"]
    ddp_step2 = torch.load(tmp_path / "full_ddp/checkpoints/step_00000002/state.pt", weights_only=False)[
        "trainable"
    ]
    assert base and set(fsdp[0]["weights"]) == set(ddp_step2) == set(base)
    assert all(torch.equal(fsdp[0]["weights"][n], fsdp[1]["weights"][n]) for n in base)
    moved = max(float((ddp_step2[n] - base[n]).abs().max()) for n in base)
    assert moved > 1e-4  # the steps trained, by far more than the tolerance below
    for n in base:  # the same two steps, sharded or not (up to the order of float reductions)
        torch.testing.assert_close(fsdp[0]["weights"][n], ddp_step2[n], rtol=0, atol=atol)
    # the checkpoint rank 0 wrote under FSDP holds the whole trained tensors
    state = torch.load(tmp_path / "full_fsdp/checkpoints/step_00000002/state.pt", weights_only=False)
    assert all(torch.equal(state["trainable"][n], fsdp[0]["weights"][n]) for n in base)
    assert len(state["rng_per_rank"]) == 2
    return base


def test_flow_fsdp_full_finetune_matches_ddp_and_resumes_exactly(tmp_path):
    common = (
        *FLOW,
        "model.lora=null",
        "trainer.objective=grpo",
        "trainer.beta=0.04",
        "trainer.lr=1e-4",
        "run.save_every=1",
    )
    ddp = launch(tmp_path, "flow_grpo", "full_ddp", *common, "trainer.steps=3", "trainer.eval_every=3")
    fsdp = launch(tmp_path, "flow_grpo", "full_fsdp", *common, env=fsdp_env())
    base = assert_fsdp_two_steps_equal_ddp(tmp_path, ddp, fsdp)
    # and the diffusers folder beside it, though FSDP2 renamed the model's class
    from diffusers import SD3Transformer2DModel

    loaded = SD3Transformer2DModel.from_pretrained(
        tmp_path / "full_fsdp/checkpoints/step_00000002/transformer"
    )
    assert all(torch.equal(p, fsdp[0]["weights"][n]) for n, p in loaded.named_parameters())
    # resumed on 2 ranks (sharded optimizer state and each rank's RNG restored), the third step is DDP's third
    resumed = launch(
        tmp_path,
        "flow_grpo",
        "full_fsdp",
        *common,
        "trainer.steps=3",
        "trainer.eval_every=3",
        "run.resume=true",
        env=fsdp_env(),
    )
    for n in base:
        torch.testing.assert_close(resumed[0]["weights"][n], ddp[0]["weights"][n], rtol=0, atol=1e-6)
    assert resumed[0]["metrics"]["eval/reward_mean"] == pytest.approx(
        ddp[0]["metrics"]["eval/reward_mean"], abs=1e-6
    )


def test_flow_fsdp_gathers_float32_master_weights_of_a_bfloat16_model(tmp_path):
    """model.dtype bfloat16, master weights float32: FSDP keeps float32 shards, gathers them in bfloat16 for the
    forward and backward, reduces gradients in float32, and the steps train."""
    common = (*FLOW, "model.lora=null", "model.dtype=bfloat16", "trainer.objective=grpo", "trainer.lr=1e-4")
    assert_trained_float32_shards(launch(tmp_path, "flow_grpo", "bf16_fsdp", *common, env=fsdp_env()))


def assert_trained_float32_shards(ranks: list[dict]) -> None:
    """The ranks' sharded weights are float32, finite, equal on both ranks, and moved by the steps."""
    assert ranks[0]["sharded"]
    base, trained = ranks[0]["initial"], ranks[0]["weights"]
    assert {t.dtype for t in trained.values()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in trained.values())
    assert all(torch.equal(trained[n], ranks[1]["weights"][n]) for n in trained)
    assert max(float((trained[n] - base[n]).abs().max()) for n in base) > 1e-5


def test_flow_fsdp_refuses_lora(tmp_path):
    with pytest.raises(AssertionError, match=r"configs/accelerate/ddp\.yaml"):
        launch(tmp_path, "flow_grpo", "fsdp_lora", *FLOW, env=fsdp_env())


VLM = (
    "model.path=checkpoints/shapes_vlm",
    "model.device=cpu",
    "data.image_size=64",
    "data.train_limit=64",
    "data.eval_limit=14",
    "generation.max_new_tokens=8",
    "trainer.mode=single",
    "allocation.prompts_per_step=8",
    "trainer.minibatch_size=8",
    "trainer.steps=2",
    "trainer.eval_every=2",
    "trainer.lr=3e-3",
    "rewards=[{name: exact_match}]",
)


def test_vlm_ddp_lora_ranks_stay_identical(tmp_path):
    ranks = launch(tmp_path, "vlm_rlvr", "vlm", *VLM)
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert w0 and all("lora_" in n for n in w0)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    assert any(w0[n].abs().sum() > 0 for n in w0 if "lora_B" in n)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    lines = (tmp_path / "vlm/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]


def test_vlm_ddp_dynamic_sampling_refill_takes_as_many_rounds_on_every_rank(tmp_path):
    """DAPO's refill under DDP: each rank's step generates until its own groups vary, but every round updates the
    statistics store (a collective), so the ranks agree on the number of rounds and the run finishes in step."""
    overrides = (
        "trainer.mode=group",
        "trainer.num_generations=2",
        "trainer.dynamic_sampling=true",
        "trainer.dynamic_sampling_rounds=3",
        "allocation.prompts_per_step=4",
    )
    ranks = launch(tmp_path, "vlm_rlvr", "refill", *VLM, *overrides)
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    lines = [json.loads(x) for x in (tmp_path / "refill/metrics.jsonl").read_text().splitlines()]
    rounds = [line["dynamic_sampling/rounds"] for line in lines if "dynamic_sampling/rounds" in line]
    assert len(rounds) == 2 and all(1 <= r <= 3 for r in rounds)


def test_vlm_fsdp_full_finetune_matches_ddp_and_resumes_exactly(tmp_path):
    # full fine-tuning (vision tower frozen), KL to a sharded reference, 3 LM-head chunks per scoring forward
    common = (
        *VLM,
        "model.lora=null",
        "trainer.beta=0.04",
        "trainer.lr=1e-3",
        "trainer.logprob_chunk_size=3",
        "run.save_every=1",
    )
    ddp = launch(tmp_path, "vlm_rlvr", "full_ddp", *common, "trainer.steps=3")
    fsdp = launch(tmp_path, "vlm_rlvr", "full_fsdp", *common, env=fsdp_env())
    base = assert_fsdp_two_steps_equal_ddp(tmp_path, ddp, fsdp)
    assert not any("visual" in n for n in base)  # the vision tower stays frozen
    assert fsdp[0]["metrics"] == fsdp[1]["metrics"]
    # rank 0 saved the sharded model whole, frozen vision tower included, as a from_pretrained folder
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tmp_path / "full_fsdp/checkpoints/step_00000002/model"
    AutoProcessor.from_pretrained(folder)
    saved = dict(AutoModelForImageTextToText.from_pretrained(folder).named_parameters())
    reference = dict(
        AutoModelForImageTextToText.from_pretrained(ROOT / "checkpoints/shapes_vlm").named_parameters()
    )
    assert saved.keys() == reference.keys() and any("visual" in n for n in saved)
    assert all(torch.equal(saved[n], fsdp[0]["weights"][n]) for n in base)
    assert all(torch.equal(saved[n], reference[n]) for n in saved if n not in base)
    # resumed on 2 ranks (sharded optimizer state and each rank's RNG restored), the third step is DDP's third
    resumed = launch(
        tmp_path, "vlm_rlvr", "full_fsdp", *common, "trainer.steps=3", "run.resume=true", env=fsdp_env()
    )
    for n in base:
        torch.testing.assert_close(resumed[0]["weights"][n], ddp[0]["weights"][n], rtol=0, atol=1e-6)
    assert resumed[0]["metrics"]["eval/reward_mean"] == pytest.approx(
        ddp[0]["metrics"]["eval/reward_mean"], abs=1e-6
    )


def test_vlm_fsdp_dynamic_sampling_pads_the_rank_with_fewer_groups_and_matches_ddp(tmp_path):
    """DAPO's dynamic sampling under FSDP: the ranks keep different numbers of groups, hence of minibatches
    (one group of two rollouts each); the rank with fewer adds padding minibatches whose loss counts 0, so the
    sharded forwards pair up, and the two steps are DDP's."""
    common = (
        *VLM,
        "model.lora=null",
        "trainer.lr=1e-3",
        "trainer.mode=group",
        "trainer.num_generations=2",
        "trainer.dynamic_sampling=true",
        "allocation.prompts_per_step=4",
        "trainer.minibatch_size=2",
        "run.save_every=1",
    )
    ddp = launch(tmp_path, "vlm_rlvr", "full_ddp", *common)
    fsdp = launch(tmp_path, "vlm_rlvr", "full_fsdp", *common, env=fsdp_env())
    # several minibatches a step are reduced per backward under FSDP, summed first under DDP: the rounding
    # differs, and Adam's first step, g / |g|, turns it into up to ~1e-5 on weights whose gradient is near 0
    # (1.2e-5 seen on one machine); a padding minibatch that counted would move the weights by about the
    # learning rate, 1e-3, ten times the tolerance
    assert_fsdp_two_steps_equal_ddp(tmp_path, ddp, fsdp, atol=1e-4)
    lines = [json.loads(x) for x in (tmp_path / "full_fsdp/metrics.jsonl").read_text().splitlines()]
    padded = [line["train/padding_minibatches"] for line in lines if "train/padding_minibatches" in line]
    assert sum(padded) > 0  # (the mean over the ranks: one rank padded at least once)


def test_vlm_fsdp_gathers_float32_master_weights_of_a_bfloat16_model(tmp_path):
    """model.dtype bfloat16, master weights float32: the language model's shards stay float32 beside the frozen
    bfloat16 vision tower, are gathered in bfloat16 for generate and the scoring forwards (under autocast),
    gradients are reduced in float32, and the steps train."""
    common = (*VLM, "model.lora=null", "model.dtype=bfloat16", "trainer.beta=0.04", "trainer.lr=1e-4")
    assert_trained_float32_shards(launch(tmp_path, "vlm_rlvr", "vlm_bf16_fsdp", *common, env=fsdp_env()))


def test_vlm_fsdp_pure_bfloat16_kahan_adamw_resumes_exactly(tmp_path):
    """model.master_weight_dtype bfloat16 with trainer.optimizer=adamw_kahan: bfloat16 shards whose KahanAdamW
    states (bfloat16 momentum and compensation, float32 second moment) are sharded DTensors, saved whole and
    resharded on resume, so two steps plus a resumed third equal three steps in one run, bit for bit."""
    common = (
        *VLM,
        "model.lora=null",
        "model.dtype=bfloat16",
        "model.master_weight_dtype=bfloat16",
        "trainer.optimizer=adamw_kahan",
        "trainer.lr=1e-4",
        "run.save_every=1",
    )
    straight = launch(tmp_path, "vlm_rlvr", "kahan_straight", *common, "trainer.steps=3", env=fsdp_env())
    launch(tmp_path, "vlm_rlvr", "kahan", *common, env=fsdp_env())
    resumed = launch(
        tmp_path, "vlm_rlvr", "kahan", *common, "trainer.steps=3", "run.resume=true", env=fsdp_env()
    )
    trained, base = straight[0]["weights"], straight[0]["initial"]
    assert straight[0]["sharded"] and {t.dtype for t in trained.values()} == {torch.bfloat16}
    assert max(float((trained[n].float() - base[n].float()).abs().max()) for n in base) > 0
    assert all(torch.equal(resumed[0]["weights"][n], trained[n]) for n in trained)


def test_vlm_fsdp_pairs_up_uneven_completion_lengths(tmp_path):
    # one sequence per minibatch and one position per LM-head chunk: the ranks' completions need different numbers
    # of head calls, and each call of the sharded head is a collective; the ranks agree on the largest count.
    # (One step: with several minibatches FSDP reduces each one's gradients on its own, a different order of float
    # sums than DDP's, which Adam's normalisation can amplify on later steps.)
    common = (
        *VLM,
        "model.lora=null",
        "trainer.beta=0",
        "trainer.lr=1e-3",
        "trainer.minibatch_size=1",
        "trainer.logprob_chunk_size=1",
        "trainer.steps=1",
        "trainer.eval_every=1",
    )
    ddp = launch(tmp_path, "vlm_rlvr", "uneven_ddp", *common)
    fsdp = launch(tmp_path, "vlm_rlvr", "uneven_fsdp", *common, env=fsdp_env())
    base = ddp[0]["initial"]
    assert max(float((ddp[0]["weights"][n] - base[n]).abs().max()) for n in base) > 1e-4
    # Adam's first step is lr * g / (|g| + eps): for a gradient entry within a few eps of 0, the float32 rounding of
    # FSDP's per-minibatch reductions (8 here) against DDP's single sum moves that entry's step by ~1e-3 of lr; 1e-5
    # is 1% of one step (lr 1e-3), while a gradient of the wrong sign moves an entry by 2 * lr
    for n in base:
        torch.testing.assert_close(fsdp[0]["weights"][n], ddp[0]["weights"][n], rtol=0, atol=1e-5)


def test_vlm_fsdp_refuses_lora_with_the_ddp_config_named(tmp_path):
    with pytest.raises(
        AssertionError, match=r"LoRA \(model\.lora\).*launch with configs/accelerate/ddp\.yaml"
    ):
        launch(tmp_path, "vlm_rlvr", "vlm_fsdp_lora", *VLM, env=fsdp_env())
