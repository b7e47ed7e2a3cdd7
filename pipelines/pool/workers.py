"""Pool members: the rollout-worker base class (any task callable) and reward workers.

A worker is a plain object living wherever the executor puts it (a thread of the trainer process, or a Ray actor
on some GPU). The pool builds it there from a picklable factory, e.g.
``functools.partial(FlowRolloutWorker.from_pretrained, "sd3", "stabilityai/stable-diffusion-3.5-medium", sampling)``,
so weights are loaded on the worker's own device and never shipped from the trainer.

Every rollout worker answers :meth:`RolloutWorker.run` (one request -> one result stamped with its weight
version) and :meth:`RolloutWorker.load_weights` (a :class:`WeightUpdate`; the worker's version becomes the
update's). A request for a version newer than the one the worker holds is refused with
:class:`WeightVersionError`, so a sample is never labelled with weights that did not produce it.
Task workers: :class:`pipelines.pool.flow_worker.FlowRolloutWorker`, :class:`pipelines.pool.vlm_worker.VLMRolloutWorker`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from pipelines.pool.protocol import RolloutRequest, RolloutResult, WeightUpdate, WeightVersionError
from pipelines.threads import adapt_cpu_threads


class RolloutWorker:
    """A rollout worker around a task callable ``fn(request) -> output``.

    Subclasses (:class:`pipelines.pool.flow_worker.FlowRolloutWorker`,
    :class:`pipelines.pool.vlm_worker.VLMRolloutWorker`) override :meth:`generate`,
    :meth:`apply_weights`, :meth:`reward_inputs` and :meth:`sample_count`; a custom task can pass ``fn``.

    Args:
        fn: the task; required unless a subclass overrides :meth:`generate`.
        num_threads: torch CPU threads (``torch.set_num_threads``, process-wide: in-process it applies to the
            trainer too); ``None`` leaves the setting alone. Match it to the CPUs a Ray actor reserves.
    """

    def __init__(
        self, fn: Callable[[RolloutRequest], Any] | None = None, num_threads: int | None = None
    ) -> None:
        self.fn = fn
        self.version = 0
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    # ---- what a task defines ----------------------------------------------------------------------------------

    def generate(self, request: RolloutRequest) -> Any:
        """The task's output for ``request``, reproducible from ``request.seed``."""
        if self.fn is None:
            raise NotImplementedError(f"{type(self).__name__} needs fn= or a generate() override")
        return self.fn(request)

    def apply_weights(self, update: WeightUpdate) -> None:
        """Load ``update`` into the task's model (the base worker has none to load)."""
        raise ValueError(f"{type(self).__name__} has no model to load weights into")

    def reward_inputs(self, request: RolloutRequest, output: Any) -> dict[str, Any] | None:
        """The keyword batch a :class:`rewards.Reward` scores for ``output`` (``None``: not scorable)."""
        return None

    def sample_count(self, request: RolloutRequest, output: Any) -> int:
        """Samples in ``output``."""
        return request.num_samples

    # ---- what the pool calls ----------------------------------------------------------------------------------

    def run(self, request: RolloutRequest) -> RolloutResult:
        """Answer ``request`` with the weights held now.

        Raises:
            WeightVersionError: the worker holds a version older than ``request.weight_version``.
        """
        if request.weight_version > self.version:
            raise WeightVersionError(
                f"request {request.request_id!r} expects weight version {request.weight_version}, "
                f"this worker holds {self.version}"
            )
        adapt_cpu_threads()  # the process's adaptive spin: a Ray actor's own; in-process, the trainer's
        start = time.perf_counter()
        output = self.generate(request)
        return RolloutResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            weight_version=self.version,
            output=output,
            num_samples=self.sample_count(request, output),
            seconds=time.perf_counter() - start,
            reward_inputs=self.reward_inputs(request, output),
        )

    def load_weights(self, update: WeightUpdate) -> int:
        """Apply ``update``; returns the version now held.

        Raises:
            ValueError: ``update.version`` is older than the held version (updates arrive in order; an old one
                would silently roll the policy back).
        """
        if update.version < self.version:
            raise ValueError(f"weight update {update.version} is older than the held version {self.version}")
        self.apply_weights(update)
        self.version = update.version
        return self.version

    def info(self) -> dict[str, Any]:
        """``{"pid", "version"}``: where the worker runs (fault injection, debugging) and what it holds."""
        return {"pid": os.getpid(), "version": self.version}


class RewardWorker:
    """A reward model as a pool member: scores the ``reward_inputs`` of rollout results.

    Any :class:`rewards.Reward` works: a local model (``rewards.build("pickscore", device="cuda")``) or the
    reward server's client (``rewards.build("remote", url=...)``), which retries HTTP failures itself.

    Args:
        reward: the reward.
    """

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    @classmethod
    def build(cls, name: str, **options: Any) -> RewardWorker:
        """``RewardWorker(rewards.build(name, **options))`` (a worker factory)."""
        import rewards

        return cls(rewards.build(name, **options))

    def score(self, batch: dict[str, Any]) -> Any:
        """The reward's :class:`rewards.RewardOutput` for ``batch``."""
        return self.reward.score(**batch)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid()}
