"""Training in bfloat16: float32 master weights, pure bfloat16 AdamW and KahanAdamW (``trainer.optimizer:
adamw_kahan``), for how closely each follows float32 training, what it holds per trained value, and what its step
costs.

    python -m benchmarks.bf16_optimizers [--steps 2000] [--lrs 1e-6 1e-5 1e-4] [--timing-repeats 7] [--threads 2]

1. Fidelity: a 64 x 64 least-squares fit from noisy minibatches (fixed data, minibatch order and start, the start
   in bfloat16 values for every variant), run with float32 AdamW (the float32 run: what float32 master weights
   train) and, on bfloat16 weights, plain AdamW, KahanAdamW with its float32 second moment, and KahanAdamW with
   bfloat16 states (EasyR1's ``adamw_bf16``).
   Reported per learning rate: the distance of the weights each holds (KahanAdamW's plus its compensation) to the
   float32 run's, as a share of how far the float32 run moved, and the final loss.
2. Step time: one optimizer step over the tensors of one published Qwen3-VL-4B decoder layer (attention and MLP
   projections and norms, 101 M values) with random gradients, each optimizer timed in turn, repeated
   (``--timing-repeats``) and reported as the median and as a ratio to float32 AdamW, in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from mmrl.optim import KahanAdamW

Factory = Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]

#: name: (weights dtype, optimizer factory, bytes per trained value: weight, gradient, states)
VARIANTS: dict[str, tuple[torch.dtype, Factory, int]] = {
    "float32 AdamW (master weights)": (
        torch.float32,
        lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        16,
    ),
    "bfloat16 AdamW": (
        torch.bfloat16,
        lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        8,
    ),
    "bfloat16 KahanAdamW": (
        torch.bfloat16,
        lambda params, lr: KahanAdamW(params, lr=lr, weight_decay=0.0),
        12,
    ),
    "bfloat16 KahanAdamW, bfloat16 states (EasyR1)": (
        torch.bfloat16,
        lambda params, lr: KahanAdamW(params, lr=lr, weight_decay=0.0, variance_dtype=None),
        10,
    ),
}


def regression(dtype: torch.dtype, factory: Factory, lr: float, steps: int) -> tuple[torch.Tensor, float]:
    """The fit of the module docstring: the weights the optimizer holds after ``steps`` and their loss."""
    torch.manual_seed(0)
    inputs, target = torch.randn(4096, 64), torch.randn(64, 64) * 0.05
    # one start for every variant: bfloat16 values (as a bfloat16 checkpoint's), so the float32 run starts
    # where the bfloat16 ones do and the distance between runs is the optimizers' alone
    param = torch.nn.Parameter((torch.randn(64, 64) * 0.05).to(torch.bfloat16).to(dtype))
    optimizer = factory([param], lr)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = inputs[torch.randint(0, len(inputs), (64,), generator=generator)]
        error = rows @ param.float() - rows @ target
        param.grad = ((rows.T @ error) / len(rows)).to(dtype)
        optimizer.step()
    held = param.detach().float()
    if isinstance(optimizer, KahanAdamW):
        held = held + optimizer.state[param]["compensation"].float()
    loss = float(((inputs @ held - inputs @ target) ** 2).mean())
    return held, loss


def fidelity(lrs: list[float], steps: int) -> list[dict[str, object]]:
    rows = []
    for lr in lrs:
        start, _ = regression(torch.float32, VARIANTS["float32 AdamW (master weights)"][1], lr, 0)
        reference, _ = regression(torch.float32, VARIANTS["float32 AdamW (master weights)"][1], lr, steps)
        moved = float((reference - start).norm())
        for name, (dtype, factory, _) in VARIANTS.items():
            held, loss = regression(dtype, factory, lr, steps)
            off = float((held - reference).norm()) / moved
            rows.append({"lr": lr, "variant": name, "off_float32_run": round(off, 4), "loss": round(loss, 5)})
            print(f"lr {lr:g}  {name:48s} off the float32 run {off:7.2%}  loss {loss:.4e}", flush=True)
    return rows


def layer_shapes() -> list[tuple[int, ...]]:
    """One Qwen3-VL-4B text decoder layer (hidden 2560, 32 query and 8 key-value heads of 128, MLP 9728)."""
    hidden, heads, kv_heads, head_dim, mlp = 2560, 32, 8, 128, 9728
    return [
        (heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (hidden, heads * head_dim),
        (mlp, hidden),
        (mlp, hidden),
        (hidden, mlp),
        (head_dim,),
        (head_dim,),
        (hidden,),
        (hidden,),
    ]


def step_times(repeats: int) -> list[dict[str, object]]:
    generator = torch.Generator().manual_seed(0)
    setups = {}
    for name, (dtype, factory, bytes_per_value) in VARIANTS.items():
        params = [
            torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(dtype))
            for shape in layer_shapes()
        ]
        for param in params:
            param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(dtype)
        optimizer = factory(params, 1e-5)
        optimizer.step()  # the states are made at the first step: not timed
        setups[name] = (optimizer, bytes_per_value)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, (optimizer, _) in setups.items():  # interleaved: every optimizer sees the same machine load
            begin = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - begin)
    base = statistics.median(times["float32 AdamW (master weights)"])
    rows = []
    values = sum(torch.Size(shape).numel() for shape in layer_shapes())
    for name, (_, bytes_per_value) in setups.items():
        median = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "step_ms": round(1e3 * median, 1),
                "ratio_to_float32_adamw": round(median / base, 2),
                "bytes_per_trained_value": bytes_per_value,
            }
        )
        print(
            f"{name:48s} {1e3 * median:8.1f} ms per step of {values / 1e6:.0f} M values "
            f"({median / base:.2f}x float32 AdamW), {bytes_per_value} bytes per trained value",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of the fidelity fit")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--timing-repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {
        "threads": args.threads,
        "fidelity": fidelity(args.lrs, args.steps),
        "step_time": step_times(args.timing_repeats) if args.timing_repeats else [],
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
