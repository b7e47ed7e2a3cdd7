"""mmrl single, mmrl group (G=8) and TRL's GRPOTrainer (G=8) side by side on the embedded VLM worlds.

    pip install -e ".[bench]"        # TRL
    python -m benchmarks.vs_trl [--task vqa|reason] [--seeds 3] [--marks ...] [--threads 1] [--out FILE]
        [--set KEY=VALUE ...]            # overrides of the recipe for every variant
    python -m benchmarks.vs_trl --summarize FILE      # the tables again, from a (possibly partial) results file

Two tasks, each from its committed SFT checkpoint and its demo recipe, read at run time (so a change of the demo
carries over to all three variants):

* ``vqa`` (default): ``configs/demo/vlm_shapes_single.yaml``, shapes VQA, LoRA r16/a32 on the language model,
  lr 1e-3, temperature 1, 8 new tokens, ``exact_match``; held-out ``eval/exact_match``.
* ``reason``: ``configs/demo/vlm_shapes_reason.yaml``, shapes-math with a ``<think>`` trace, full fine-tuning with
  the vision tower frozen, 48 new tokens, reward 0.6 x ``numeric`` on the answer span + 0.3 x ``reasoning_steps``
  + 0.1 x ``format``;
  held-out ``eval/lenient_accuracy`` (held-out scenes) and ``eval/templates/lenient_accuracy`` (held-out
  templates).

Three variants train with 64 completions per step on the same questions:

* ``mmrl_single``: the recipe as it is, one rollout for each of 64 prompts (store baseline, entropy shaping, and
  the recipe's process credit if it has one);
* ``mmrl_group``: ``trainer.mode=group``, 8 prompts x G=8, GRPO advantages, no entropy shaping, no process
  credit (TRL has none: it trains on the sequence rewards only);
* ``trl``: ``trl.GRPOTrainer``, 8 prompts x G=8 (``per_device_train_batch_size=64``, one optimizer step per
  generation batch), the recipe's loss aggregation (``token_mean`` = TRL's ``"dapo"``), clip range, beta, lr
  and its schedule over the run, no gradient checkpointing, fp32, the same trainable parameters (the LoRA, or
  every weight outside the vision tower), one reward function per verifier with TRL's ``reward_weights`` = the
  recipe's weights, sampling with the vision special tokens suppressed and the same stop tokens as mmrl.

Each seed's three runs go one after the other (interleaved: a drift of the machine hits every variant alike), each
in a fresh process, so that its peak resident memory (``VmHWM``) is its own. A run saves its trainable weights at
every mark (rollouts consumed; marks are multiples of 64); one evaluation process per seed then scores the start
and every saved state with mmrl's own greedy evaluation on the run's held-out questions, the same code for all
three. Timing counts training steps only (rollouts, rewards, update), from the first step to the last, never the
evaluation or the saving of weights: wall seconds, and the process's CPU seconds (steadier on a shared CPU).

Both sides get the same examples: the TRL dataset is built from the trainer's own ``load_examples`` (the seed's
train questions), the rows' chat prompt is the one mmrl builds (the image before the question), and the rewards
are the registry's verifier objects, wrapped in TRL's reward-function signature. Both walk the questions in passes
without replacement, each pass in a fresh order: TRL's sampler does, and the mmrl variants take
``allocation.selection=shuffled`` (``--order recipe`` keeps the recipe's own selection, the demos' uniform draw with
replacement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.options import add_set_option
from pipelines.threads import default_wait_policy

G = 8
ROLLOUTS_PER_STEP = 64
VARIANTS = ("mmrl_single", "mmrl_group", "trl")


@dataclass(frozen=True)
class Task:
    """One embedded world: the demo recipe every variant starts from, the default marks (rollouts at which the
    weights are saved and scored), and the held-out scores recorded at each mark (``{column: metric key of
    VLMRLVRTrainer.evaluate}``; the first is the accuracy the goals are judged on)."""

    config: str
    marks: tuple[int, ...]
    scores: dict[str, str]

    @property
    def accuracy_key(self) -> str:
        return next(iter(self.scores.values()))


TASKS = {
    "vqa": Task(
        "configs/demo/vlm_shapes_single.yaml", (1024, 2048, 3072, 6144), {"accuracy": "eval/exact_match"}
    ),
    "reason": Task(
        "configs/demo/vlm_shapes_reason.yaml",
        (1024, 2048, 3072, 6144),
        {"lenient": "eval/lenient_accuracy", "templates": "eval/templates/lenient_accuracy"},
    ),
}

# --------------------------------------------------------------------------------------------- bookkeeping


def mark_steps(marks: Sequence[int], per_step: int = ROLLOUTS_PER_STEP) -> dict[int, int]:
    """``{step: rollouts}`` for each mark: step ``k`` (counted from 1) has consumed ``k * per_step`` rollouts.

    Raises:
        ValueError: a mark that is not a positive multiple of ``per_step`` (it would fall inside a step).
    """
    bad = [m for m in marks if m <= 0 or m % per_step]
    if bad:
        raise ValueError(f"marks {bad} are not positive multiples of the {per_step} rollouts per step")
    return {m // per_step: m for m in sorted(set(marks))}


def peak_rss_mib() -> float:
    """This process's peak resident set size (``VmHWM`` of /proc/self/status), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


@dataclass
class StepTimes:
    """Wall-clock and process CPU seconds (``time.process_time``: every thread of the process, user + system) of
    each training step. On a shared CPU the CPU seconds are the steadier measure of work; the wall seconds are what
    a user waits."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._wall)
        self.cpu.append(time.process_time() - self._cpu)


#: ``--order``: which questions each mmrl step takes. ``trl``: passes over the train questions without replacement,
#: each in a fresh order (``allocation.selection=shuffled``), the order TRL's sampler walks; ``recipe``: the
#: recipe's own selection (the demos draw uniformly with replacement each step).
ORDERS = ("trl", "recipe")


def config_overrides(
    variant: str, seed: int, threads: int, steps: int | None = None, order: str = "trl"
) -> list[str]:
    """Overrides of the demo recipe for an mmrl variant (``trl`` takes the shared ones: seed, threads, and
    ``steps``, the run's length, which a decaying lr schedule spans; ``order`` as :data:`ORDERS`)."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; available: {list(ORDERS)}")
    common = [
        *([f"trainer.steps={steps}"] if steps is not None else []),
        *(["allocation.selection=shuffled"] if order == "trl" else []),
        f"run.seed={seed}",
        f"run.threads={threads}",
        "run.progress=false",
        "run.tensorboard=false",
        f"trainer.minibatch_size={ROLLOUTS_PER_STEP}",
    ]
    if variant == "mmrl_single":
        return [*common, "trainer.mode=single", f"allocation.prompts_per_step={ROLLOUTS_PER_STEP}"]
    if variant == "mmrl_group":
        return [
            *common,
            "trainer.mode=group",
            f"trainer.num_generations={G}",
            f"allocation.prompts_per_step={ROLLOUTS_PER_STEP // G}",
            # GRPO as TRL runs it: no entropy shaping, and sequence rewards only (TRL has no process credit)
            "trainer.entropy_shaping.enabled=false",
            "trainer.process_credit.reward=null",
        ]
    if variant == "trl":
        return common
    raise ValueError(f"unknown variant {variant!r}; available: {list(VARIANTS)}")


def _config(
    config: str,
    variant: str,
    seed: int,
    threads: int,
    steps: int | None = None,
    order: str = "trl",
    recipe_overrides: Sequence[str] = (),
) -> Any:
    """The run's config: the recipe ``config`` with ``recipe_overrides`` (``--set``, every variant), then the
    variant's own settings (:func:`config_overrides`), which win."""
    from mmrl.config import load_config
    from mmrl.vlm.config import VLMRLVRConfig

    return load_config(
        VLMRLVRConfig, config, [*recipe_overrides, *config_overrides(variant, seed, threads, steps, order)]
    )


def _trainable_state(model: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------- TRL side


def trl_rows(examples: Sequence[Any], system: str | None = None) -> list[dict[str, Any]]:
    """TRL dataset rows from mmrl's VQA examples: a conversational ``prompt`` (TRL inserts the ``image`` before the
    first user message's text, as :meth:`pipelines.vlm.inputs.VLMPrompt.from_question` places it), the ``answer``
    and ``reference`` (solution) columns the rewards read, and the prompt id."""
    rows = []
    for ex in examples:
        if len(ex.images) != 1:
            raise ValueError(
                f"example {ex.prompt_id}: the TRL rows take one image per question, got {len(ex.images)}"
            )
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": ex.question})
        rows.append(
            {
                "prompt": messages,
                "image": ex.images[0],
                "answer": ex.answer,
                "reference": ex.reference,
                "prompt_id": ex.prompt_id,
            }
        )
    return rows


def trl_rewards(cfg: Any) -> tuple[list[Callable[..., list[float]]], list[float]]:
    """The run's verifiers (built from the registry as the trainer builds them), each in TRL's reward signature
    (its scores of each completion's text against its row's ``answer`` and ``reference``, as the trainer's
    ``verify`` passes them; named by the reward's metric key), and
    their weights for TRL's ``reward_weights``. TRL's default ``sum_then_normalize`` then forms the weighted sum
    before the group advantage, as mmrl's ``weighted_sum`` does, and logs each reward on its own."""
    import rewards as reward_registry

    def wrap(verifier: Any, key: str) -> Callable[..., list[float]]:
        def reward(completions: list[Any], answer: list[str], reference: list[str], **_: Any) -> list[float]:
            # conversational prompts: each completion is [{"role": "assistant", "content": text}]
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            out = verifier.score(completions=texts, ground_truths=list(answer), references=list(reference))
            return out.scores.detach().float().tolist()

        reward.__name__ = key
        return reward

    funcs = [wrap(reward_registry.build(spec.name, **spec.options), spec.key) for spec in cfg.rewards]
    return funcs, [spec.weight for spec in cfg.rewards]


#: mmrl's ``trainer.loss_agg`` -> TRL's ``loss_type`` of the same normalisation
TRL_LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}
#: mmrl's ``trainer.multi_reward`` -> TRL's ``multi_objective_aggregation``
TRL_MULTI_REWARD = {"weighted_sum": "sum_then_normalize", "gdpo": "normalize_then_sum"}


def trl_config(cfg: Any, steps: int, output_dir: str, suppressed_token_ids: list[int]) -> Any:
    """``trl.GRPOConfig`` at the mmrl run's settings (64 completions = 8 prompts x G per optimizer step); sampling
    suppresses ``suppressed_token_ids`` (mmrl suppresses every vision special token, TRL only ``<|image_pad|>``
    unless told).

    Raises:
        ValueError: a ``trainer.loss_agg`` without a TRL ``loss_type`` of the same normalisation.
    """
    from trl import GRPOConfig

    t, g = cfg.trainer, cfg.generation
    if t.loss_agg not in TRL_LOSS_TYPES:
        raise ValueError(
            f"trainer.loss_agg={t.loss_agg!r} has no TRL loss_type of the same normalisation; "
            f"comparable: {sorted(TRL_LOSS_TYPES)}"
        )
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=ROLLOUTS_PER_STEP,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=0,
        learning_rate=t.lr,
        # both decay over the run's steps (train_worker sets trainer.steps to them); HF's cosine without
        # warm-up is mmrl's lr * 0.5 * (1 + cos(pi * step / steps))
        lr_scheduler_type=t.lr_schedule,
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim="adamw_torch",
        beta=t.beta,
        epsilon=t.epsilon_low,
        epsilon_high=t.epsilon_high,
        loss_type=TRL_LOSS_TYPES[t.loss_agg],
        scale_rewards="group",
        reward_weights=[spec.weight for spec in cfg.rewards],
        multi_objective_aggregation=TRL_MULTI_REWARD[t.multi_reward],
        num_iterations=t.ppo_epochs,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=cfg.model.device == "cpu",
        seed=cfg.run.seed,
        report_to=[],
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        generation_kwargs={"suppress_tokens": suppressed_token_ids},
    )


def trl_trainer(cfg: Any, steps: int, callbacks: Sequence[Any] = ()) -> Any:
    """``trl.GRPOTrainer`` for ``steps`` optimizer steps on the run's train questions, training what mmrl trains:
    the recipe's LoRA (peft, the same target modules), or with ``model.lora: null`` every weight outside the
    vision tower (and the tower too with ``model.train_vision``)."""
    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOTrainer

    from mmrl.device import DTYPES
    from mmrl.vlm.trainer import load_examples
    from pipelines.vlm.families import family_for_model_type

    m = cfg.model
    processor = AutoProcessor.from_pretrained(m.path)
    # TRL pads the prompt ids on the left itself but takes mm_token_type_ids (which tokens are image tokens, for
    # mRoPE) from a processor call padded on the tokenizer's side: with right padding every prompt shorter than
    # the longest of its batch gets shifted image positions in the loss forward (or a shape error)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(m.path, dtype=DTYPES[m.dtype])
    family = family_for_model_type(model.config.model_type)
    peft_config = None
    if m.lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=m.lora.rank,
            lora_alpha=m.lora.alpha,
            lora_dropout=m.lora.dropout,
            target_modules=family.lora_target_pattern(m.lora.target_modules, m.train_vision),
        )
    else:  # full fine-tuning: the Trainer's optimizer takes the parameters that require grad
        for name, param in model.named_parameters():
            param.requires_grad_(m.train_vision or not family.is_vision_parameter(name))
    dataset = datasets.Dataset.from_list(trl_rows(load_examples(cfg, "train"), cfg.data.system_prompt))
    reward_funcs, _ = trl_rewards(cfg)
    args = trl_config(
        cfg, steps, tempfile.mkdtemp(prefix="vs_trl_"), family.suppressed_token_ids(processor.tokenizer)
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        peft_config=peft_config,
        callbacks=list(callbacks),
    )


def run_trl(cfg: Any, marks: dict[int, int], save: Callable[[int, dict[str, Any]], None]) -> StepTimes:
    """Train TRL's GRPOTrainer for ``max(marks)`` steps; returns the time of each step (between consecutive
    ``on_step_end`` callbacks, without the callback's own saving)."""
    from transformers import TrainerCallback

    times = StepTimes()

    class Marks(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            times.start()

        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **__: Any) -> None:
            times.stop()
            if state.global_step in marks:
                save(state.global_step, _trainable_state(model))
            times.start()

    trl_trainer(cfg, max(marks), [Marks()]).train()
    return times


def run_mmrl(cfg: Any, marks: dict[int, int], save: Callable[[int, dict[str, Any]], None]) -> StepTimes:
    """Train mmrl's VLM trainer for ``max(marks)`` steps, no evaluation; returns the time of each step."""
    from mmrl.vlm.trainer import VLMRLVRTrainer

    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    times = StepTimes()
    while trainer.step < max(marks):
        times.start()
        trainer.train_step()
        trainer.step += 1
        times.stop()
        if trainer.step in marks:
            save(trainer.step, _trainable_state(trainer.model))
    return times


def train_worker(
    variant: str,
    seed: int,
    threads: int,
    marks: Sequence[int],
    out_dir: Path,
    config: str,
    order: str,
    recipe_overrides: Sequence[str] = (),
) -> dict:
    """One training run (in its own process): trained weights at the marks, step times, peak RSS."""
    import torch

    torch.set_num_threads(threads)
    steps = mark_steps(marks)
    cfg = _config(config, variant, seed, threads, max(steps), order, recipe_overrides)

    def save(step: int, state: dict[str, Any]) -> None:
        torch.save(state, out_dir / f"{variant}_seed{seed}_r{steps[step]}.pt")

    times = (run_trl if variant == "trl" else run_mmrl)(cfg, steps, save)
    if len(times.wall) != max(steps):
        raise RuntimeError(f"{variant}: {len(times.wall)} steps timed, {max(steps)} expected")
    return {
        "variant": variant,
        "seed": seed,
        "order": order,
        "threads": torch.get_num_threads(),
        "step_s": times.wall,
        "step_cpu_s": times.cpu,
        "rollouts": len(times.wall) * ROLLOUTS_PER_STEP,
        "peak_rss_mib": peak_rss_mib(),
    }


def eval_worker(
    seed: int,
    threads: int,
    marks: Sequence[int],
    out_dir: Path,
    config: str,
    scores: dict[str, str],
    recipe_overrides: Sequence[str] = (),
) -> dict:
    """mmrl's greedy evaluation (``VLMRLVRTrainer.evaluate``, the seed's held-out questions) of the start and of
    every saved state of the seed's runs: ``scores`` (``{column: metric key}``) of each, ``accuracy`` = the
    first of them."""
    import torch

    from mmrl.checkpoint import load_trainable
    from mmrl.vlm.trainer import VLMRLVRTrainer

    torch.set_num_threads(threads)
    trainer = VLMRLVRTrainer(
        _config(config, "mmrl_single", seed, threads, recipe_overrides=recipe_overrides), None
    )
    trainer.setup(for_training=False)
    start = _trainable_state(trainer.model)

    def evaluate() -> dict[str, float]:
        metrics = trainer.evaluate()
        missing = sorted(set(scores.values()) - metrics.keys())
        if missing:
            raise KeyError(f"{config}: the evaluation logs no {missing}; it logs {sorted(metrics)}")
        return {column: metrics[key] for column, key in scores.items()}

    base = evaluate()
    table: dict[str, dict[str, dict[int, float]]] = {column: {} for column in scores}
    for variant in VARIANTS:
        curve = {0: base}
        for mark in sorted(marks):
            path = out_dir / f"{variant}_seed{seed}_r{mark}.pt"
            if path.is_file():
                load_trainable(trainer.model, torch.load(path))
                curve[mark] = evaluate()
        for column in scores:
            table[column][variant] = {m: values[column] for m, values in curve.items()}
        load_trainable(trainer.model, start)
    first = next(iter(scores))
    return {"seed": seed, "questions": len(trainer.eval_set), "accuracy": table[first], "scores": table}


# --------------------------------------------------------------------------------------------- driver


#: libgomp's own spin (its count when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set), written out so that
#: a worker does not choose its wait policy from the load at its own start (pipelines/threads.py)
LIBGOMP_DEFAULT_WAIT = {"GOMP_SPINCOUNT": "300000"}


def _spawn(args: list[str], threads: int, wait_policy: dict[str, str]) -> dict:
    # the Rust tokenizers keep a thread pool of their own, which OMP_NUM_THREADS does not cap: off on both sides,
    # so the process CPU seconds count the threads the comparison names; every worker runs under the one OpenMP
    # wait policy the driver chose
    env = dict(os.environ, **wait_policy, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_trl", *args], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def first_reach(curve: dict[int, float], target: float) -> int | None:
    """The first mark after the start (mark 0) at which ``curve`` (``{rollouts: accuracy}``) is >= ``target``."""
    return next((m for m, a in sorted(curve.items()) if m > 0 and a >= target), None)


def summarize(records: list[dict]) -> dict[str, Any]:
    """Tables (per seed, and mean [min-max] over seeds) and the goals, from the results file's records."""
    runs = {(r["variant"], r["seed"]): r for r in records if r.get("kind") == "train"}
    # {seed: {column: {variant: {mark: score}}}}; a file without "scores" has the accuracy alone
    evals = {
        r["seed"]: r.get("scores", {"accuracy": r["accuracy"]}) for r in records if r.get("kind") == "eval"
    }
    columns = list(next(iter(evals.values()))) if evals else []
    seeds = sorted({s for _, s in runs})
    per_1k = {(v, s): 1000 * sum(r["step_s"]) / r["rollouts"] for (v, s), r in runs.items()}
    # process CPU seconds (all threads), where the results file has them
    cpu_1k = {k: 1000 * sum(r["step_cpu_s"]) / r["rollouts"] for k, r in runs.items() if "step_cpu_s" in r}
    print(
        "seconds per 1,000 rollouts (training only; wall, and process CPU where recorded) / peak RSS MiB, per seed"
    )
    for v in VARIANTS:
        cells = [
            f"{per_1k[(v, s)]:7.1f} s"
            + (f" (CPU {cpu_1k[(v, s)]:.1f} s)" if (v, s) in cpu_1k else "")
            + f" {runs[(v, s)]['peak_rss_mib']:6.0f} MiB"
            for s in seeds
            if (v, s) in runs
        ]
        print(f"  {v:12s} " + " | ".join(cells))
    # curves[column][variant][mark] = the seeds' scores
    curves: dict[str, dict[str, dict[int, list[float]]]] = {c: {v: {} for v in VARIANTS} for c in columns}
    for column in columns:
        marks = sorted({int(m) for e in evals.values() for curve in e[column].values() for m in curve})
        print(f"held-out {column} (mmrl greedy evaluation) at rollouts, per seed")
        for s in sorted(evals):
            for v in VARIANTS:
                curve = {int(m): a for m, a in evals[s][column][v].items()}
                for m, a in curve.items():
                    curves[column][v].setdefault(m, []).append(a)
                print(f"  seed {s} {v:12s} " + " ".join(f"{m}:{curve[m]:.3f}" for m in marks if m in curve))
    summary: dict[str, Any] = {
        "seeds": seeds,
        "per_1k_s": {},
        "peak_rss_mib": {},
        "accuracy": {},
        "scores": {},
    }
    print("mean [min-max] over seeds")
    for v in VARIANTS:
        t = [per_1k[(v, s)] for s in seeds if (v, s) in runs]
        rss = [runs[(v, s)]["peak_rss_mib"] for s in seeds if (v, s) in runs]
        if not t:
            continue
        summary["per_1k_s"][v] = statistics.fmean(t)
        summary["peak_rss_mib"][v] = statistics.fmean(rss)
        print(f"  {v:12s} {_spread(t, '.1f')} s/1k rollouts, peak RSS {_spread(rss, '.0f')} MiB")
        for column in columns:
            curve = sorted(curves[column][v].items())
            summary["scores"].setdefault(column, {})[v] = {m: statistics.fmean(a) for m, a in curve}
            print(f"  {'':12s} {column} " + " ".join(f"{m}:{_spread(a, '.3f')}" for m, a in curve))
    if columns:
        summary["accuracy"] = summary["scores"][columns[0]]
    evals = {s: e[columns[0]] for s, e in evals.items()}  # the goals are judged on the first score
    if {"mmrl_group", "trl"} <= summary["per_1k_s"].keys():
        ratio = summary["per_1k_s"]["mmrl_group"] / summary["per_1k_s"]["trl"]
        summary["group_time_ratio"] = ratio
        cpu = {v: [cpu_1k[(v, s)] for s in seeds if (v, s) in cpu_1k] for v in ("mmrl_group", "trl")}
        if cpu["mmrl_group"] and cpu["trl"]:
            summary["group_cpu_ratio"] = statistics.fmean(cpu["mmrl_group"]) / statistics.fmean(cpu["trl"])
            print(f"mmrl group / TRL process CPU seconds per 1k rollouts: {summary['group_cpu_ratio']:.2f}x")
        each = [
            per_1k[("mmrl_group", s)] / per_1k[("trl", s)]
            for s in seeds
            if {("mmrl_group", s), ("trl", s)} <= runs.keys()
        ]
        print(
            f"goal mmrl group <= 0.8x TRL time per 1k rollouts: {ratio:.2f}x (per seed "
            + ", ".join(f"{r:.2f}x" for r in each)
            + f") -> {'met' if ratio <= 0.8 else 'NOT met'}"
        )
    if {"mmrl_single", "trl"} <= summary["accuracy"].keys() and len(summary["accuracy"]["trl"]) > 1:
        trl_curve = summary["accuracy"]["trl"]
        final_mark = max(trl_curve)
        target = trl_curve[final_mark]
        reach = first_reach(summary["accuracy"]["mmrl_single"], target)
        summary["single_reach"] = reach
        got = "never" if reach is None else f"after {reach} rollouts ({reach / final_mark:.2f}x)"
        met = reach is not None and reach <= 0.5 * final_mark
        per_seed = []
        for s in sorted(evals):
            trl_s = {int(m): a for m, a in evals[s]["trl"].items()}
            single_s = {int(m): a for m, a in evals[s]["mmrl_single"].items()}
            per_seed.append(
                f"seed {s}: {first_reach(single_s, trl_s[max(trl_s)])} for {trl_s[max(trl_s)]:.3f}"
            )
        print(
            f"goal mmrl single reaches TRL's final {target:.3f} (at {final_mark}) with <= 0.5x the rollouts: "
            f"{got} -> {'met' if met else 'NOT met'} (per seed, rollouts to reach that seed's TRL final: "
            + "; ".join(per_seed)
            + ")"
        )
    if summary["peak_rss_mib"].keys() >= {"trl"}:
        for v in ("mmrl_single", "mmrl_group"):
            if v in summary["peak_rss_mib"]:
                ok = summary["peak_rss_mib"][v] <= summary["peak_rss_mib"]["trl"]
                print(
                    f"goal {v} peak RSS <= TRL's: {summary['peak_rss_mib'][v]:.0f} vs "
                    f"{summary['peak_rss_mib']['trl']:.0f} MiB -> {'met' if ok else 'NOT met'}"
                )
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="vqa", help="the embedded world")
    parser.add_argument(
        "--config", default=None, help="the recipe all variants start from (default: the task's)"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--marks",
        type=int,
        nargs="+",
        default=None,
        help="rollouts at which the trained weights are saved and evaluated; the last is the run's length "
        "(default for both tasks: 1024 2048 3072 6144)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run and evaluation")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="trl",
        help="the questions of each mmrl step: trl = shuffled passes without replacement, as TRL's sampler "
        "(default); recipe = the recipe's own selection",
    )
    add_set_option(
        parser,
        "overrides of the recipe for every variant (the variants' own settings still win), e.g. "
        "trainer.process_credit.single_groups=kind",
    )
    parser.add_argument("--out", default=None, help="results file (JSON lines), appended run by run")
    parser.add_argument(
        "--work-dir", default=None, help="folder for the saved weights (default: a temp folder)"
    )
    parser.add_argument("--summarize", default=None, help="only print the tables of this results file")
    parser.add_argument("--worker", choices=[*VARIANTS, "eval"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    args.config = args.config or task.config
    args.marks = args.marks or list(task.marks)
    if args.summarize:
        return summarize([json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line])
    mark_steps(args.marks)  # refuse bad marks before any run starts
    _config(args.config, "mmrl_single", 0, args.threads, recipe_overrides=args.overrides)  # and a bad --set
    if args.worker is not None:
        work = Path(args.work_dir)
        if args.worker == "eval":
            result = eval_worker(
                args.seed, args.threads, args.marks, work, args.config, task.scores, args.overrides
            )
        else:
            result = train_worker(
                args.worker,
                args.seed,
                args.threads,
                args.marks,
                work,
                args.config,
                args.order,
                args.overrides,
            )
        print(json.dumps(result))
        return result
    # one wait policy for every worker, chosen here from the load at the start (PASSIVE on a busy machine), not
    # by each worker from the load at its own start
    wait_policy = default_wait_policy() or LIBGOMP_DEFAULT_WAIT
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or work / "results.jsonl")
    common = [
        "--task",
        args.task,
        "--threads",
        str(args.threads),
        "--marks",
        *map(str, args.marks),
        "--work-dir",
        str(work),
        "--config",
        args.config,
        "--order",
        args.order,
        *(["--set", *args.overrides] if args.overrides else []),
    ]
    records = []
    print(
        f"task {args.task} ({args.config}{'; ' + ' '.join(args.overrides) if args.overrides else ''}); "
        f"order {args.order}; results: {out}; weights: {work}; "
        f"threads {args.threads}; OpenMP wait policy {wait_policy}",
        flush=True,
    )
    for seed in range(args.seeds):
        for variant in args.variants:
            record = {
                "kind": "train",
                "wait_policy": wait_policy,
                **_spawn(["--worker", variant, "--seed", str(seed), *common], args.threads, wait_policy),
            }
            records.append(record)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(
                f"seed {seed} {variant}: {1000 * sum(record['step_s']) / record['rollouts']:.1f} s per 1k "
                f"rollouts, peak RSS {record['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        record = {
            "kind": "eval",
            **_spawn(["--worker", "eval", "--seed", str(seed), *common], args.threads, wait_policy),
        }
        records.append(record)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"seed {seed} held-out: {json.dumps(record['scores'])}", flush=True)
    return summarize(records)


if __name__ == "__main__":
    main()
