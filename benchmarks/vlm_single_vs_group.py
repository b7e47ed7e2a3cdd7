"""Single-rollout entropy-shaped RLVR vs group GRPO (G=8) at equal rollouts, on a VLM demo world.

    python -m benchmarks.vlm_single_vs_group [--config configs/demo/vlm_shapes_reason.yaml] [--rollouts 2048]
        [--seeds 3] [--group-prompts 4] [--metric eval/lenient_accuracy] [--threads N]
        [--variants single group] [--set KEY=VALUE ...]

From a demo config (default: shapes-math reasoning, ``configs/demo/vlm_shapes_reason.yaml``; the convention demo
``configs/demo/vlm_shapes_single.yaml`` with ``--metric eval/exact_match``) trains three variants with the same
rollouts per step (``8 x group-prompts``) and the same total:

* ``single``: one rollout per prompt, store baseline, entropy shaping (the default recipe);
* ``single_no_entropy``: the same without entropy shaping (ablation);
* ``group``: GRPO with G = 8.

All three keep the rest of the recipe (its rewards, and its process credit if it has one: group then normalises
the step scores within each group). ``--set KEY=VALUE`` overrides the config for every variant (for example
``trainer.process_credit.single_groups=kind``, which changes the single variants only); ``--variants`` runs a
subset (``group`` is always run: its final accuracy is the target).

and reports the held-out ``--metric`` against rollouts consumed (mean over seeds, with the spread of the final
value), the entropy and completion length at the end (no collapse), and the rollouts single needed to reach
group's final accuracy (goal <= 0.6x).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.options import add_set_option
from mmrl.config import load_config
from mmrl.run import read_metrics
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.trainer import main as train

G = 8


def variants(group_prompts: int) -> dict[str, list[str]]:
    per_step = G * group_prompts
    return {
        "single": ["trainer.mode=single", f"allocation.prompts_per_step={per_step}"],
        "single_no_entropy": [
            "trainer.mode=single",
            f"allocation.prompts_per_step={per_step}",
            "trainer.entropy_shaping.enabled=false",
        ],
        "group": [
            "trainer.mode=group",
            f"trainer.num_generations={G}",
            f"allocation.prompts_per_step={group_prompts}",
            "trainer.entropy_shaping.enabled=false",
        ],
    }


def selected(requested: list[str]) -> list[str]:
    """The variants to train, in the table's order; group is always one of them (its final accuracy is the target)."""
    return [name for name in variants(1) if name in requested or name == "group"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo/vlm_shapes_reason.yaml")
    parser.add_argument("--metric", default="eval/lenient_accuracy", help="held-out metric to compare")
    parser.add_argument("--rollouts", type=int, default=2048, help="total rollouts per run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--group-prompts", type=int, default=4, help="prompts per step of the group variant")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of every run (default: the config's)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(variants(1)),
        default=list(variants(1)),
        help="variants to train (group is always added: its final accuracy is the target)",
    )
    add_set_option(
        parser,
        "config overrides applied to every variant",
    )
    args = parser.parse_args(argv)
    chosen = selected(args.variants)
    per_step = G * args.group_prompts
    steps = max(1, args.rollouts // per_step)
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    entropy: dict[str, list[float]] = {}
    length: dict[str, list[float]] = {}
    settings = variants(args.group_prompts)
    for name in chosen:
        extra = settings[name]
        for seed in range(args.seeds):
            cfg = load_config(
                VLMRLVRConfig,
                args.config,
                [
                    *args.overrides,
                    *extra,
                    f"run.name=bench_{name}_{seed}",
                    f"run.seed={seed}",
                    "run.overwrite=true",
                    "run.progress=false",
                    f"trainer.steps={steps}",
                    f"trainer.eval_every={args.eval_every}",
                    *([f"run.threads={args.threads}"] if args.threads is not None else []),
                ],
            )
            train(cfg)
            records = read_metrics(Path(cfg.run.output_dir) / cfg.run.name)
            curves.setdefault(name, []).append(
                [(r["step"] * per_step, r[args.metric]) for r in records if args.metric in r]
            )
            entropy.setdefault(name, []).append(
                next(r["entropy/mean"] for r in reversed(records) if "entropy/mean" in r)
            )
            length.setdefault(name, []).append(
                next(r["gen/length_mean"] for r in reversed(records) if "gen/length_mean" in r)
            )
    mean_curve = {
        name: [(runs[0][i][0], statistics.fmean(run[i][1] for run in runs)) for i in range(len(runs[0]))]
        for name, runs in curves.items()
    }
    target = mean_curve["group"][-1][1]
    start = mean_curve["group"][0][1]
    # rollouts after which a curve first reaches group's final accuracy (None: never; step 0 does not count)
    reach = {
        name: next((n for n, acc in curve[1:] if acc >= target), None) for name, curve in mean_curve.items()
    }
    print(f"held-out {args.metric} vs rollouts (mean of {args.seeds} seeds, {per_step} rollouts per step)")
    print(f"{'rollouts':>9s} " + " ".join(f"{n:>18s}" for n in mean_curve))
    for i in range(len(mean_curve["group"])):
        print(f"{mean_curve['group'][i][0]:9d} " + " ".join(f"{c[i][1]:18.3f}" for c in mean_curve.values()))
    if target <= start:
        print(
            f"group did not improve on the start ({start:.3f} -> {target:.3f}): the rollout ratio is undefined"
        )
    total = mean_curve["group"][-1][0]
    for name in mean_curve:
        got = reach[name]
        if got is None:
            ratio = "never"
        elif target > start and reach["group"]:
            # against group's whole budget (the goal's reading) and against the rollouts group itself needed to
            # first reach its final accuracy (stricter when group plateaus early)
            ratio = f"{got / total:.2f}x group's {total} rollouts, {got / reach['group']:.2f}x group's first reach"
        else:
            ratio = "n/a"
        finals = [run[-1][1] for run in curves[name]]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0  # the sample std (n - 1)
        print(
            f"{name}: final {mean_curve[name][-1][1]:.3f} (sample std over seeds {spread:.3f}, start "
            f"{mean_curve[name][0][1]:.3f}); reaches group's final {target:.3f} after {got} rollouts ({ratio}); "
            f"final entropy {statistics.fmean(entropy[name]):.3f}, completion length "
            f"{statistics.fmean(length[name]):.1f} tokens"
        )
    result = {
        "curves": mean_curve,
        "reach": reach,
        "final_entropy": {k: statistics.fmean(v) for k, v in entropy.items()},
        "final_length": {k: statistics.fmean(v) for k, v in length.items()},
        "final_per_seed": {name: [run[-1][1] for run in runs] for name, runs in curves.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
