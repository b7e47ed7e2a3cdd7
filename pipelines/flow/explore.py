"""Two-stage explore/train rollouts (Sol-RL): a quantized copy previews many seeds, full precision trains few.

1. For each prompt draw ``K`` initial noises (candidate seeds).
2. The *explorer* (a quantized copy of the policy, ``pipelines.quant.quantize_copy``, kept in sync by merging the
   current LoRA into it) denoises all ``P*K`` candidates with a few deterministic Euler (ODE) steps: cheap previews.
3. A reward ranks the previews within each prompt; a selection rule keeps a contrastive subset (best-k and
   worst-k by default).
4. The trainer regenerates exactly those seeds at full precision from the same initial noise, with SDE log-probs
   (a flat group or a tree per seed), and trains only on them.

Because the ODE map from noise to image is deterministic, a seed's preview predicts its full-precision sample;
:func:`spearman_within` measures how well: the rank agreement of preview and full rewards among each prompt's seeds
(the ranking the selection uses), which the trainer logs. A Spearman pooled over prompts would also credit the
preview for telling easy prompts from hard ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from pipelines.flow.adapters.base import FlowAdapter
from pipelines.flow.rollout import SamplingConfig, rollout

__all__ = [
    "ExploreConfig",
    "ExploreResult",
    "explore",
    "explorer_weights",
    "select_seeds",
    "spearman",
    "spearman_within",
]

Selection = Literal["extremes", "random", "extremes_random"]


@dataclass(frozen=True)
class ExploreConfig:
    """Settings of the preview stage.

    Attributes:
        candidates: ``K`` seeds previewed per prompt.
        preview_steps: Euler steps of a preview (Sol-RL previews with a handful).
        keep_best, keep_worst: seeds kept per prompt from the top / bottom of the preview ranking.
        selection: ``extremes`` (best and worst), ``random`` (``keep_best + keep_worst`` at random), or
            ``extremes_random`` (the extremes plus ``extra_random`` seeds drawn from the middle).
        extra_random: middle seeds added by ``extremes_random``.
    """

    candidates: int = 16
    preview_steps: int = 4
    keep_best: int = 2
    keep_worst: int = 2
    selection: Selection = "extremes"
    extra_random: int = 0

    def __post_init__(self) -> None:
        keep = self.per_prompt()
        if self.preview_steps < 1:
            raise ValueError(f"preview_steps must be >= 1, got {self.preview_steps}")
        if keep < 1 or keep > self.candidates:
            raise ValueError(f"keeping {keep} of {self.candidates} candidates per prompt is impossible")
        if self.selection not in ("extremes", "random", "extremes_random"):
            raise ValueError(f"unknown selection {self.selection!r}; use extremes, random or extremes_random")

    def per_prompt(self) -> int:
        extra = self.extra_random if self.selection == "extremes_random" else 0
        return self.keep_best + self.keep_worst + extra


@dataclass
class ExploreResult:
    """Previews and the seeds chosen for full-precision regeneration.

    Attributes:
        noise: ``[P*n, ...]`` initial noises of the chosen seeds, grouped by prompt (``n`` per prompt).
        chosen: ``[P, n]`` candidate index of each chosen seed.
        preview_rewards: ``[P, K]`` preview reward of every candidate.
        chosen_preview_rewards: ``[P*n]`` preview rewards of the chosen seeds (for the rank agreement).
        nfe: explorer evaluations spent.
    """

    noise: torch.Tensor
    chosen: torch.Tensor
    preview_rewards: torch.Tensor
    chosen_preview_rewards: torch.Tensor
    nfe: int


def select_seeds(
    rewards: torch.Tensor, config: ExploreConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[P, n]`` candidate indices to keep from preview ``rewards [P, K]`` under ``config.selection``.

    ``extremes``: the ``keep_best`` highest then the ``keep_worst`` lowest (ties: lower index first);
    ``random``: ``n`` distinct candidates uniformly; ``extremes_random``: the extremes plus ``extra_random``
    distinct candidates from the rest.
    """
    num_prompts, k = rewards.shape
    if k != config.candidates:
        raise ValueError(f"rewards have {k} candidates per prompt, config says {config.candidates}")
    n = config.per_prompt()
    if config.selection == "random":
        scores = torch.rand(num_prompts, k, generator=generator)
        return scores.argsort(dim=1)[:, :n]
    order = torch.sort(-rewards, dim=1, stable=True).indices  # best first, ties by index
    best = order[:, : config.keep_best]
    worst = order[:, k - config.keep_worst :] if config.keep_worst else order[:, :0]
    chosen = torch.cat([best, worst], dim=1)
    if config.selection == "extremes_random" and config.extra_random:
        middle = order[:, config.keep_best : k - config.keep_worst]  # [P, K - best - worst]
        pick = torch.rand(middle.shape, generator=generator).argsort(dim=1)[:, : config.extra_random]
        chosen = torch.cat([chosen, middle.gather(1, pick)], dim=1)
    return chosen


@contextmanager
def explorer_weights(adapter: FlowAdapter, explorer: torch.nn.Module) -> Iterator[FlowAdapter]:
    """Run ``adapter`` with ``explorer`` (the quantized copy) as its transformer; the policy is untouched."""
    with adapter.swapped_denoiser(explorer):
        yield adapter


@torch.no_grad()
def explore(
    adapter: FlowAdapter,
    explorer: torch.nn.Module,
    prompts: Sequence[str],
    sampling: SamplingConfig,
    config: ExploreConfig,
    reward_fn: Callable[[torch.Tensor, list[str]], torch.Tensor],
    generator: torch.Generator | None = None,
) -> ExploreResult:
    """Preview ``K`` seeds per prompt with the explorer and choose which to regenerate (steps 1-3 above).

    Args:
        adapter: the policy's adapter (its pipeline provides encoders, schedule and decoder).
        explorer: the quantized transformer copy.
        prompts: ``P`` prompts.
        sampling: the training sampling settings (size, guidance); the preview uses ``config.preview_steps``
            Euler steps with no SDE noise.
        config: preview and selection settings.
        reward_fn: ``(images [N, 3, H, W], prompts) -> [N]`` rewards.
        generator: RNG of the candidate noises and random selections.
    """
    prompts = list(prompts)
    k = config.candidates
    shape = adapter.latent_shape(sampling.height, sampling.width, sampling.num_frames)
    noise = torch.randn((len(prompts) * k, *shape), generator=generator)  # [P*K, ...], prompt-major
    # an ODE preview of each candidate's own noise
    preview = dataclasses.replace(
        sampling, num_steps=config.preview_steps, sde_window=(0, 0), shared_noise=False, log_prob_form=None
    )
    with explorer_weights(adapter, explorer):
        ro = rollout(adapter, prompts, k, preview, noise=noise)
    rewards = reward_fn(ro.images, ro.prompts).float().reshape(len(prompts), k)
    chosen = select_seeds(rewards, config, generator)  # [P, n]
    flat = (torch.arange(len(prompts)).unsqueeze(1) * k + chosen).flatten()
    return ExploreResult(
        noise=noise[flat],
        chosen=chosen,
        preview_rewards=rewards,
        chosen_preview_rewards=rewards.flatten()[flat],
        nfe=ro.nfe,
    )


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two ``[N]`` vectors (average ranks for ties); NaN if either is constant."""
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"spearman needs two equal 1-D tensors, got {tuple(a.shape)} and {tuple(b.shape)}")

    def ranks(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        order = torch.argsort(x, stable=True)
        r = torch.empty_like(x)
        r[order] = torch.arange(x.numel(), dtype=torch.float64)
        # average the ranks of tied values
        uniq, inverse = torch.unique(x, return_inverse=True)
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, r)
        counts = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
        return (sums / counts)[inverse]

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.square().sum() * rb.square().sum()).sqrt()
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def spearman_within(a: torch.Tensor, b: torch.Tensor, group_sizes: int | Sequence[int]) -> float:
    """Mean over groups of the :func:`spearman` of ``a`` and ``b`` within each group: ``[N]`` vectors laid out
    group by group, ``group_sizes`` the size of each (an int: every group that size). Groups where either side is
    constant (no ranking) are left out; NaN if none is left."""
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"spearman_within needs two equal 1-D tensors, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    sizes = [group_sizes] * (a.numel() // group_sizes) if isinstance(group_sizes, int) else list(group_sizes)
    if sum(sizes) != a.numel():
        raise ValueError(f"group sizes {sizes} do not add up to the {a.numel()} values")
    per_group = [spearman(x, y) for x, y in zip(a.split(sizes), b.split(sizes), strict=True)]
    defined = [rho for rho in per_group if rho == rho]
    return sum(defined) / len(defined) if defined else float("nan")
