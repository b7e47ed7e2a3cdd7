"""The flow GRPO demo as a measurement: held-out score against NFE and wall-clock, and the trainer's overhead.

    python -m benchmarks.flow_grpo [--config configs/demo/flow_shapes.yaml] [--steps N]

Trains the demo config (from the committed base checkpoint), then prints the held-out strict shapes score at
every evaluation against the transformer evaluations spent (``nfe/total``) and the wall-clock, and splits the
step time into transformer forward, backward, reward scoring and everything else (the trainer's own overhead:
sampling bookkeeping, SDE math, advantages, optimizer, logging).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer
from mmrl.run import Run, read_metrics


class Timers:
    """Wall time spent inside denoiser forwards (the policy's, and those of the modules swapped in for it),
    autograd backward passes and reward calls."""

    def __init__(self) -> None:
        self.forward = self.backward = self.reward = 0.0
        self.forward_calls = 0
        self._t0 = 0.0
        self._depth = 0

    def pre(self, *_: object) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
            self.forward_calls += 1
        self._depth += 1

    def post(self, *_: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.forward += time.perf_counter() - self._t0


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo/flow_shapes.yaml")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = ["run.name=bench_flow_grpo", "run.overwrite=true", "run.progress=false", *args.overrides]
    if args.steps is not None:
        overrides.append(f"trainer.steps={args.steps}")
    cfg = load_config(FlowGRPOConfig, args.config, overrides)
    run = Run(cfg.run, cfg)
    trainer = FlowGRPOTrainer(cfg, run)
    trainer.setup()
    timers = Timers()
    timed: set[int] = set()

    def time_forwards(module: torch.nn.Module) -> None:
        if id(module) not in timed:
            timed.add(id(module))
            module.register_forward_pre_hook(timers.pre)
            module.register_forward_hook(timers.post)

    time_forwards(trainer.adapter.transformer)
    # the distillation teacher, a full fine-tune's reference and the quantized explorer run in its place
    swapped_denoiser = trainer.adapter.swapped_denoiser

    @contextmanager
    def timed_swap(module: torch.nn.Module) -> Iterator[None]:
        time_forwards(module)
        with swapped_denoiser(module):
            yield

    trainer.adapter.swapped_denoiser = timed_swap
    backward = torch.autograd.backward

    def timed_backward(*a: object, **k: object) -> None:
        start = time.perf_counter()
        backward(*a, **k)
        timers.backward += time.perf_counter() - start

    torch.autograd.backward = timed_backward
    score = trainer.score

    def timed_score(*a: object, **k: object):
        start = time.perf_counter()
        out = score(*a, **k)
        timers.reward += time.perf_counter() - start
        return out

    trainer.score = timed_score
    # time the training steps alone (evaluations run between steps and are not counted as step time)
    spent = {"step": 0.0, "forward": 0.0, "backward": 0.0, "reward": 0.0}
    train_step = trainer.train_step

    def timed_step() -> dict[str, float]:
        before = {"forward": timers.forward, "backward": timers.backward, "reward": timers.reward}
        start = time.perf_counter()
        out = train_step()
        spent["step"] += time.perf_counter() - start
        for key, value in before.items():
            spent[key] += getattr(timers, key) - value
        return out

    trainer.train_step = timed_step
    try:
        trainer.train()
    finally:
        torch.autograd.backward = backward
        trainer.cleanup()
    step_time, fwd, bwd, rew = spent["step"], spent["forward"], spent["backward"], spent["reward"]
    other = step_time - fwd - bwd - rew
    curve = [
        (r["step"], r.get("nfe/total", 0.0), r["time"], r["eval/shapes/mean"])
        for r in read_metrics(Path(cfg.run.output_dir) / cfg.run.name)
        if "eval/shapes/mean" in r
    ]
    print("held-out strict shapes score:")
    print(f"{'step':>6s} {'NFE':>10s} {'wall s':>8s} {'score':>7s}")
    for step, nfe, wall, score_ in curve:
        print(f"{step:6d} {nfe:10.0f} {wall:8.1f} {score_:7.3f}")
    print(
        f"training steps: {step_time:.1f} s in all; transformer forward {fwd / step_time:.1%}, backward "
        f"{bwd / step_time:.1%}, reward {rew / step_time:.1%}, trainer overhead {other / step_time:.1%}"
    )
    result = {
        "curve": curve,
        "step_time_s": step_time,
        "forward_frac": fwd / step_time,
        "backward_frac": bwd / step_time,
        "reward_frac": rew / step_time,
        "overhead_frac": other / step_time,
        "forward_calls": timers.forward_calls,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
