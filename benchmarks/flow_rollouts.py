"""Flat vs branching vs two-stage rollouts: network evaluations, wall-clock, explorer memory and agreement.

    python -m benchmarks.flow_rollouts --part a      # flat vs branch at equal leaves: NFE and wall-clock ratios
    python -m benchmarks.flow_rollouts --part c      # explorer weight memory (nf4/fp4/int8 vs fp32), Spearman
    python -m benchmarks.flow_rollouts --part b      # held-out score vs NFE and time: flat / branch / explore runs

(a) 16 leaves per prompt, 16 steps, on the shapes model architecture: flat groups of 16 SDE samples against trees
    splitting at steps 2, 4, 6, 8 (factor 2; --splits), every depth of every tree in one batch. Goals: NFE per final sample
    <= 0.6x flat; wall-clock ratio within 1.2x of the NFE ratio (the saving is real).
(b) trains the three demo configs (flat, branch, explore) from the committed base checkpoint and reports held-out
    score against NFE spent and wall-clock (goal: branch or explore reaches flat's final score with <= 0.6x the NFE),
    per seed (--seeds) and as the mean over seeds; --eval-every sets how finely "reaches" is resolved.
(c) weight memory of quantized explorers (goal nf4 >= 3.5x smaller than fp32) and rank agreement of previews with
    full-precision samples of the same seeds (goal >= 0.8 on the demo).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mmrl.data.shapes import all_prompts, sample_prompts
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.branch import TreeConfig, tree_nfe, tree_rollout
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.flow.tiny import build_shapes_pipeline

DEMO_CHECKPOINT = Path("checkpoints/shapes_flow")


def load_model(tmp: Path) -> ShapesAdapter:
    """The committed shapes checkpoint when present, else a random model of the same architecture."""
    if (DEMO_CHECKPOINT / "model_index.json").is_file():
        return ShapesAdapter.from_pretrained(str(DEMO_CHECKPOINT))
    torch.manual_seed(0)
    build_shapes_pipeline(all_prompts()).save_pretrained(tmp)
    return ShapesAdapter.from_pretrained(str(tmp))


def part_a(adapter: ShapesAdapter, prompts: int, repeats: int, splits: tuple[int, ...]) -> dict[str, float]:
    steps, leaves = 16, 16
    tree = TreeConfig(split_steps=splits, branch_factor=2)
    config = SamplingConfig(num_steps=steps, height=32, width=32, noise_level=0.7)
    batch = sample_prompts(prompts, 0, "train")

    def run_flat() -> int:
        return rollout(adapter, batch, leaves, config, generator=torch.Generator().manual_seed(0)).nfe

    def run_tree() -> int:
        return tree_rollout(adapter, batch, config, tree, generator=torch.Generator().manual_seed(0)).nfe

    run_flat(), run_tree()  # warm-up
    flat_t, tree_t = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine load
        start = time.perf_counter()
        flat_nfe = run_flat()
        flat_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        tree_nfe_ = run_tree()
        tree_t.append(time.perf_counter() - start)
    assert tree_nfe_ == tree_nfe(prompts, steps, tree)
    nfe_ratio = tree_nfe_ / flat_nfe
    wall_ratio = statistics.median(tree_t) / statistics.median(flat_t)
    out = {
        "prompts": prompts,
        "leaves_per_prompt": leaves,
        "flat_nfe_per_sample": flat_nfe / (prompts * leaves),
        "branch_nfe_per_sample": tree_nfe_ / (prompts * leaves),
        "nfe_ratio": nfe_ratio,
        "flat_s": statistics.median(flat_t),
        "branch_s": statistics.median(tree_t),
        "wall_ratio": wall_ratio,
        "wall_over_nfe_ratio": wall_ratio / nfe_ratio,
    }
    print(f"(a) {prompts} prompts x {leaves} leaves, {steps} steps, median of {repeats}")
    print(
        f"    NFE per final sample: flat {out['flat_nfe_per_sample']:.2f}, branch {out['branch_nfe_per_sample']:.2f}"
        f"  -> ratio {nfe_ratio:.3f} (goal <= 0.6)"
    )
    print(
        f"    wall-clock per batch: flat {out['flat_s']:.2f} s, branch {out['branch_s']:.2f} s -> ratio {wall_ratio:.3f}"
        f" = {out['wall_over_nfe_ratio']:.2f}x the NFE ratio (goal <= 1.2x)"
    )
    return out


def part_c(adapter: ShapesAdapter, prompts: int, candidates: int, guidance: float) -> dict[str, float]:
    import rewards
    from pipelines.flow.explore import ExploreConfig, explore, spearman, spearman_within
    from pipelines.quant import quantize_copy, weight_bytes

    full = weight_bytes(adapter.transformer)
    out: dict[str, float] = {"fp32_mb": full / 1e6}
    for scheme in ("int8", "nf4", "fp4"):
        q = quantize_copy(adapter.transformer, scheme)
        out[f"{scheme}_mb"] = weight_bytes(q.module) / 1e6
        out[f"{scheme}_ratio"] = full / weight_bytes(q.module)
    print(
        f"(c) transformer weights: fp32 {out['fp32_mb']:.2f} MB; "
        + ", ".join(
            f"{s} {out[s + '_mb']:.2f} MB ({out[s + '_ratio']:.2f}x smaller)" for s in ("int8", "nf4", "fp4")
        )
    )
    verifier = rewards.build("shapes")

    def graded(images: torch.Tensor, batch_prompts: list[str]) -> torch.Tensor:
        # mean of the four criteria: graded, so ranks are informative even when the strict score ties
        from mmrl.images import tensor_to_pil

        res = verifier.score(images=tensor_to_pil(images), prompts=batch_prompts)
        return torch.stack(list(res.components.values()), dim=1).mean(dim=1)

    sampling = SamplingConfig(num_steps=10, height=32, width=32, sde_window=(0, 0), guidance_scale=guidance)
    batch = sample_prompts(prompts, 1, "heldout")
    for scheme, preview_steps in (("nf4", 10), ("int8", 10), ("nf4", 4)):
        q = quantize_copy(adapter.transformer, scheme)
        cfg = ExploreConfig(
            candidates=candidates,
            preview_steps=preview_steps,
            keep_best=candidates // 2,
            keep_worst=candidates - candidates // 2,
        )
        res = explore(
            adapter, q.module, batch, sampling, cfg, graded, generator=torch.Generator().manual_seed(0)
        )
        # full precision, the sampler of evaluation (10 Euler steps), from the same seeds
        regenerated = rollout(adapter, batch, candidates, sampling, noise=res.noise)
        full = graded(regenerated.images, regenerated.prompts)
        # the selection ranks each prompt's seeds: the goal's figure is the rank agreement within a prompt; the
        # pooled one also credits the preview for telling easy prompts from hard ones
        rho = spearman_within(res.chosen_preview_rewards, full, res.chosen.shape[1])
        pooled = spearman(res.chosen_preview_rewards, full)
        out[f"{scheme}_{preview_steps}steps_spearman"] = rho
        out[f"{scheme}_{preview_steps}steps_spearman_pooled"] = pooled
        print(
            f"    {scheme} preview ({preview_steps} steps) vs full precision (10 steps), {prompts} prompts x "
            f"{candidates} seeds: Spearman within a prompt {rho:.3f} (goal >= 0.8), "
            f"pooled over prompts {pooled:.3f}"
        )
    return out


DEMO_CONFIGS = {
    "flat": "configs/demo/flow_shapes.yaml",
    "branch": "configs/demo/flow_shapes_branch.yaml",
    "explore": "configs/demo/flow_shapes_explore.yaml",
}


def part_b(
    steps: int | None, seeds: list[int], eval_every: int | None, variants: list[str]
) -> dict[str, object]:
    from mmrl.config import load_config
    from mmrl.flow.config import FlowGRPOConfig
    from mmrl.flow.trainer import main
    from mmrl.run import read_metrics

    results: dict[str, dict[str, object]] = {}
    for name in variants:
        runs = {}
        for seed in seeds:
            overrides = [
                f"run.name=bench_{name}_s{seed}",
                f"run.seed={seed}",
                "run.overwrite=true",
                "run.progress=false",
            ]
            overrides += [f"trainer.steps={steps}"] if steps else []
            overrides += [f"trainer.eval_every={eval_every}"] if eval_every else []
            cfg = load_config(FlowGRPOConfig, DEMO_CONFIGS[name], overrides)
            start = time.perf_counter()
            main(cfg)
            records = [
                r for r in read_metrics(Path(cfg.run.output_dir) / cfg.run.name) if "eval/reward_mean" in r
            ]
            # r["time"]: seconds since the run began, its setup and every evaluation so far included
            curve = [(r["step"], r.get("nfe/total", 0.0), r["time"], r["eval/reward_mean"]) for r in records]
            runs[seed] = {"curve": curve, "wall_s": time.perf_counter() - start}
            print(name, seed, json.dumps(runs[seed]))
        # the mean over seeds at each evaluation (NFE and wall-clock of the first seed: the same steps)
        first = runs[seeds[0]]["curve"]
        mean = [
            (step, nfe, wall, statistics.fmean(runs[s]["curve"][k][3] for s in seeds))
            for k, (step, nfe, wall, _) in enumerate(first)
        ]
        results[name] = {"seeds": runs, "mean_curve": mean}
    if "flat" not in results:
        return results
    flat_final_nfe, flat_final = results["flat"]["mean_curve"][-1][1], results["flat"]["mean_curve"][-1][3]
    for name in results.keys() - {"flat"}:
        # NFE at this variant's first evaluation whose seed-mean reaches flat's final seed-mean (goal <= 0.6x)
        reached = [
            nfe for step, nfe, _, score in results[name]["mean_curve"] if step > 0 and score >= flat_final
        ]
        ratio = reached[0] / flat_final_nfe if reached else None
        results[name]["nfe_to_flat_final_ratio"] = ratio
        print(
            f"(b) {name}: reaches flat's final score {flat_final:.3f} (mean of {len(seeds)} seeds) "
            + (f"at {ratio:.2f}x flat's NFE" if ratio is not None else "never within the run")
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=None, help="(b) override trainer.steps of the demo configs"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="(b) run.seed of each run")
    parser.add_argument("--eval-every", type=int, default=None, help="(b) override trainer.eval_every")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(DEMO_CONFIGS),
        default=list(DEMO_CONFIGS),
        help="(b) which demo configs to train",
    )
    parser.add_argument(
        "--guidance", type=float, default=1.0, help="(c) CFG scale of the samplers (the demo's: 1)"
    )
    parser.add_argument(
        "--splits", type=int, nargs=4, default=[2, 4, 6, 8], help="four split steps (factor 2)"
    )
    args = parser.parse_args(argv)
    import tempfile

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = load_model(Path(tmp))
        if args.part in ("a", "all"):
            results["a"] = part_a(adapter, args.prompts, args.repeats, tuple(args.splits))
        if args.part in ("c", "all"):
            results["c"] = part_c(adapter, args.prompts, args.candidates, args.guidance)
    if args.part in ("b", "all"):
        results["b"] = part_b(args.steps, args.seeds, args.eval_every, args.variants)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
