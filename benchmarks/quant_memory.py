"""Weight memory, output error and forward time of the quantized explorer copies (pipelines/quant.py).

    python -m benchmarks.quant_memory [--device cpu] [--repeats 5]

A randomly initialised SD3 transformer of a few million parameters (the real diffusers class, 4 joint blocks,
width 192), batch 2 at 32x32 latents with 16 text tokens. For each scheme this device can run: weight bytes
(:func:`pipelines.quant.weight_bytes`) and the ratio to fp32, the relative output error
``||y_q - y|| / ||y||`` against the fp32 forward, with the default skip list and with every Linear quantized,
and the median forward time. Goal (issue 6): nf4 weights >= 3.5x smaller than fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import SD3Transformer2DModel

from pipelines.quant import SCHEMES, check_scheme, quantize_copy, weight_bytes


def build(device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=6,
        joint_attention_dim=256,
        caption_projection_dim=192,
        pooled_projection_dim=128,
        pos_embed_max_size=32,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 16, 32, 32, generator=g),
        "encoder_hidden_states": torch.randn(2, 16, 256, generator=g),
        "pooled_projections": torch.randn(2, 128, generator=g),
        "timestep": torch.tensor([700.0, 300.0]),
    }
    return model.to(device), {k: v.to(device) for k, v in inputs.items()}


def run(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def median_ms(model: torch.nn.Module, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    run(model, inputs)  # warm-up: lazy kernel selection, bitsandbytes' first-call state setup
    times = []
    for _ in range(repeats):
        if inputs["hidden_states"].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(model, inputs)
        if inputs["hidden_states"].is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description="quantized explorer: weight memory and output error")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model, inputs = build(device)
    ref = run(model, inputs).float()
    fp32_bytes = weight_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"SD3Transformer2DModel, {n_params / 1e6:.2f} M params, {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    header = f"{'scheme':<16}{'weights MB':>11}{'vs fp32':>9}{'err default skip':>18}{'err all Linear':>16}{'fwd ms':>9}"
    print(header)
    print("-" * len(header))
    print(
        f"{'fp32 (policy)':<16}{fp32_bytes / 1e6:>11.2f}{1.0:>8.2f}x{0.0:>18.4f}{0.0:>16.4f}{median_ms(model, inputs, args.repeats):>9.1f}"
    )
    results = {}
    for scheme in SCHEMES:
        try:
            check_scheme(scheme, device)
        except (ValueError, ImportError) as err:
            print(f"{scheme:<16}skipped: {str(err).split(';')[0]}")
            continue
        explorer = quantize_copy(model, scheme)
        everything = quantize_copy(model, scheme, skip=())
        row = {
            "bytes": weight_bytes(explorer.module),
            "ratio": fp32_bytes / weight_bytes(explorer.module),
            "err_default_skip": rel_err(run(explorer.module, inputs), ref),
            "err_all_linear": rel_err(run(everything.module, inputs), ref),
            "forward_ms": median_ms(explorer.module, inputs, args.repeats),
        }
        results[scheme] = row
        print(
            f"{scheme:<16}{row['bytes'] / 1e6:>11.2f}{row['ratio']:>8.2f}x{row['err_default_skip']:>18.4f}"
            f"{row['err_all_linear']:>16.4f}{row['forward_ms']:>9.1f}"
        )
    return results


if __name__ == "__main__":
    main()
