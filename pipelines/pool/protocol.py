"""What travels between a trainer, a :class:`~pipelines.pool.pool.RolloutPool` and its workers.

A trainer turns the allocator's decision (prompt ids and how many samples each) into :class:`RolloutRequest`\\ s;
a rollout worker answers each with one :class:`RolloutResult` stamped with the weight version that produced it;
the pool hands a step's results to the trainer as a :class:`PoolBatch`, which also says how many versions behind
the trainer every sample is (``lag``), so that the trainer can weight stale samples by truncated importance
sampling (``mmrl.core.losses.stale_sample_weights`` with the behaviour log-probs inside each output).
Weights go the other way as a :class:`WeightUpdate` (see :mod:`pipelines.pool.weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: ``"full"`` runs the worker's full-precision model; any other value names a quantized copy the worker holds
#: (a :data:`pipelines.quant.SCHEMES` entry, e.g. ``"int8"``, ``"nf4"``, ``"fp8"``).
FULL_PRECISION = "full"


class PoolError(RuntimeError):
    """The pool cannot deliver: a request failed on a worker, no worker is left, or a worker cannot be built."""


class RewardError(PoolError):
    """A reward worker kept failing on a request after every retry (never turned into a silent zero reward)."""


class WeightVersionError(RuntimeError):
    """A worker was asked for samples of a weight version it does not hold (it refuses instead of guessing)."""


@dataclass(frozen=True)
class RolloutRequest:
    """One unit of rollout work: a few prompts, how many samples each, and how to make them reproducibly.

    Attributes:
        request_id: unique id; the pool delivers exactly one result per id, whatever fails in between.
        prompt_ids: ``P`` ids of the prompts (the keys of the trainer's prompt statistics store).
        prompts: ``P`` prompts: strings for flow models, :class:`pipelines.vlm.inputs.VLMPrompt` for VLMs.
        counts: ``P`` samples per prompt, from the trainer's allocator (``allocate(...)``); each >= 1.
        seed: seeds every random draw of the request, so the same request gives the same samples on any worker.
        precision: :data:`FULL_PRECISION` or the quantization scheme of the worker's quantized copy (explore).
        weight_version: the weight version the trainer expects the worker to hold at least; the pool stamps the
            trainer's current version at dispatch. A worker holding an older version refuses the request.
        metadata: optional ``P`` dicts passed to the reward (e.g. ``{"ground_truth": "4"}`` for verifiers).
    """

    request_id: str
    prompt_ids: list[str]
    prompts: list[Any]
    counts: list[int]
    seed: int
    precision: str = FULL_PRECISION
    weight_version: int = 0
    metadata: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        n = len(self.prompts)
        if n == 0:
            raise ValueError(f"request {self.request_id!r} has no prompts")
        if len(self.prompt_ids) != n or len(self.counts) != n:
            raise ValueError(
                f"request {self.request_id!r}: {n} prompts but {len(self.prompt_ids)} prompt_ids and "
                f"{len(self.counts)} counts; give one id and one count per prompt"
            )
        if self.metadata is not None and len(self.metadata) != n:
            raise ValueError(
                f"request {self.request_id!r}: {n} prompts but {len(self.metadata)} metadata dicts"
            )
        if any(int(c) < 1 for c in self.counts):
            raise ValueError(
                f"request {self.request_id!r}: every count must be >= 1, got {list(self.counts)}"
            )

    @property
    def num_samples(self) -> int:
        """Samples requested: ``sum(counts)``."""
        return int(sum(self.counts))


@dataclass
class RolloutResult:
    """A worker's answer to one :class:`RolloutRequest`.

    Attributes:
        request_id: the request answered.
        prompt_ids: the request's prompt ids.
        weight_version: version of the weights that generated every sample of this result.
        output: the task's output: a :class:`pipelines.flow.rollout.Rollout` (behaviour log-probs in
            ``log_probs``) or a :class:`pipelines.vlm.backend.GenerationResult` (``samples[i].logprobs``).
        num_samples: samples in ``output`` (a VLM prompt too long to fit is skipped, so this can be below the
            requested count).
        seconds: generation wall time on the worker.
        worker: index of the pool worker that produced it (set by the pool).
        reward: the reward workers' scores, ``[num_samples]``, when the pool has reward workers.
        reward_inputs: the batch the reward scores (``images``/``prompts`` or ``completions``/``ground_truths``);
            dropped by the pool once scored, so the trainer does not hold the images twice.
    """

    request_id: str
    prompt_ids: list[str]
    weight_version: int
    output: Any
    num_samples: int
    seconds: float = 0.0
    worker: int = -1
    reward: Any = None
    reward_inputs: dict[str, Any] | None = field(default=None, repr=False)


@dataclass
class PoolBatch:
    """The results a trainer consumes at one step, with the staleness of each.

    Attributes:
        results: one result per delivered request, in submission order.
        version: the trainer's weight version at delivery (the latest :meth:`RolloutPool.broadcast`).
    """

    results: list[RolloutResult]
    version: int

    @property
    def num_samples(self) -> int:
        return sum(r.num_samples for r in self.results)

    @property
    def lags(self) -> list[int]:
        """Per result: ``version - result.weight_version``, how many updates behind its samples are."""
        return [self.version - r.weight_version for r in self.results]

    def sample_versions(self) -> torch.Tensor:
        """``[N]`` long: the weight version of every sample, results in order, samples in output order."""
        return torch.tensor(
            [r.weight_version for r in self.results for _ in range(r.num_samples)], dtype=torch.long
        )

    def sample_lags(self) -> torch.Tensor:
        """``[N]`` long: ``version - sample_versions()``; 0 for on-policy samples (what importance correction
        needs: a sample with lag > 0 was drawn from an older policy than the one being trained)."""
        return self.version - self.sample_versions()


UpdateKind = Literal["lora", "full"]


@dataclass
class WeightUpdate:
    """Weights the trainer pushes to every rollout worker.

    Attributes:
        version: the trainer's weight version after this update (strictly increasing; version 0 means "the
            weights the workers loaded themselves").
        kind: ``"lora"``: only the adapter's tensors (peft state dict, adapter name stripped) with the base
            frozen; ``"full"``: every tensor of the trained module (LoRA merged, Hugging Face names).
        state: name -> CPU tensor.
        lora_config: the peft ``LoraConfig`` of the adapter (``kind="lora"``), so a worker without the adapter
            yet injects the same one before loading.
    """

    version: int
    kind: UpdateKind
    state: dict[str, torch.Tensor]
    lora_config: Any = None

    def __post_init__(self) -> None:
        if self.kind not in ("lora", "full"):
            raise ValueError(f"unknown update kind {self.kind!r}. Available: ['full', 'lora']")
        if self.kind == "lora" and self.lora_config is None:
            raise ValueError("a 'lora' update needs the adapter's lora_config")

    @property
    def num_bytes(self) -> int:
        """Payload size (what a broadcast moves per worker)."""
        return sum(t.numel() * t.element_size() for t in self.state.values())
