"""The training loop every recipe runs, and the ``main`` that wraps a trainer's lifecycle.

A trainer provides ``step`` (steps done), ``train_step() -> metrics``, ``evaluate() -> metrics`` and
``save_checkpoint()``; :func:`train_loop` evaluates at step 0, steps until ``total``, evaluates every
``eval_every`` steps and at the end, logs every ``run.log_every`` steps, checkpoints every ``run.save_every``
steps and at the end, shows the progress bar, and writes the run summary.
"""

from __future__ import annotations

from typing import Any, Protocol

from mmrl.config import Config, RunConfig
from mmrl.distributed import init_distributed
from mmrl.progress import TrainProgress
from mmrl.run import Run

__all__ = ["Trainer", "run_recipe", "train_loop"]


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
    """Run ``trainer`` from its current step to ``total``; returns the latest value of every metric."""
    latest: dict[str, float] = {}
    writes = main_process and run is not None
    if trainer.step == 0:
        first = trainer.evaluate()
        latest.update(first)
        if writes:
            run.log_metrics(0, first)
    with TrainProgress(total, start=trainer.step, show=show, enabled=run_cfg.progress and main_process) as bar:
        while trainer.step < total:
            metrics = trainer.train_step()
            trainer.step += 1
            if trainer.step % eval_every == 0 or trainer.step == total:
                metrics.update(trainer.evaluate())
            latest.update(metrics)
            if writes and (trainer.step % run_cfg.log_every == 0 or trainer.step == total):
                run.log_metrics(trainer.step, metrics)
            # every rank: a sharded model gathers its state collectively; the trainer writes on rank 0 only
            if run_cfg.save_every and trainer.step % run_cfg.save_every == 0:
                trainer.save_checkpoint()
            bar.update(trainer.step, latest)
    if not (run_cfg.save_every and trainer.step % run_cfg.save_every == 0):
        trainer.save_checkpoint()
    if writes:
        run.write_summary({"step": trainer.step, **latest})
    return latest


def run_recipe(cfg: Config, trainer_cls: Any) -> dict[str, float]:
    """``trainer_cls(cfg, Run(cfg.run, cfg))`` through setup, train and cleanup; returns the final metrics.

    Under a data-parallel launch only rank 0 holds the :class:`Run` (the others get ``None``, write nothing and
    resume from the checkpoint rank 0 wrote); they start once it has prepared the run directory.
    """
    dist = init_distributed()
    run, error = None, None
    if dist.is_main:
        try:
            run = Run(cfg.run, cfg)
        except Exception as err:  # raised below on every rank, so no rank waits for rank 0 forever
            error = err
    if dist.max_over_ranks(int(error is not None)):
        raise error if error is not None else RuntimeError("rank 0 could not prepare the run directory (see its error)")
    trainer = trainer_cls(cfg, run)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
