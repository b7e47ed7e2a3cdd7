"""The one interface every VLM generation backend implements, and what it returns.

A backend turns chat prompts with images into completions and reports, per completion token, the log-prob
under the distribution the token was *actually sampled from* (the behaviour policy): logits divided by the
temperature, the suppressed vision tokens removed, then truncated to the top-p nucleus and renormalised.
With ``top_p = 1`` (the on-policy default) this equals the tempered softmax that
:func:`pipelines.vlm.logprobs.completion_token_stats` recomputes in the trainer, so ratios start at exactly 1;
with ``top_p < 1`` the two differ on purpose and the trainer's truncated importance sampling corrects for it.

Each result carries the ``weight_version`` of the weights that produced it: the backend's counter, bumped by
every :meth:`GenerationBackend.sync_weights`, so a trainer can tell stale rollouts from fresh ones.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from pipelines.vlm.inputs import SkippedPrompt, VLMPrompt

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions; the same fields mean the same thing in every backend.

    Attributes:
        temperature: logits are divided by it before sampling; ``0`` means greedy decoding (behaviour
            log-probs are then those of the untempered softmax). RLVR recipes use 1.0.
        top_p: nucleus sampling mass; ``1.0`` (default) keeps the full distribution, which is what on-policy
            RL wants. Below 1 the behaviour log-probs are those of the truncated, renormalised distribution.
        max_new_tokens: completion budget per sample; a completion that hits it finishes with ``"length"``.
        n: completions per prompt (``num_generations`` in GRPO terms; 1 for single-rollout training).
        seed: seed for this call's sampling, or ``None`` to continue the backend's random stream.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"greedy decoding (temperature=0) gives n={self.n} identical samples; use n=1")


@dataclass
class GenerationSample:
    """One completion.

    Attributes:
        prompt_index: index of its prompt in the list passed to ``generate``.
        prompt_id: that prompt's id.
        sample_index: which of the ``n`` samples of the prompt this is.
        prompt_token_ids: the prompt's token ids, image tokens expanded (what the model saw).
        completion_token_ids: generated ids, the stop token included when ``finish_reason == "stop"``.
        logprobs: ``[T]`` float32 behaviour log-prob of each completion token (see the module docstring).
        finish_reason: ``"stop"`` (a stop token was generated) or ``"length"`` (budget or context exhausted).
        text: the completion decoded with special tokens removed.
        weight_version: the backend's weight version when the sample was generated.
    """

    prompt_index: int
    prompt_id: str | None
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    text: str
    weight_version: int


@dataclass
class GenerationResult:
    """Everything one ``generate`` call produced.

    Attributes:
        samples: ``n`` samples per generated prompt, grouped by prompt, in prompt order.
        skipped: prompts that were not generated from, with the reason (e.g. too long to fit).
        weight_version: the backend's weight version for this call.
    """

    samples: list[GenerationSample]
    skipped: list[SkippedPrompt] = field(default_factory=list)
    weight_version: int = 0


class GenerationBackend(abc.ABC):
    """Generates completions with behaviour log-probs for a batch of VLM prompts.

    Lifecycle in a trainer step: ``wake_up()`` -> ``sync_weights(policy)`` -> ``generate(...)`` -> ``sleep()``.
    Backends that share memory with nothing (the transformers backend generates with the training module
    itself) keep the default no-op ``sleep``/``wake_up``.
    """

    def __init__(self) -> None:
        self._weight_version = 0

    @property
    def weight_version(self) -> int:
        """Number of weight syncs so far; stamped on every sample."""
        return self._weight_version

    @abc.abstractmethod
    def generate(self, prompts: Sequence[VLMPrompt], params: SamplingParams) -> GenerationResult:
        """Sample ``params.n`` completions for each prompt that fits; report the others as skipped."""

    @abc.abstractmethod
    def _load_weights(self, model: torch.nn.Module) -> None:
        """Make the rollout engine use ``model``'s current weights (LoRA merged)."""

    def sync_weights(self, model: torch.nn.Module) -> int:
        """Push ``model``'s current weights (a peft model has its LoRA merged) and bump the weight version.

        Returns:
            The new weight version.
        """
        self._load_weights(model)
        self._weight_version += 1
        return self._weight_version

    def sleep(self) -> None:  # noqa: B027 - intentionally a no-op default, see the class docstring
        """Release rollout memory (weights, KV cache) between steps so training can use it."""

    def wake_up(self) -> None:  # noqa: B027 - intentionally a no-op default, see the class docstring
        """Re-acquire what :meth:`sleep` released."""
