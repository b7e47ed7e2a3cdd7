"""What the pretraining and SFT recipes do the same way on top of :class:`mmrl.trainer_base.TrainerBase`: each
checkpoint carries the model as a folder its own library loads, and the final model is published to ``out``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from mmrl.checkpoint import publish_folder
from mmrl.run import resume_checkpoint
from mmrl.trainer_base import TrainerBase

__all__ = ["MODEL_FOLDER", "SupervisedTrainer"]

#: the model's folder inside a checkpoint (``checkpoints/step_N/model``)
MODEL_FOLDER = "model"


class SupervisedTrainer(TrainerBase, ABC):
    """A trainer that fits one model to data and publishes it.

    Subclasses implement :meth:`save_model` (``save_pretrained`` folders), :meth:`write_release` (the model plus
    its card into the folder being published) and, as every trainer, ``setup``, ``train_step``, ``evaluate``
    (which sets :attr:`final` at the last step) and ``state_dict`` / ``load_state``. ``cfg.out`` names the
    published folder (``None``: only the run's checkpoints).
    """

    final: dict[str, Any] | None = None  # the last step's evaluation, which the card reports

    @abstractmethod
    def save_model(self, directory: Path) -> None:
        """Write the model as the folder its library loads (``from_pretrained(directory)``)."""

    @abstractmethod
    def write_release(self, directory: Path) -> None:
        """Write the published folder's contents: :meth:`save_model` plus config, report and card."""

    def resuming_from(self) -> Path | None:
        """The checkpoint this run resumes from (``run.resume`` and one exists), else ``None``; call after
        ``setup_runtime``."""
        return resume_checkpoint(self.cfg.run) if self.checkpoint_wanted() else None

    def save_checkpoint(self) -> None:
        if self.checkpoint_wanted():
            self.write_checkpoint(
                self.state_dict(), extra=lambda directory: self.save_model(directory / MODEL_FOLDER)
            )

    def train(self) -> dict[str, float]:
        """The loop, then (rank 0, ``out`` set) the published model folder, written atomically."""
        latest = super().train()
        if self.cfg.out is not None and self.dist.is_main:
            if self.final is None:  # resumed after the last step: score the final model now
                self.evaluate()
            publish_folder(self.cfg.out, self.write_release)
        return latest
