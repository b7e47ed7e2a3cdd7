"""Mixed precision for the flow trainer: step time and fidelity of ``model.autocast=bfloat16`` against float32.

    python -m benchmarks.flow_precision [--config configs/demo/flow_shapes.yaml] [--steps 6] [--eval-prompts 200]

Two trainers from the same config (the committed base checkpoint), one computing in float32 and one under
``torch.autocast(bfloat16)`` (weights, LoRA and optimizer in float32 for both), run interleaved training steps,
one of each in turn after a warm-up step each, so both see the same machine load. Reported: the median step time
of each and their ratio; the relative error of the bfloat16 velocity on one batch of noised held-out samples; and
the held-out strict score of the base model sampled both ways (the demo's evaluation protocol).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer


def build(config: str, autocast: str | None, overrides: list[str]) -> FlowGRPOTrainer:
    extra = ["run.progress=false", f"model.autocast={autocast or 'null'}", *overrides]
    trainer = FlowGRPOTrainer(load_config(FlowGRPOConfig, config, extra), None)
    trainer.setup()
    return trainer


def velocity_error(full: FlowGRPOTrainer, mixed: FlowGRPOTrainer, prompts: list[str]) -> float:
    """``||v_bf16 - v_fp32|| / ||v_fp32||`` over one batch at the sampler's sigmas (same weights, same inputs)."""
    adapter = full.adapter
    s = full.cfg.sampling
    sigmas = adapter.sigmas(s.num_steps, s.height, s.width, s.num_frames)[:-1].float()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((len(prompts), *adapter.latent_shape(s.height, s.width)), generator=generator)
    sigma = sigmas[torch.randint(sigmas.numel(), (len(prompts),), generator=generator)]
    cond = adapter.encode(prompts)
    with torch.no_grad():
        v32 = adapter.velocity(x, sigma, cond, 1.0)
        v16 = mixed.adapter.velocity(x, sigma, mixed.adapter.encode(prompts), 1.0)
    return float((v16 - v32).norm() / v32.norm())


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo/flow_shapes.yaml")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each precision")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts of the score check")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = [f"trainer.eval_prompts={args.eval_prompts}", *args.overrides]
    trainers = {
        "float32": build(args.config, None, overrides),
        "bfloat16": build(args.config, "bfloat16", overrides),
    }
    report: dict[str, object] = {"threads": torch.get_num_threads()}
    report["velocity_rel_error"] = velocity_error(
        trainers["float32"], trainers["bfloat16"], trainers["float32"].eval_pool[:64]
    )
    # the demo evaluates with eval_rewards = the strict verifier, so eval/reward_mean is the strict score
    report["heldout_strict_base"] = {name: t.evaluate()["eval/reward_mean"] for name, t in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for t in trainers.values():  # warm-up: first allocations, first backward
        t.train_step()
    for _ in range(args.steps):
        for name, t in trainers.items():
            start = time.perf_counter()
            t.train_step()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(v) for name, v in times.items()}
    report["step_seconds_median"] = median
    report["bfloat16_speedup"] = median["float32"] / median["bfloat16"]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
