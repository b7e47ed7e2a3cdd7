"""The training loop every recipe runs, and the ``main`` that wraps a trainer's lifecycle.

A trainer provides ``step`` (steps done), ``train_step() -> metrics``, ``evaluate() -> metrics`` and
``save_checkpoint()``; :func:`train_loop` evaluates at step 0, steps until ``total``, evaluates every
``eval_every`` steps and at the end, logs every ``run.log_every`` steps, checkpoints every ``run.save_every``
steps and at the end, shows the progress bar, logs (``log.txt`` and the terminal) each logged step's key metrics
and each evaluation's scores, and writes the run summary and report (``report.html``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mmrl.config import Config, RunConfig
from mmrl.distributed import DistState, init_distributed, shutdown_distributed
from mmrl.progress import TrainProgress
from mmrl.run import Run
from pipelines.threads import adapt_cpu_threads

__all__ = ["KEY_METRICS", "Trainer", "format_metrics", "run_recipe", "train_loop"]

logger = logging.getLogger(__name__)

# what the log line of a training step shows besides the recipe's progress-bar keys (those the step logged)
KEY_METRICS = (
    "loss",
    "policy/kl",
    "entropy/mean",
    "clip/high_frac",
    "train/effective_ratio",
    "time/rollout_s",
    "time/train_s",
)


class Trainer(Protocol):
    step: int

    def setup(self) -> None: ...

    def train(self) -> dict[str, float]: ...

    def train_step(self) -> dict[str, float]: ...

    def evaluate(self) -> dict[str, float]: ...

    def save_checkpoint(self) -> None: ...

    def cleanup(self) -> None: ...


def train_loop(
    trainer: Trainer,
    total: int,
    eval_every: int,
    run_cfg: RunConfig,
    run: Run | None,
    show: tuple[str, ...] = ("reward/mean",),
    main_process: bool = True,
) -> dict[str, float]:
    """Run ``trainer`` from its current step to ``total``; returns the latest value of every metric.

    Raises:
        ValueError: a resumed run is already at ``total`` steps or past them (before anything is written: its
            summary, report and last checkpoint stay as they are).
    """
    if trainer.step > 0 and trainer.step >= total:
        raise ValueError(
            f"run.resume: the run is at step {trainer.step} and trainer.steps={total}: nothing is left to train; "
            "raise trainer.steps to continue it"
        )
    latest: dict[str, float] = {}
    writes = main_process and run is not None
    if trainer.step == 0:
        first = trainer.evaluate()
        latest.update(first)
        if writes and first:  # (a recipe that does not score its starting model returns nothing)
            run.log_metrics(0, first)
            logger.info("step 0 evaluation: %s", format_metrics(first))
    with TrainProgress(
        total, start=trainer.step, show=show, enabled=run_cfg.progress and main_process
    ) as bar:
        while trainer.step < total:
            adapt_cpu_threads()  # short OpenMP spin while other processes keep the cores busy (run.threads_policy)
            metrics = trainer.train_step()
            trainer.step += 1
            scores = None
            if trainer.step % eval_every == 0 or trainer.step == total:
                scores = trainer.evaluate()
                metrics.update(scores)
            latest.update(metrics)
            # an evaluation's step is always written, whatever log_every: the held-out curve is what runs report
            logged = trainer.step % run_cfg.log_every == 0 or trainer.step == total or scores is not None
            if writes and logged:
                run.log_metrics(trainer.step, metrics)
                shown = {
                    k: metrics[k] for k in (*show, *KEY_METRICS) if k in metrics and k not in (scores or {})
                }
                logger.info("step %d/%d: %s", trainer.step, total, format_metrics(shown))
            if writes and scores is not None:
                logger.info("step %d evaluation: %s", trainer.step, format_metrics(scores))
            # every rank: a sharded model gathers its state collectively; the trainer writes on rank 0 only
            if run_cfg.save_every and trainer.step % run_cfg.save_every == 0:
                trainer.save_checkpoint()
            bar.update(trainer.step, latest)
    if not (run_cfg.save_every and trainer.step % run_cfg.save_every == 0):
        trainer.save_checkpoint()
    if writes:
        run.write_summary({"step": trainer.step, **latest})
        _write_report(run)
    return latest


def format_metrics(metrics: dict[str, float]) -> str:
    """``key=value`` pairs, 4 significant digits, in the dict's order."""
    return "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def _write_report(run: Run) -> None:
    """The run's ``report.html`` at the end of training; a failure to draw it is logged, not raised (the run's
    checkpoint and metrics are written; ``mmrl report RUN`` retries)."""
    from mmrl.report import write_report

    try:
        path = write_report(run.dir)
    except Exception as err:
        logger.warning("could not write the run report (retry with `mmrl report %s`): %s", run.dir, err)
        return
    logger.info("report: %s", path)


def run_recipe(cfg: Config, trainer_cls: Any) -> dict[str, float]:
    """``trainer_cls(cfg, Run(cfg.run, cfg))`` through setup, train and cleanup; returns the final metrics.

    Under a data-parallel launch only rank 0 holds the :class:`Run` (the others get ``None``, write nothing and
    resume from the checkpoint rank 0 wrote); they start once it has prepared the run directory. Every rank leaves
    the process group it joined at the end, whatever happened (:func:`mmrl.distributed.shutdown_distributed`).
    """
    dist = init_distributed()
    try:
        return _setup_and_train(cfg, trainer_cls, dist)
    finally:
        shutdown_distributed()


def _setup_and_train(cfg: Config, trainer_cls: Any, dist: DistState) -> dict[str, float]:
    run, error = None, None
    if dist.is_main:
        try:
            run = Run(cfg.run, cfg)
        except Exception as err:  # raised below on every rank, so no rank waits for rank 0 forever
            error = err
    if dist.max_over_ranks(int(error is not None)):
        raise (
            error
            if error is not None
            else RuntimeError("rank 0 could not prepare the run directory (see its error)")
        )
    trainer = trainer_cls(cfg, run)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
