"""Real-size smoke test of the flow recipes: each recipe's published architecture with random weights on a GPU,
two training steps of the real trainer, its memory against ``mmrl memory`` and its step time.

    python -m benchmarks.real_size [--recipes configs/flow/A.yaml ...] [--steps 2] [--prompts 1] [--images 2]
                                   [--device cuda] [--out FILE.json] [--set KEY=VALUE ...]

No checkpoint is downloaded: the components are built from the configs embedded in
:mod:`pipelines.flow.published` (:func:`~pipelines.flow.published.build_random`: each class's own random
initialisation, drawn in ``model.dtype`` on the device), with the tokenizers and scheduler of the family's tiny
pipeline (:mod:`pipelines.flow.tiny`; token ids of a small vocabulary are valid ids of the real one). The
trainer is the recipe's own (its LoRA, master weights, EMA, explorer, resolution, steps and window), except:
prompts are a few generic ones, the reward is JPEG incompressibility (no reward model to download; reward
models are not what is measured), and each step rolls out ``--prompts`` x ``--images`` samples instead of the
recipe's batch. A recipe whose ``mmrl memory`` peak does not fit the device's free memory is skipped and said so.

Per recipe: the estimate's resident and peak bytes (weights and training state, before activations); measured
``torch.cuda.memory_allocated`` after setup and after the first step (AdamW states exist from then on) and the
peak ``max_memory_allocated`` (activations included) over the steps; each step's seconds. On a CPU (a check of
the code path, e.g. ``--device cpu`` with a tiny local pipeline as ``model.path``) memory is not measured.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.options import add_set_option
from mmrl.config import load_config
from mmrl.device import DTYPES
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.memory import estimate_memory
from mmrl.flow.trainer import FlowGRPOTrainer
from mmrl.memory import GIB
from pipelines.flow.adapters import get_adapter
from pipelines.flow.adapters.base import FlowAdapter
from pipelines.flow.published import build_random
from pipelines.flow.tiny import build_tiny_pipeline

#: largest model (weights and training state) built on a CPU, where the benchmark only checks its code path
CPU_LIMIT_GIB = 4.0
PROMPTS = (
    "a red bicycle leaning on a brick wall",
    "a bowl of lemons on a wooden table",
    "a lighthouse at dusk",
)


class RandomWeightsTrainer(FlowGRPOTrainer):
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


def smoke_config(recipe: str, prompts_file: Path, args: argparse.Namespace) -> FlowGRPOConfig:
    """The recipe with the smoke test's prompts, reward and batch (see the module docstring)."""
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
    return load_config(FlowGRPOConfig, recipe, overrides)


def measure(recipe: str, prompts_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    cfg = smoke_config(recipe, prompts_file, args)
    estimate = estimate_memory(cfg)
    row: dict[str, Any] = {
        "recipe": Path(recipe).stem,
        "estimate_resident_gib": estimate.resident_bytes() / GIB,
    }
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
    trainer = RandomWeightsTrainer(cfg, None)
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
        "--recipes", nargs="+", default=sorted(str(p) for p in Path("configs/flow").glob("*.yaml"))
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per recipe")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--images", type=int, default=2, help="samples per prompt")
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
