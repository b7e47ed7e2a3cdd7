"""mmrl single, mmrl group (G=8) and TRL's GRPOTrainer (G=8) side by side on the shapes VQA task.

    pip install -e ".[bench]"        # TRL
    python -m benchmarks.vs_trl [--seeds 3] [--marks 1024 2048 3072 6144] [--threads 1] [--out FILE]
    python -m benchmarks.vs_trl --summarize FILE      # the tables again, from a (possibly partial) results file

From the committed SFT checkpoint and the demo recipe (``configs/demo/vlm_shapes_single.yaml``: LoRA r16/a32 on
the language model, lr 1e-3, temperature 1, 8 new tokens, ``exact_match``, beta 0), three variants train with
64 completions per step on the same questions:

* ``mmrl_single``: the recipe as it is, one rollout for each of 64 prompts (store baseline, entropy shaping);
* ``mmrl_group``: ``trainer.mode=group``, 8 prompts x G=8, GRPO advantages, no entropy shaping;
* ``trl``: ``trl.GRPOTrainer``, 8 prompts x G=8 (``per_device_train_batch_size=64``, one optimizer step per
  generation batch), ``loss_type="dapo"`` (mmrl's ``token_mean``), clip 0.2 / 0.28, beta 0, constant lr, no
  gradient checkpointing, fp32, sampling with the vision special tokens suppressed as mmrl does.

Each seed's three runs go one after the other (interleaved: a drift of the machine hits every variant alike), each
in a fresh process, so that its peak resident memory (``VmHWM``) is its own. A run saves its LoRA weights at every
mark (rollouts consumed; marks are multiples of 64); one evaluation process per seed then scores the start and
every saved adapter with mmrl's own greedy evaluation on the run's held-out questions, the same code for all
three. Timing counts training steps only (rollouts, rewards, update), from the first step to the last, never the
evaluation or the saving of adapters: wall seconds, and the process's CPU seconds (steadier on a shared CPU).

Both sides get the same examples: the TRL dataset is built from the trainer's own ``load_examples`` (the seed's
2000 train questions), the rows' chat prompt is the one mmrl builds (the image before the question), and the
reward is the registry's verifier object, wrapped in TRL's reward-function signature.
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

from pipelines.threads import default_wait_policy

CONFIG = "configs/demo/vlm_shapes_single.yaml"
G = 8
ROLLOUTS_PER_STEP = 64
VARIANTS = ("mmrl_single", "mmrl_group", "trl")
MARKS = (1024, 2048, 3072, 6144)

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


def config_overrides(variant: str, seed: int, threads: int) -> list[str]:
    """Overrides of the demo recipe for an mmrl variant (``trl`` takes the shared ones: seed, threads)."""
    common = [
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
            "trainer.entropy_shaping.enabled=false",
        ]
    if variant == "trl":
        return common
    raise ValueError(f"unknown variant {variant!r}; available: {list(VARIANTS)}")


def _config(config: str, variant: str, seed: int, threads: int) -> Any:
    from mmrl.config import load_config
    from mmrl.vlm.config import VLMRLVRConfig

    return load_config(VLMRLVRConfig, config, config_overrides(variant, seed, threads))


def _trainable_state(model: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------- TRL side


def trl_rows(examples: Sequence[Any], system: str | None = None) -> list[dict[str, Any]]:
    """TRL dataset rows from mmrl's VQA examples: a conversational ``prompt`` (TRL inserts the ``image`` before the
    first user message's text, as :meth:`pipelines.vlm.inputs.VLMPrompt.from_question` places it), the ``answer``
    column the reward reads, and the prompt id."""
    rows = []
    for ex in examples:
        if len(ex.images) != 1:
            raise ValueError(
                f"example {ex.prompt_id}: the TRL rows take one image per question, got {len(ex.images)}"
            )
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": ex.question})
        rows.append(
            {"prompt": messages, "image": ex.images[0], "answer": ex.answer, "prompt_id": ex.prompt_id}
        )
    return rows


def trl_reward(cfg: Any) -> Callable[..., list[float]]:
    """The run's verifiers (built from the registry as the trainer builds them) in TRL's reward signature: the
    weighted sum of their scores of each completion's text against its row's ``answer``."""
    import torch

    import rewards as reward_registry

    verifiers = [(spec.weight, reward_registry.build(spec.name, **spec.options)) for spec in cfg.rewards]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        # conversational prompts: each completion is [{"role": "assistant", "content": text}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        total = torch.zeros(len(texts))
        for weight, verifier in verifiers:
            total += (
                weight
                * verifier.score(completions=texts, ground_truths=list(answer)).scores.detach().float().cpu()
            )
        return total.tolist()

    reward.__name__ = "+".join(spec.key for spec in cfg.rewards)
    return reward


def trl_config(cfg: Any, steps: int, output_dir: str, suppressed_token_ids: list[int]) -> Any:
    """``trl.GRPOConfig`` at the mmrl run's settings (64 completions = 8 prompts x G per optimizer step); sampling
    suppresses ``suppressed_token_ids`` (mmrl suppresses every vision special token, TRL only ``<|image_pad|>``
    unless told)."""
    from trl import GRPOConfig

    t, g = cfg.trainer, cfg.generation
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
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim="adamw_torch",
        beta=t.beta,
        epsilon=t.epsilon_low,
        epsilon_high=t.epsilon_high,
        loss_type="dapo",
        scale_rewards="group",
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


def run_trl(cfg: Any, marks: dict[int, int], save: Callable[[int, dict[str, Any]], None]) -> StepTimes:
    """Train TRL's GRPOTrainer for ``max(marks)`` steps; returns the time of each step (between consecutive
    ``on_step_end`` callbacks, without the callback's own saving)."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOTrainer

    from mmrl.device import DTYPES
    from mmrl.vlm.trainer import load_examples
    from pipelines.vlm.families import family_for_model_type

    m = cfg.model
    processor = AutoProcessor.from_pretrained(m.path)
    model = AutoModelForImageTextToText.from_pretrained(m.path, dtype=DTYPES[m.dtype])
    family = family_for_model_type(model.config.model_type)
    lora = LoraConfig(
        r=m.lora.rank,
        lora_alpha=m.lora.alpha,
        lora_dropout=m.lora.dropout,
        target_modules=family.lora_target_pattern(m.lora.target_modules, m.train_vision),
    )
    dataset = datasets.Dataset.from_list(trl_rows(load_examples(cfg, "train"), cfg.data.system_prompt))
    args = trl_config(
        cfg, max(marks), tempfile.mkdtemp(prefix="vs_trl_"), family.suppressed_token_ids(processor.tokenizer)
    )
    times = StepTimes()

    class Marks(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            times.start()

        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **__: Any) -> None:
            times.stop()
            if state.global_step in marks:
                save(state.global_step, _trainable_state(model))
            times.start()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(cfg),
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        peft_config=lora,
        callbacks=[Marks()],
    )
    trainer.train()
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
    variant: str, seed: int, threads: int, marks: Sequence[int], out_dir: Path, config: str
) -> dict:
    """One training run (in its own process): adapters at the marks, step times, peak RSS."""
    import torch

    torch.set_num_threads(threads)
    cfg = _config(config, variant, seed, threads)
    steps = mark_steps(marks)

    def save(step: int, state: dict[str, Any]) -> None:
        torch.save(state, out_dir / f"{variant}_seed{seed}_r{steps[step]}.pt")

    times = (run_trl if variant == "trl" else run_mmrl)(cfg, steps, save)
    if len(times.wall) != max(steps):
        raise RuntimeError(f"{variant}: {len(times.wall)} steps timed, {max(steps)} expected")
    return {
        "variant": variant,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "step_s": times.wall,
        "step_cpu_s": times.cpu,
        "rollouts": len(times.wall) * ROLLOUTS_PER_STEP,
        "peak_rss_mib": peak_rss_mib(),
    }


def eval_worker(seed: int, threads: int, marks: Sequence[int], out_dir: Path, config: str) -> dict:
    """mmrl's greedy evaluation (``VLMRLVRTrainer.evaluate``, the seed's held-out questions) of the start and of
    every saved adapter of the seed's runs."""
    import torch

    from mmrl.checkpoint import load_trainable
    from mmrl.vlm.trainer import VLMRLVRTrainer

    torch.set_num_threads(threads)
    trainer = VLMRLVRTrainer(_config(config, "mmrl_single", seed, threads), None)
    trainer.setup(for_training=False)
    start = _trainable_state(trainer.model)
    accuracy: dict[str, dict[int, float]] = {}
    base = trainer.evaluate()["eval/accuracy"]
    for variant in VARIANTS:
        accuracy[variant] = {0: base}
        for mark in sorted(marks):
            path = out_dir / f"{variant}_seed{seed}_r{mark}.pt"
            if path.is_file():
                load_trainable(trainer.model, torch.load(path))
                accuracy[variant][mark] = trainer.evaluate()["eval/accuracy"]
        load_trainable(trainer.model, start)
    return {"seed": seed, "questions": len(trainer.eval_set), "accuracy": accuracy}


# --------------------------------------------------------------------------------------------- driver


def _spawn(args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
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
    evals = {r["seed"]: r["accuracy"] for r in records if r.get("kind") == "eval"}
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
    marks = sorted({int(m) for acc in evals.values() for curve in acc.values() for m in curve})
    print("held-out accuracy (mmrl greedy evaluation) at rollouts, per seed")
    curves: dict[str, dict[int, list[float]]] = {v: {} for v in VARIANTS}
    for s in sorted(evals):
        for v in VARIANTS:
            curve = {int(m): a for m, a in evals[s][v].items()}
            for m, a in curve.items():
                curves[v].setdefault(m, []).append(a)
            print(f"  seed {s} {v:12s} " + " ".join(f"{m}:{curve[m]:.3f}" for m in marks if m in curve))
    summary: dict[str, Any] = {"seeds": seeds, "per_1k_s": {}, "peak_rss_mib": {}, "accuracy": {}}
    print("mean [min-max] over seeds")
    for v in VARIANTS:
        t = [per_1k[(v, s)] for s in seeds if (v, s) in runs]
        rss = [runs[(v, s)]["peak_rss_mib"] for s in seeds if (v, s) in runs]
        if not t:
            continue
        summary["per_1k_s"][v] = statistics.fmean(t)
        summary["peak_rss_mib"][v] = statistics.fmean(rss)
        summary["accuracy"][v] = {m: statistics.fmean(a) for m, a in sorted(curves[v].items())}
        acc = " ".join(f"{m}:{_spread(a, '.3f')}" for m, a in sorted(curves[v].items()))
        print(
            f"  {v:12s} {_spread(t, '.1f')} s/1k rollouts, peak RSS {_spread(rss, '.0f')} MiB; accuracy {acc}"
        )
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
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--marks",
        type=int,
        nargs="+",
        default=list(MARKS),
        help="rollouts at which adapters are saved and evaluated; the last is the run's length",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run and evaluation")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=None, help="results file (JSON lines), appended run by run")
    parser.add_argument(
        "--work-dir", default=None, help="folder for the saved adapters (default: a temp folder)"
    )
    parser.add_argument("--summarize", default=None, help="only print the tables of this results file")
    parser.add_argument("--worker", choices=[*VARIANTS, "eval"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize([json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line])
    mark_steps(args.marks)  # refuse bad marks before any run starts
    default_wait_policy()  # before any torch import: on a busy machine the workers inherit PASSIVE
    if args.worker is not None:
        work = Path(args.work_dir)
        if args.worker == "eval":
            result = eval_worker(args.seed, args.threads, args.marks, work, args.config)
        else:
            result = train_worker(args.worker, args.seed, args.threads, args.marks, work, args.config)
        print(json.dumps(result))
        return result
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or work / "results.jsonl")
    common = [
        "--threads",
        str(args.threads),
        "--marks",
        *map(str, args.marks),
        "--work-dir",
        str(work),
        "--config",
        args.config,
    ]
    records = []
    print(f"results: {out}; adapters: {work}; threads {args.threads}", flush=True)
    for seed in range(args.seeds):
        for variant in args.variants:
            record = {
                "kind": "train",
                **_spawn(["--worker", variant, "--seed", str(seed), *common], args.threads),
            }
            records.append(record)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(
                f"seed {seed} {variant}: {1000 * sum(record['step_s']) / record['rollouts']:.1f} s per 1k "
                f"rollouts, peak RSS {record['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        record = {"kind": "eval", **_spawn(["--worker", "eval", "--seed", str(seed), *common], args.threads)}
        records.append(record)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"seed {seed} accuracy: {json.dumps(record['accuracy'])}", flush=True)
    return summarize(records)


if __name__ == "__main__":
    main()
