"""Flow objectives side by side: GRPO, DiffusionNFT and AWM trained from the committed shapes base.

    python -m benchmarks.flow_objectives                           # every recipe, seeds 0 1 2, each its full schedule
    python -m benchmarks.flow_objectives --recipes nft awm_tuned --steps 150 --minutes 2.5
    python -m benchmarks.flow_objectives --recipes nft awm --seeds 0 --steps 100 --eval-every 20

Each recipe is a demo config plus overrides (``RECIPES``; ``--list`` prints them). Every run starts from the
committed base checkpoint (``checkpoints/shapes_flow``; ``main_job``, README's main job, from
``checkpoints/shapes_flow_w192``; the override ``model.path=DIR`` starts every run, and ``--ceiling``'s scores, from
another base), samples and evaluates CFG-free, and is evaluated every ``--eval-every`` steps on the same held-out
prompts with the fixed evaluation noise: the strict shapes score (1 only if object, count, colour and position are
all right) and each criterion alone. Runs go seed by seed, every recipe of a seed before the next seed
(interleaved: a slow period of the host hits all recipes alike).

For each evaluation the benchmark records the steps done, the transformer evaluations spent (``nfe/total``:
rollouts, explorer previews and regression forwards; evaluations excluded) and the training seconds (the time
inside training steps; evaluations, model loading and imports excluded). ``--minutes`` caps the training seconds
of each run (the run stops after the step that crosses it, and is evaluated there); the learning-rate schedule
still runs over the recipe's ``trainer.steps``, so give a time-capped run a ``--steps`` it can finish, or its
cosine never anneals.

Writes ``--out``/``flow_objectives.json`` (every evaluation of every run, plus the seed means) after each run, and
``flow_objectives.md`` (the tables) at the end. The summary names, per recipe, the mean over seeds of the final
strict score and of each criterion, and the first evaluation at which the seed-mean strict score reaches
``--target`` (default: the demo's four-seed final mean, 0.529), in training seconds and NFE.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mmrl.config import load_config
from mmrl.data.shapes import KINDS, prompt_kind
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer
from rewards.shapes import DetectedObject, PromptSpec, detect_objects, parse_prompt, score_objects

__all__ = [
    "CRITERIA",
    "FAILURES",
    "RECIPES",
    "Recipe",
    "by_kind",
    "ceiling",
    "failure",
    "failure_table",
    "recipe_config",
    "summarize",
    "to_markdown",
    "train_run",
]

FLAT = "configs/demo/flow_shapes.yaml"
BRANCH = "configs/demo/flow_shapes_branch.yaml"
EXPLORE = "configs/demo/flow_shapes_explore.yaml"
MAIN_JOB = "configs/demo/flow_shapes_w192_distill.yaml"

# the partial credit with the bottleneck criterion weighted up (rewards.shapes.ShapesReward criterion_weights)
COUNT_WEIGHTED = "criterion_weights: {count: 3.0}"

# the shapes verifier's per-criterion components, logged by the trainer's evaluation as eval/shapes/<name>
CRITERIA = ("object", "count", "colour", "position")
# training metrics kept for every step (the rollouts' partial-credit reward, the update's size and terms)
TRAIN_METRICS = (
    "reward/mean",
    "train/grad_norm",
    "loss",
    "policy/guidance_gap",
    "policy/guidance_weight",
    "policy/kl_old",
)


# awm_tuned (AWM, NFT's two regression points, advantages A) plus guidance distillation, weight 1, cosine over 120
AWM_DISTILL = (
    "trainer.objective=awm",
    "trainer.awm.timesteps=2",
    "trainer.awm.advantage_max=5.0",
    "trainer.steps=120",
    "trainer.guidance_distill.weight=1.0",
)


# EMA of the weights for the *_ema recipes. The warm-up min(d, (1 + n) / (10 + n)) stays below 0.98 until step
# 440, so over a 300-step run the EMA averages about the last n / 9 steps (17 at step 150, 34 at step 300): the
# widest window the warm-up allows there (any d >= 0.971 gives the same 300-step run)
EMA_DECAY = 0.98
# steps between refreshes of the self-taught teacher: six teachers over a 300-step run, each trained toward for
# longer than the EMA's window, so the policy catches up with one teacher before the next
SELF_TEACHER_REFRESH = 50


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A demo config and the overrides that make it this recipe."""

    config: str
    overrides: tuple[str, ...]
    about: str


RECIPES: dict[str, Recipe] = {
    "nft": Recipe(
        FLAT, (), "the flow demo as committed: DiffusionNFT, full fine-tuning, lr 3e-4 cosine, 300 steps"
    ),
    "grpo": Recipe(FLAT, ("trainer.objective=grpo",), "the demo's settings with Flow-GRPO (SDE window of 4)"),
    "awm": Recipe(FLAT, ("trainer.objective=awm",), "the demo's settings with AWM at the paper's defaults"),
    "awm_tuned": Recipe(
        FLAT,
        ("trainer.objective=awm", "trainer.awm.timesteps=2", "trainer.awm.advantage_max=5.0"),
        "AWM with NFT's two regression points per image and unscaled advantages (A, not A / 5)",
    ),
    "awm_2pt": Recipe(
        FLAT,
        ("trainer.objective=awm", "trainer.awm.timesteps=2"),
        "AWM at the paper's defaults (advantages A / 5, ghuber) but NFT's two regression points per image: the "
        "paper's scaling at awm_tuned's cost per step",
    ),
    "awm_paper_distill": Recipe(
        FLAT,
        ("trainer.objective=awm", "trainer.guidance_distill.weight=1.0"),
        "AWM at the paper's defaults plus guidance distillation toward the base's CFG-3 velocity (weight 1)",
    ),
    "nft_branch": Recipe(
        BRANCH, (), "the demo with branching rollouts (trees of 8 leaves split at steps 0, 2)"
    ),
    "nft_explore": Recipe(EXPLORE, (), "the demo with int8 previews of 16 seeds, best 4 and worst 4 trained"),
    "nft_half": Recipe(
        FLAT,
        ("allocation.rollouts_per_step=32", "trainer.minibatch_size=32"),
        "the demo with 32 images per step (8 prompts x 4) instead of 64: half the NFE per step",
    ),
    "nft_branch_short": Recipe(
        BRANCH, ("trainer.steps=150",), "branching, its cosine over 150 steps instead of 300"
    ),
    "nft_distill": Recipe(
        FLAT,
        ("trainer.steps=120", "trainer.guidance_distill.weight=1.0"),
        "the demo plus guidance distillation toward the base's CFG-3 velocity (weight 1), cosine over 120 steps",
    ),
    "main_job": Recipe(
        MAIN_JOB,
        (),
        "the README's main job as it is: awm_distill from the width-192 base (checkpoints/shapes_flow_w192), its "
        "teacher at CFG 1.5 and weight 0.3; cosine over 300 steps",
    ),
    "awm_distill": Recipe(
        FLAT,
        AWM_DISTILL,
        "awm_tuned plus guidance distillation toward the base's CFG-3 velocity (weight 1), cosine over 120 steps",
    ),
    "awm_distill_w03": Recipe(
        FLAT,
        (*AWM_DISTILL, "trainer.guidance_distill.weight=0.3"),
        "awm_distill with the distillation weighted 0.3 instead of 1: a weaker pull toward the 0.56 teacher",
    ),
    "awm_distill_cosine": Recipe(
        FLAT,
        (*AWM_DISTILL, "trainer.guidance_distill.schedule=cosine"),
        "awm_distill with the distillation weight on a cosine from 1 to 0 over the run (the lr's schedule)",
    ),
    "awm_distill_off60": Recipe(
        FLAT,
        (*AWM_DISTILL, "trainer.guidance_distill.steps=60"),
        "awm_distill with the distillation off after step 60 (the reward alone from there; no teacher forwards)",
    ),
    "awm_distill_balanced": Recipe(
        FLAT,
        (*AWM_DISTILL, "train_prompts=shapes:train@1024"),
        "awm_distill on 1024 training prompts drawn from the four kinds in turn (single, count, pair, relation: "
        "256 each) like the held-out set, instead of the whole split, where count prompts are 10 of 1270",
    ),
    "awm_distill_p16": Recipe(
        FLAT,
        (*AWM_DISTILL, "allocation.prompts_per_step=16"),
        "awm_distill with 16 prompts per step (the same 64 images, so 4 per prompt: n_min)",
    ),
    "awm_distill_priority": Recipe(
        FLAT,
        (*AWM_DISTILL, "allocation.selection=priority"),
        "awm_distill picking prompts with probability ~ sqrt(p (1 - p)) of their running reward (SPO's "
        "priority sampling) instead of uniformly: more steps on prompts whose groups have spread",
    ),
    "awm_distill_w03_priority": Recipe(
        FLAT,
        (*AWM_DISTILL, "trainer.guidance_distill.weight=0.3", "allocation.selection=priority"),
        "awm_distill_w03 and awm_distill_priority together: the weaker pull toward the teacher, prompts picked "
        "by the spread of their running reward",
    ),
    "awm_distill_strict": Recipe(
        FLAT,
        (*AWM_DISTILL, "rewards=[{name: shapes}]"),
        "awm_distill trained on the strict score (1 only if every criterion holds) instead of the partial credit",
    ),
    "awm_distill_ema": Recipe(
        FLAT,
        (*AWM_DISTILL, f"trainer.ema_decay={EMA_DECAY}"),
        f"awm_distill evaluated (and exported) with an EMA of its weights, decay {EMA_DECAY} after the warm-up "
        "(1 + n) / (10 + n): the average of about the last n / 9 steps at step n over a 300-step run",
    ),
    "awm_distill_strict_ema": Recipe(
        FLAT,
        (*AWM_DISTILL, "rewards=[{name: shapes}]", f"trainer.ema_decay={EMA_DECAY}"),
        f"awm_distill_strict evaluated (and exported) with an EMA of its weights, decay {EMA_DECAY} after the "
        "warm-up, to hold the peak the strict reward reaches mid-run",
    ),
    "awm_distill_self_teacher": Recipe(
        FLAT,
        (
            *AWM_DISTILL,
            f"trainer.ema_decay={EMA_DECAY}",
            f"trainer.guidance_distill.refresh_every={SELF_TEACHER_REFRESH}",
        ),
        f"awm_distill_ema whose teacher is, from step {SELF_TEACHER_REFRESH} on, its own EMA (refreshed every "
        f"{SELF_TEACHER_REFRESH} steps) at CFG 3 instead of the frozen base: the reward-improved policy as its "
        "own guidance teacher",
    ),
    "awm_distill_self_teacher_w15": Recipe(
        FLAT,
        (
            *AWM_DISTILL,
            f"trainer.ema_decay={EMA_DECAY}",
            f"trainer.guidance_distill.refresh_every={SELF_TEACHER_REFRESH}",
            "trainer.guidance_distill.guidance_scale=1.5",
        ),
        "awm_distill_self_teacher with the teacher guided at 1.5 instead of 3 (the base too, until the first "
        "refresh): each refresh guides a policy that already carries guidance, so a smaller scale compounds less",
    ),
    "awm_distill_count": Recipe(
        FLAT,
        (*AWM_DISTILL, f"rewards=[{{name: shapes, options: {{partial: true, {COUNT_WEIGHTED}}}}}]"),
        "awm_distill trained on the count-weighted partial credit (count weighs 3, the rest 1)",
    ),
    "distill_only": Recipe(
        FLAT,
        (
            "trainer.objective=awm",
            "trainer.awm.timesteps=2",
            "trainer.steps=120",
            "trainer.guidance_distill.weight=1.0",
            "rewards=[{name: shapes, weight: 0.0, options: {partial: true}}]",
        ),
        "guidance distillation alone: awm_distill with the reward weighted 0 (all advantages 0, so the AWM term "
        "has no gradient), what the distillation adds without RL",
    ),
    "nft_distill_count": Recipe(
        FLAT,
        (
            "trainer.steps=120",
            "trainer.guidance_distill.weight=1.0",
            f"rewards=[{{name: shapes, options: {{partial: true, {COUNT_WEIGHTED}}}}}]",
        ),
        "nft_distill trained on the count-weighted partial credit (count weighs 3)",
    ),
    "nft_count": Recipe(
        FLAT,
        ("trainer.steps=120", f"rewards=[{{name: shapes, options: {{partial: true, {COUNT_WEIGHTED}}}}}]"),
        "the demo trained on the count-weighted partial credit (count weighs 3, the rest 1), cosine over 120 steps",
    ),
}


def recipe_config(
    name: str, seed: int, threads: int | None, eval_prompts: int, overrides: list[str]
) -> FlowGRPOConfig:
    """The config of recipe ``name`` at ``seed`` (``overrides`` apply after the recipe's own).

    Raises:
        ValueError: an unknown recipe name (the message lists the known ones).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[name]
    return load_config(
        FlowGRPOConfig,
        recipe.config,
        [
            f"run.name=objectives_{name}_s{seed}",
            f"run.seed={seed}",
            f"run.threads={threads if threads is not None else 'null'}",
            f"trainer.eval_prompts={eval_prompts}",
            *recipe.overrides,
            *overrides,
        ],
    )


def _eval_point(step: int, nfe: float, train_s: float, scores: dict[str, float]) -> dict[str, float]:
    point = {"step": step, "nfe": nfe, "train_s": train_s, "strict": scores["eval/reward_mean"]}
    for criterion in CRITERIA:
        point[criterion] = scores[f"eval/shapes/{criterion}"]
    return point


#: why a sample's strict score is 0, the first that applies, in this order (``right``: it scores 1)
FAILURES: tuple[str, ...] = ("right", "unread", "extra", "missing", "shape", "colour", "place")


def failure(spec: PromptSpec, objects: list[DetectedObject]) -> str:
    """Which of :data:`FAILURES` a sample of ``spec`` with the verifier's ``objects`` is:

    * ``unread``: a blob the verifier cannot read as a circle, square or triangle (two shapes merged, or ragged);
    * ``extra`` / ``missing``: more / fewer objects than the prompt names;
    * ``shape``: as many objects as named, with the named colours, but a shape wrong (a square drawn for a
      circle, or the two objects' shapes swapped between their colours);
    * ``colour``: as many objects as named, a colour wrong;
    * ``place``: the objects right, the relation not.
    """
    scores = score_objects(spec, objects)
    if all(value == 1.0 for value in scores.values()):
        return "right"
    if any(obj.shape == "unknown" for obj in objects):
        return "unread"
    if len(objects) != len(spec.objects):
        return "extra" if len(objects) > len(spec.objects) else "missing"
    if scores["object"] == scores["count"] == scores["colour"] == 1.0:
        return "place"
    named_colours = sorted(str(obj.colour) for obj in spec.objects)
    drawn_colours = sorted(str(obj.colour) if spec.objects[0].colour else "None" for obj in objects)
    return "shape" if named_colours == drawn_colours else "colour"


@torch.no_grad()
def by_kind(trainer: FlowGRPOTrainer, images_per_prompt: int = 1) -> dict[str, dict[str, float]]:
    """Held-out strict score of ``trainer``'s current weights per prompt kind (single, count, pair, relation) and
    over all prompts, from ``K = images_per_prompt`` evaluation samples of each prompt (the evaluation's sampler
    and fixed noise):

        mean     = mean_p mean_k strict(p, k)     the expected score (K = 1: the evaluation's score)
        pass@K   = mean_p max_k strict(p, k)      prompts with at least one strictly right sample among K

    pass@K bounds what group-relative RL can reinforce from K samples per prompt without finding new images.
    ``failures``: the share of the samples in each class of :func:`failure`. The weights are the evaluation's
    (the EMA under ``trainer.ema_decay``).
    """
    prompts = trainer.eval_pool[: trainer.cfg.trainer.eval_prompts]
    with trainer.evaluation_weights():
        ro = trainer.generate(prompts, images_per_prompt)
    raw, _ = trainer.score(ro.images, ro.prompts, evaluation=True)
    strict = (raw @ trainer.eval_weights).float()  # [P * K]
    num_prompts = len(prompts)
    best = torch.zeros(num_prompts).scatter_reduce(0, ro.group_index, strict, "amax", include_self=False)
    mean = torch.zeros(num_prompts).index_add(0, ro.group_index, strict) / images_per_prompt
    kinds = [prompt_kind(prompt) for prompt in prompts]
    failures = [
        failure(parse_prompt(prompt), objects)
        for prompt, objects in zip(ro.prompts, detect_objects(ro.images), strict=True)
    ]
    sample_kinds = [kinds[int(group)] for group in ro.group_index]
    out = {}
    for kind in ("all", *KINDS):
        mask = torch.tensor([kind in ("all", k) for k in kinds])
        if mask.any():
            found = [f for f, k in zip(failures, sample_kinds, strict=True) if kind in ("all", k)]
            out[kind] = {
                "prompts": int(mask.sum()),
                "mean": float(mean[mask].mean()),
                f"pass@{images_per_prompt}": float(best[mask].mean()),
                "failures": {name: found.count(name) / len(found) for name in FAILURES},
            }
    return out


def ceiling(
    config: str,
    guidance_scales: list[float],
    images_per_prompt: int,
    eval_prompts: int,
    threads: int | None,
    overrides: Sequence[str] = (),
) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`by_kind` of the untrained base of ``config`` at each CFG scale: ``{"cfg G": by_kind(...)}``.
    ``overrides`` apply first (``model.path=DIR`` scores another base)."""
    out = {}
    for scale in guidance_scales:
        cfg = load_config(
            FlowGRPOConfig,
            config,
            [
                *overrides,
                f"sampling.guidance_scale={scale}",
                f"trainer.eval_prompts={eval_prompts}",
                f"run.threads={threads if threads is not None else 'null'}",
            ],
        )
        trainer = FlowGRPOTrainer(cfg, run=None)
        trainer.setup(for_training=False)
        out[f"cfg {scale:g}"] = by_kind(trainer, images_per_prompt)
    return out


def kind_table(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one row per entry of ``rows`` (``{label: by_kind(...)}``), one column per statistic and kind."""
    first = next(iter(rows.values()))
    kinds = list(first)
    stats = [k for k in first["all"] if k not in ("prompts", "failures")]
    columns = [f"{stat} {kind} ({first[kind]['prompts']})" for stat in stats for kind in kinds]
    lines = [f"| | {' | '.join(columns)} |", "| --- |" + " --- |" * len(columns)]
    for label, table in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{table[k][s]:.3f}" for s in stats for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def failure_table(rows: dict[str, dict[str, dict[str, object]]]) -> str:
    """Markdown: for each entry of ``rows`` (``{label: by_kind(...)}``) and prompt kind, the share of samples in
    each class of :data:`FAILURES`."""
    lines = [f"| | kind | {' | '.join(FAILURES)} |", "| --- | --- |" + " --- |" * len(FAILURES)]
    for label, table in rows.items():
        for kind, stats in table.items():
            shares = stats["failures"]
            lines.append(
                f"| {label} | {kind} ({stats['prompts']}) | "
                + " | ".join(f"{shares[name]:.3f}" for name in FAILURES)
                + " |"
            )
    return "\n".join(lines) + "\n"


def train_run(
    cfg: FlowGRPOConfig, minutes: float | None, eval_every: int, final_samples: int = 1
) -> dict[str, object]:
    """Train ``cfg`` from step 0 to ``trainer.steps`` or until ``minutes`` of training seconds; evaluate at step 0,
    every ``eval_every`` steps and at the stop; score the final weights per prompt kind from ``final_samples``
    samples of each held-out prompt (:func:`by_kind`). Nothing is written to disk (no run directory).

    Under ``trainer.ema_decay`` the scores are the EMA's, and each evaluation also scores the trained weights
    themselves (``live_strict``, ``live_count``).

    Returns:
        ``{"curve": [{step, nfe, train_s, strict, object, count, colour, position}, ...], "train": [{step, and
        the TRAIN_METRICS the step logged}, ...], "by_kind", "steps", "train_s", "eval_s", "setup_s",
        "stopped_by"}``.
    """
    start = time.perf_counter()
    trainer = FlowGRPOTrainer(cfg, run=None)
    trainer.setup()
    setup_s = time.perf_counter() - start
    budget_s = minutes * 60 if minutes is not None else float("inf")
    train_s = eval_s = 0.0
    nfe = 0.0

    def evaluate() -> dict[str, float]:
        nonlocal eval_s
        begin = time.perf_counter()
        point = _eval_point(trainer.step, nfe, train_s, trainer.evaluate())
        if trainer.ema is not None:  # the same step's trained weights, so the EMA's effect is paired
            live = trainer.evaluate(live=True)
            point["live_strict"] = live["eval/reward_mean"]
            point["live_count"] = live["eval/shapes/count"]
        eval_s += time.perf_counter() - begin
        print(  # a long run's curve survives an interrupted session in the log
            f"  {cfg.run.name} step {point['step']}: strict {point['strict']:.3f}, count {point['count']:.3f}"
            + (f", live strict {point['live_strict']:.3f}" if "live_strict" in point else ""),
            flush=True,
        )
        return point

    curve = [evaluate()]
    train_log = []
    stopped_by = "steps"
    try:
        while trainer.step < cfg.trainer.steps:
            begin = time.perf_counter()
            metrics = trainer.train_step()
            train_s += time.perf_counter() - begin
            trainer.step += 1
            nfe = metrics["nfe/total"]
            train_log.append({"step": trainer.step, **{k: metrics[k] for k in TRAIN_METRICS if k in metrics}})
            out_of_time = train_s >= budget_s
            if trainer.step % eval_every == 0 or trainer.step == cfg.trainer.steps or out_of_time:
                curve.append(evaluate())
            if out_of_time:
                stopped_by = "minutes"
                break
        final_by_kind = by_kind(trainer, final_samples)
    finally:
        trainer.cleanup()
    return {
        "curve": curve,
        "train": train_log,
        "by_kind": final_by_kind,
        "steps": trainer.step,
        "train_s": train_s,
        "eval_s": eval_s,
        "setup_s": setup_s,
        "stopped_by": stopped_by,
    }


def summarize(runs: dict[int, dict[str, object]], target: float) -> dict[str, object]:
    """Seed means of one recipe's runs (``{seed: train_run(...)}``).

    ``mean_curve``: at each step that every seed evaluated, the mean of each field over seeds (NFE and training
    seconds too: seeds spend the same NFE per step, and their seconds differ by the host's load). ``final``: each
    field's mean, min and max over the seeds' last evaluations; ``final_by_kind``: the seed mean of the final
    weights' strict score and pass@K per prompt kind. ``reaches_target``: the first point of
    ``mean_curve`` after step 0 whose strict score is ``>= target``, or ``None``.
    """
    curves = [run["curve"] for run in runs.values()]
    common = set.intersection(*({point["step"] for point in curve} for curve in curves))
    fields = ("nfe", "train_s", "strict", *CRITERIA)
    mean_curve = []
    for step in sorted(common):
        points = [next(p for p in curve if p["step"] == step) for curve in curves]
        mean_curve.append({"step": step, **{k: statistics.fmean(p[k] for p in points) for k in fields}})
    lasts = [curve[-1] for curve in curves]
    final = {
        k: {
            "mean": statistics.fmean(p[k] for p in lasts),
            "min": min(p[k] for p in lasts),
            "max": max(p[k] for p in lasts),
        }
        for k in ("step", *fields)
    }
    reached = next((p for p in mean_curve if p["step"] > 0 and p["strict"] >= target), None)
    kinds = runs[next(iter(runs))]["by_kind"]
    final_by_kind = {
        kind: {
            "prompts": kinds[kind]["prompts"],
            **{  # the mean and pass@K
                stat: statistics.fmean(r["by_kind"][kind][stat] for r in runs.values())
                for stat in kinds[kind]
                if stat not in ("prompts", "failures")
            },
            "failures": {
                name: statistics.fmean(r["by_kind"][kind]["failures"][name] for r in runs.values())
                for name in FAILURES
            },
        }
        for kind in kinds
    }
    return {
        "seeds": sorted(runs),
        "mean_curve": mean_curve,
        "final": final,
        "final_by_kind": final_by_kind,
        "reaches_target": reached,
    }


def to_markdown(results: dict[str, object]) -> str:
    """The summary table (one row per recipe) and each recipe's seed-mean curve, as Markdown."""
    target = results["target"]
    # what the recipes' descriptions below do not say: these replace their settings (a --steps schedule)
    overrides = results["overrides"]
    applied = (
        f" Every recipe with `{' '.join(overrides)}` applied after its own settings." if overrides else ""
    )
    lines = [
        f"Seeds {results['seeds']}; held-out strict score on {results['eval_prompts']} prompts; train s = seconds "
        f"inside training steps (evaluations excluded).{applied}",
        "",
        f"| recipe | steps | NFE | train s | strict (min-max) | {' | '.join(CRITERIA)} | reaches {target:.3f} at |",
        "| --- | --- | --- | --- | --- |" + " --- |" * len(CRITERIA) + " --- |",
    ]
    for name, summary in results["summaries"].items():
        final = summary["final"]
        strict = final["strict"]
        reached = summary["reaches_target"]
        at = f"{reached['train_s']:.0f} s, step {reached['step']}" if reached else "not reached"
        lines.append(
            f"| {name} | {final['step']['mean']:.0f} | {final['nfe']['mean']:,.0f} | {final['train_s']['mean']:.0f} "
            f"| **{strict['mean']:.3f}** ({strict['min']:.3f}-{strict['max']:.3f}) | "
            + " | ".join(f"{final[c]['mean']:.3f}" for c in CRITERIA)
            + f" | {at} |"
        )
    lines += ["", "Final strict score per prompt kind (mean of seeds):", ""]
    final_by_kind = {name: summary["final_by_kind"] for name, summary in results["summaries"].items()}
    lines.append(kind_table(final_by_kind))
    lines += [
        "Why the final samples fail (share of samples, mean of seeds; FAILURES):",
        "",
        failure_table(final_by_kind),
    ]
    for name, summary in results["summaries"].items():
        lines += [
            "",
            f"{name}: {RECIPES[name].about if name in RECIPES else ''} (mean of seeds {summary['seeds']})",
            "",
            f"| step | NFE | train s | strict | {' | '.join(CRITERIA)} |",
            "| --- | --- | --- | --- |" + " --- |" * len(CRITERIA),
        ]
        for p in summary["mean_curve"]:
            lines.append(
                f"| {p['step']} | {p['nfe']:,.0f} | {p['train_s']:.0f} | {p['strict']:.3f} | "
                + " | ".join(f"{p[c]:.3f}" for c in CRITERIA)
                + " |"
            )
    return "\n".join(lines) + "\n"


def machine_state(threads: int | None) -> dict[str, object]:
    """What the timings depend on: cores, threads, processor, torch, and the load when the benchmark started."""
    return {
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["grpo", "nft", "awm", "awm_tuned", "nft_branch", "nft_explore", "nft_half"],
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed of each run")
    parser.add_argument("--minutes", type=float, default=None, help="cap on each run's training minutes")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.steps of every recipe")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument(
        "--target", type=float, default=0.529, help="strict score whose first crossing is reported"
    )
    parser.add_argument("--threads", type=int, default=2, help="run.threads of every run")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/flow_objectives"), help="folder of the outputs"
    )
    parser.add_argument(
        "--final-samples",
        type=int,
        default=1,
        metavar="K",
        help="samples of each held-out prompt for the final weights' per-kind score and pass@K (1: the "
        "evaluation's own sample)",
    )
    parser.add_argument("--list", action="store_true", help="print the recipes and exit")
    parser.add_argument(
        "--ceiling",
        type=int,
        default=None,
        metavar="K",
        help="instead of training: the base's held-out strict score per prompt kind and pass@K, K samples per "
        "prompt, at each --guidance scale",
    )
    parser.add_argument(
        "--guidance", type=float, nargs="+", default=[1.0, 3.0], help="(--ceiling) CFG scales"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value overrides applied to every recipe (and to --ceiling's base)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, recipe in RECIPES.items():
            print(f"{name:18s} {recipe.config} {' '.join(recipe.overrides)}\n{'':18s} {recipe.about}")
        return {}
    unknown = [name for name in args.recipes if name not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; known: {sorted(RECIPES)}")
    if args.final_samples < 1:
        parser.error(f"--final-samples must be >= 1, got {args.final_samples}")
    if args.eval_every < 1:
        parser.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if args.ceiling is not None:
        if args.ceiling < 1:
            parser.error(f"--ceiling must be >= 1, got {args.ceiling}")
        rows = ceiling(FLAT, args.guidance, args.ceiling, args.eval_prompts, args.threads, args.overrides)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ceiling.json").write_text(json.dumps(rows, indent=1))
        print(kind_table(rows))
        print(failure_table(rows))
        return rows
    overrides = [*args.overrides, *([f"trainer.steps={args.steps}"] if args.steps else [])]
    # validate every config before the first run spends minutes
    for name in args.recipes:
        recipe_config(name, args.seeds[0], args.threads, args.eval_prompts, overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {
        "command": "python -m benchmarks.flow_objectives "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_state(args.threads),
        "seeds": args.seeds,
        "minutes": args.minutes,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "target": args.target,
        "overrides": overrides,
        "recipes": {name: dataclasses.asdict(RECIPES[name]) for name in args.recipes},
        "runs": {name: {} for name in args.recipes},
        "summaries": {},
    }
    for seed in args.seeds:  # interleaved: each seed runs every recipe before the next seed
        for name in args.recipes:
            cfg = recipe_config(name, seed, args.threads, args.eval_prompts, overrides)
            run = train_run(cfg, args.minutes, args.eval_every, args.final_samples)
            results["runs"][name][seed] = run
            last = run["curve"][-1]
            print(
                f"{name} seed {seed}: step {last['step']}, {last['train_s']:.0f} s, NFE {last['nfe']:,.0f}, strict "
                f"{run['curve'][0]['strict']:.3f} -> {last['strict']:.3f} ("
                + ", ".join(f"{c} {last[c]:.3f}" for c in CRITERIA)
                + ")",
                flush=True,
            )
            results["summaries"][name] = summarize(results["runs"][name], args.target)
            (args.out / "flow_objectives.json").write_text(json.dumps(results, indent=1))
            gc.collect()
    results["machine"]["load_average_end"] = os.getloadavg()
    (args.out / "flow_objectives.json").write_text(json.dumps(results, indent=1))
    table = to_markdown(results)
    (args.out / "flow_objectives.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
