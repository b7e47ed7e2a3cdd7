"""Real-size smoke test of the flow and VLM recipes: each recipe's published architecture with random weights
on a GPU, two training steps of the real trainer, its memory against ``mmrl memory`` and its step time.

    python -m benchmarks.real_size [--recipes configs/flow/A.yaml configs/vlm/B.yaml ...] [--steps 2]
                                   [--prompts 1] [--images 2] [--image-size 448] [--device cuda]
                                   [--out FILE.json] [--set KEY=VALUE ...]

No checkpoint is downloaded. The trainer is the recipe's own (its LoRA, dtype, gradient checkpointing, master
weights, EMA, explorer, resolution, steps and window, generation length), with its model built otherwise:

* flow (``recipe: flow_grpo``): the components are built from the configs embedded in
  :mod:`pipelines.flow.published` (:func:`~pipelines.flow.published.build_random`: each class's own random
  initialisation, drawn in ``model.dtype`` on the device), with the tokenizers and scheduler of the family's
  tiny pipeline (:mod:`pipelines.flow.tiny`; token ids of a small vocabulary are valid ids of the real one).
  Prompts are a few generic ones and the reward is JPEG incompressibility (no reward model to download; reward
  models are not what is measured).
* VLM (``recipe: vlm_rlvr``): the model is built from the config embedded in :mod:`pipelines.vlm.published`
  (:func:`~pipelines.vlm.published.build_random`) with the processor of
  :func:`~pipelines.vlm.published.build_processor`: the family's tiny tokenizer, trained on the run's
  questions, and the published image processor, so each image gives the real model's number of image tokens.
  The config's special-token ids are the tiny tokenizer's; nothing else differs from the real checkpoint but
  the weights. The questions are generated arithmetic about shapes on ``--image-size`` square scenes
  (``shapes_math``; the recipes' Geometry3K files are not here), scored by the recipe's own verifiers.
  Rollouts use the transformers backend: vLLM loads weights from a checkpoint folder and cannot take a model
  built in memory, so a recipe with ``generation.backend: vllm`` runs ``hf`` and its row says so (the
  memory estimate then holds no engine share). A random model almost never samples a stop token, so each
  completion runs to the recipe's ``generation.max_new_tokens``: the step's worst case. DAPO dynamic sampling
  is off (all-wrong random answers would drop every group and leave no update to measure).

Each step rolls out ``--prompts`` x ``--images`` samples instead of the recipe's batch (a single-rollout VLM
recipe: as many prompts, one rollout each), in one minibatch. A recipe whose ``mmrl memory`` peak does not fit
the device's free memory is skipped and said so.

Per recipe: the estimate's resident and peak bytes (weights and training state, before activations); measured
``torch.cuda.memory_allocated`` after setup and after the first step (AdamW states exist from then on) and the
peak ``max_memory_allocated`` (activations included) over the steps; each step's seconds. On a CPU (a check of
the code path, e.g. ``--device cpu`` with a tiny local pipeline or VLM folder as ``model.path``) memory is not
measured, and a recipe whose estimate exceeds :data:`CPU_LIMIT_GIB` is skipped.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.options import add_set_option
from mmrl.config import Config, load_config, load_yaml
from mmrl.device import DTYPES
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.memory import estimate_memory as estimate_flow_memory
from mmrl.flow.trainer import FlowGRPOTrainer
from mmrl.memory import GIB, MemoryEstimate
from mmrl.trainer_base import TrainerBase
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.memory import estimate_memory as estimate_vlm_memory
from mmrl.vlm.trainer import VLMRLVRTrainer, load_examples
from pipelines.flow.adapters import get_adapter
from pipelines.flow.adapters.base import FlowAdapter
from pipelines.flow.published import build_random
from pipelines.flow.tiny import build_tiny_pipeline
from pipelines.vlm import published as vlm_published

#: largest model (weights and training state) built on a CPU, where the benchmark only checks its code path
CPU_LIMIT_GIB = 4.0
PROMPTS = (
    "a red bicycle leaning on a brick wall",
    "a bowl of lemons on a wooden table",
    "a lighthouse at dusk",
)


class RandomWeightsFlowTrainer(FlowGRPOTrainer):
    """The flow trainer on the published architecture of ``model.path`` with random weights."""

    def load_model(self) -> FlowAdapter:
        model = self.cfg.model
        pipe = build_tiny_pipeline(model.family)  # tokenizers and scheduler; its tiny models are replaced
        for name, module in build_random(model.path, DTYPES[model.dtype], self.device).items():
            setattr(pipe, name, module)
        adapter_class = get_adapter(model.family)
        options = {
            key: value for key, value in model.options.items() if key in adapter_class.adapter_options()
        }
        return adapter_class(pipe, **options)


class RandomWeightsVLMTrainer(VLMRLVRTrainer):
    """The VLM trainer on the published architecture of ``model.path`` with random weights, driven by the
    processor of :func:`pipelines.vlm.published.build_processor` (its tokenizer trained on the run's
    questions)."""

    def load_model(self) -> tuple[Any, torch.nn.Module]:
        model = self.cfg.model
        corpus = [f"{ex.question} {ex.answer}" for ex in load_examples(self.cfg, "train")]
        processor = vlm_published.build_processor(model.path, corpus)
        return processor, vlm_published.build_random(model.path, processor, DTYPES[model.dtype], self.device)


def flow_config(recipe: str, prompts_file: Path, args: argparse.Namespace) -> tuple[FlowGRPOConfig, str]:
    """The flow recipe with the smoke test's prompts, reward and batch (see the module docstring); its rollout
    engine is the recipe's own ("")."""
    cfg = load_config(FlowGRPOConfig, recipe, [])
    reward = "{name: jpeg_incompressibility}"
    if cfg.sampling.num_frames is not None:
        reward = "{name: video_frames, options: {reward: jpeg_incompressibility}}"
    overrides = [
        f"train_prompts={prompts_file}",
        f"eval_prompts={prompts_file}",
        f"rewards=[{reward}]",
        "eval_rewards=null",
        "extra_eval={}",
        f"model.device={args.device}",
        f"allocation.prompts_per_step={args.prompts}",
        f"allocation.rollouts_per_step={args.prompts * args.images}",
        "allocation.method=uniform",
        f"allocation.n_min={args.images}",
        f"allocation.n_max={args.images}",
        f"trainer.minibatch_size={args.prompts * args.images}",
        "trainer.drop_zero_advantage=false",
        "run.progress=false",
        "run.tensorboard=false",
        *args.overrides,
    ]
    return load_config(FlowGRPOConfig, recipe, overrides), ""


def vlm_config(recipe: str, prompts_file: Path, args: argparse.Namespace) -> tuple[VLMRLVRConfig, str]:
    """The VLM recipe with the smoke test's questions, backend and batch (see the module docstring), and what
    it changed of the recipe's rollout engine ("" when nothing).

    Raises:
        ValueError: ``model.load_in_4bit`` (random weights are not quantized, so the smoke test would measure
            another model than the recipe's).
    """
    recipe_cfg = load_config(VLMRLVRConfig, recipe, args.overrides)
    group = recipe_cfg.trainer.mode == "group"
    samples = args.prompts * args.images
    # single mode rolls out once per prompt: as many prompts as a group step has samples
    prompts = args.prompts if group else samples
    overrides = [
        "data.train=shapes_math:train",
        "data.eval=shapes_math:heldout",
        "data.train_mix={}",
        "data.extra_eval={}",
        f"data.image_size={args.image_size}",
        f"data.train_limit={prompts}",
        "data.eval_limit=1",
        f"model.device={args.device}",
        "generation.backend=hf",
        f"allocation.prompts_per_step={prompts}",
        f"trainer.minibatch_size={samples}",
        "run.progress=false",
        "run.tensorboard=false",
    ]
    if group:
        overrides += [
            f"trainer.num_generations={args.images}",
            "trainer.dynamic_sampling=false",
            "allocation.method=uniform",
            f"allocation.n_min={args.images}",
            f"allocation.n_max={args.images}",
        ]
    cfg = load_config(VLMRLVRConfig, recipe, [*overrides, *args.overrides])
    if cfg.model.load_in_4bit:
        raise ValueError(
            f"{recipe}: model.load_in_4bit: the smoke test builds unquantized random weights; set it to false"
        )
    backend = recipe_cfg.generation.backend
    changed = "" if backend == "hf" else f"hf (recipe: {backend}; it cannot load a model built in memory)"
    return cfg, changed


@dataclass(frozen=True)
class Smoke:
    """How a kind of recipe is smoke-tested: its config, its random-weights trainer, its memory estimate.

    ``config(recipe, prompts_file, args)`` returns the smoke test's config and what it changed of the recipe's
    rollout engine, for the row's ``backend`` ("" when nothing).
    """

    config: Callable[[str, Path, argparse.Namespace], tuple[Config, str]]
    trainer: type[TrainerBase]
    estimate: Callable[[Any], MemoryEstimate]


#: ``recipe:`` key -> its smoke test
SMOKES: dict[str, Smoke] = {
    "flow_grpo": Smoke(flow_config, RandomWeightsFlowTrainer, estimate_flow_memory),
    "vlm_rlvr": Smoke(vlm_config, RandomWeightsVLMTrainer, estimate_vlm_memory),
}


def measure(recipe: str, prompts_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One recipe's row (see the module docstring); ``skipped`` says why a recipe was not run."""
    row: dict[str, Any] = {"recipe": Path(recipe).stem}
    kind = str(load_yaml(recipe).get("recipe"))
    if kind not in SMOKES:
        row["skipped"] = f"recipe {kind!r} has no smoke test (those with one: {sorted(SMOKES)})"
        return row
    smoke = SMOKES[kind]
    cfg, backend = smoke.config(recipe, prompts_file, args)
    if backend:
        row["backend"] = backend
    estimate = smoke.estimate(cfg)
    row["estimate_resident_gib"] = estimate.resident_bytes() / GIB
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        free, total = torch.cuda.mem_get_info()
        row["estimate_peak_gib"] = estimate.peak_bytes(total) / GIB
        if estimate.peak_bytes(total) > free:
            row["skipped"] = (
                f"needs {row['estimate_peak_gib']:.1f} GiB before activations, {free / GIB:.1f} free"
            )
            return row
        torch.cuda.reset_peak_memory_stats()
    elif estimate.resident_bytes() > CPU_LIMIT_GIB * GIB:
        row["skipped"] = (
            f"a {row['estimate_resident_gib']:.1f} GiB model is no CPU check (tiny model.path: --set)"
        )
        return row
    trainer = smoke.trainer(cfg, None)
    start = time.perf_counter()
    trainer.setup()
    row["setup_s"] = time.perf_counter() - start
    if cuda:
        row["after_setup_gib"] = torch.cuda.memory_allocated() / GIB
    seconds = []
    for step in range(args.steps):
        start = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if cuda and step == 0:
            row["after_step_gib"] = torch.cuda.memory_allocated() / GIB
    row["step_s"] = seconds
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    trainer.cleanup()
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=sorted(
            str(p) for folder in ("configs/flow", "configs/vlm") for p in Path(folder).glob("*.yaml")
        ),
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per recipe")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument(
        "--images", type=int, default=2, help="samples per prompt (images, videos, completions)"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=448,
        help="side of the VLM questions' square images (448: 256 image tokens for Qwen2.5-VL, 196 for "
        "Qwen3-VL; Gemma 3 resizes every image to 896 px and takes 256)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    add_set_option(parser, "config overrides applied to every recipe after the smoke test's own")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        for recipe in args.recipes:
            row = measure(recipe, prompts_file, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out is not None:  # after every recipe: a later one running out of time loses nothing
                args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
