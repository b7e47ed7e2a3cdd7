"""Batched flat-group rollouts of a flow model with per-step log-probs, and re-scoring of stored transitions.

A rollout denoises ``B = sum(group_sizes)`` samples (group ``g`` = ``group_sizes[g]`` samples of prompt ``g``)
together from ``sigma_0 ~ 1`` to ``sigma_S = 0``. Steps inside the SDE window are stochastic
(:func:`pipelines.flow.sde.sde_step`) and are the trainable transitions; steps outside it are deterministic Euler
(ODE) steps (MixGRPO, arXiv 2507.21802; Flow-GRPO-Fast). Every transition an RL trainer uses is a
:class:`TransitionBatch` row ``(x, x_next, sigma, sigma_next, conditioning)`` with its behaviour log-prob;
:func:`rescore` recomputes log-probs, means and stds of any such rows under the current weights. Branching
(tree) and two-stage explore/train rollouts produce the same :class:`TransitionBatch`, so one trainer serves all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.sde import (
    LOG_PROB_FORMS,
    SDE_KINDS,
    LogProbForm,
    SDEKind,
    check_noise_level,
    ode_step,
    sde_step,
)


@dataclass
class SamplingConfig:
    """How a rollout samples.

    Attributes:
        num_steps: denoising steps ``S`` (Flow-GRPO trains with 10, evaluates with 40).
        guidance_scale: CFG scale ``w`` (1 = no CFG; SD3.5 paper setting 4.5). FLUX embeds it instead.
        noise_level: SDE noise ``a`` (Flow-GRPO 0.7) / ``eta`` (DanceGRPO 0.3) / CPS ``a``.
        sde_kind: ``"flow_grpo"``, ``"dance"`` or ``"cps"``.
        sde_window: ``(start, stop)``: steps ``start <= i < stop`` are SDE steps, the others ODE steps; ``None``
            makes every step an SDE step, an empty window (``start == stop``) a deterministic ODE sample (evaluation).
            Only SDE steps are returned as trainable transitions.
        height, width: output size in pixels.
        num_frames: video frames (video adapters only).
        shift: ``None`` steps through the family's own schedule (``adapter.sigmas``: SD3's static shift 3, FLUX's
            dynamic shift by image size...); a number, a static shift of ``linspace(1, 0, S + 1)`` instead,
            ``sigma = shift t / (1 + (shift - 1) t)`` (DanceGRPO's ``--shift``; see :func:`rollout_sigmas`).
        shared_noise: one initial noise per prompt group (samples then differ only by SDE noise) instead of one
            per sample.
        negative_prompt: the unconditional prompt for CFG.
        max_batch_size: largest transformer batch per forward (CFG doubles it); ``None`` runs all samples at once.
        log_prob_form: ``"gaussian"`` or ``"squared_error"`` log-probs of SDE actions; ``None`` (default) takes
            the form of the code of the paper the kind is named after (squared error for cps), so its published
            clip range carries over (:data:`pipelines.flow.sde.PEER_LOG_PROB_FORM`).
    """

    num_steps: int = 10
    guidance_scale: float = 1.0
    noise_level: float = 0.7
    sde_kind: SDEKind = "flow_grpo"
    sde_window: tuple[int, int] | None = None
    height: int = 512
    width: int = 512
    num_frames: int | None = None
    shift: float | None = None
    shared_noise: bool = False
    negative_prompt: str = ""
    max_batch_size: int | None = None
    log_prob_form: LogProbForm | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.sde_kind not in SDE_KINDS:
            raise ValueError(f"unknown sde_kind {self.sde_kind!r}. Available: {list(SDE_KINDS)}")
        check_noise_level(self.noise_level, self.sde_kind)
        if self.sde_window is not None:
            start, stop = self.sde_window
            if not 0 <= start <= stop <= self.num_steps:
                raise ValueError(
                    f"sde_window {self.sde_window} must satisfy 0 <= start <= stop <= num_steps={self.num_steps}"
                )
        if self.log_prob_form is not None and self.log_prob_form not in LOG_PROB_FORMS:
            raise ValueError(
                f"unknown log_prob_form {self.log_prob_form!r}. Available: {list(LOG_PROB_FORMS)}"
            )
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"shift must be > 0 or None, got {self.shift}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {self.max_batch_size}")

    def sde_steps(self) -> torch.Tensor:
        """``[S]`` bool: which steps are SDE (trainable) steps."""
        mask = torch.zeros(self.num_steps, dtype=torch.bool)
        start, stop = self.sde_window if self.sde_window is not None else (0, self.num_steps)
        mask[start:stop] = True
        return mask


def check_sde_steps(config: SamplingConfig, sigmas: torch.Tensor, sde_steps: torch.Tensor) -> None:
    """Refuse SDE steps that add no noise: ``noise_level`` 0, or CPS at ``sigma_next = 0`` (the last step), where
    a transition's log-prob would divide by a zero variance.

    Args:
        sigmas: ``[S+1]`` the rollout's schedule; ``sde_steps``: ``[S]`` bool, the stochastic steps.
    """
    if config.noise_level == 0 and sde_steps.any():
        raise ValueError(
            "noise_level=0 makes every SDE step deterministic; use an ODE-only rollout (sde_window)"
        )
    if config.sde_kind == "cps" and bool((sde_steps & (sigmas[1:] == 0)).any()):
        raise ValueError("CPS adds no noise at sigma_next=0 (the last step); end the sde_window before it")


def rollout_sigmas(adapter: FlowAdapter, config: SamplingConfig) -> torch.Tensor:
    """``[S+1]`` float32 sigmas a rollout with ``config`` steps through, from 1 to 0: the family's own schedule
    (``adapter.sigmas``), or with ``config.shift`` the static shift ``shift t / (1 + (shift - 1) t)`` of
    ``t = linspace(1, 0, S + 1)``, computed by diffusers' ``FlowMatchEulerDiscreteScheduler`` (DanceGRPO samples
    FLUX so, with shift 3, where ``FluxPipeline`` shifts by the image size)."""
    if config.shift is None:
        return adapter.sigmas(config.num_steps, config.height, config.width, config.num_frames)
    return flow_match_sigmas(
        FlowMatchEulerDiscreteScheduler(shift=config.shift), config.num_steps, explicit_linspace=True
    )


@dataclass
class TransitionBatch:
    """``N`` stored transitions ``x -> x_next``, enough to re-score them under other weights.

    Attributes:
        latents: ``[N, ...]`` states ``x`` at ``sigma``.
        next_latents: ``[N, ...]`` actions ``x_next`` at ``sigma_next``.
        sigma, sigma_next: ``[N]`` float32.
        log_probs: ``[N]`` behaviour log-probs (under the weights that sampled them).
        cond: conditioning with ``N`` rows.
        sample_index: ``[N]`` row of the producing rollout's samples (for advantages).
        step_index: ``[N]`` denoising step of each transition.
        guidance_scale, noise_level, sde_kind, log_prob_form: how they were sampled and scored (re-scoring uses
            the same by default).
    """

    latents: torch.Tensor
    next_latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    log_probs: torch.Tensor
    cond: Conditioning
    sample_index: torch.Tensor
    step_index: torch.Tensor
    guidance_scale: float
    noise_level: float
    sde_kind: SDEKind
    log_prob_form: LogProbForm | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, index: torch.Tensor | Sequence[int]) -> TransitionBatch:
        """Rows ``index`` (minibatches, timestep subsampling)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return replace(
            self,
            latents=self.latents[idx],
            next_latents=self.next_latents[idx],
            sigma=self.sigma[idx],
            sigma_next=self.sigma_next[idx],
            log_probs=self.log_probs[idx],
            cond=self.cond.select(idx),
            sample_index=self.sample_index[idx],
            step_index=self.step_index[idx],
        )


@dataclass
class Rollout:
    """The result of :func:`rollout` for ``B`` samples and ``S`` steps.

    Attributes:
        prompts: ``B`` prompts, one per sample.
        group_index: ``[B]`` long, the prompt (group) each sample belongs to, ``0..len(group_sizes)-1``.
        latents: ``[B, S+1, ...]`` float32 trajectory, ``latents[:, 0]`` the initial noise.
        log_probs: ``[B, S]`` float32 behaviour log-probs; NaN at ODE steps (not policy actions).
        sigmas: ``[S+1]`` float32 schedule.
        sde_steps: ``[S]`` bool, the SDE (trainable) steps.
        images: ``[B, 3, H, W]`` (video ``[B, T, 3, H, W]``) float32 in [0, 1].
        nfe: transformer forwards spent, counted per sample (CFG counts 2 per sample and step).
        cond: conditioning with ``B`` rows (for re-scoring).
        config: the sampling config used.
    """

    prompts: list[str]
    group_index: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    sde_steps: torch.Tensor
    images: torch.Tensor
    nfe: int
    cond: Conditioning
    config: SamplingConfig = field(repr=False)

    def transitions(self, steps: Sequence[int] | torch.Tensor | None = None) -> TransitionBatch:
        """All SDE transitions as a flat batch, sample-major (``N = B * K``).

        Args:
            steps: a subset of the SDE steps (timestep subsampling): ``[K]`` for every sample, or ``[B, K]``, each
                sample's own; default all SDE steps.

        Raises:
            ValueError: a requested step is not an SDE step, or ``[B, K]`` steps for another number of samples.
        """
        sde = torch.nonzero(self.sde_steps).flatten()
        batch = self.latents.shape[0]
        steps_t = sde if steps is None else torch.as_tensor(steps, dtype=torch.long)
        if steps_t.dim() == 2 and steps_t.shape[0] != batch:
            raise ValueError(f"per-sample steps of shape {tuple(steps_t.shape)} for {batch} samples")
        if not bool(self.sde_steps[steps_t].all()):
            raise ValueError(f"steps {steps_t.tolist()} include ODE steps; SDE steps are {sde.tolist()}")
        n_steps = steps_t.shape[-1]
        sample_index = torch.arange(batch).repeat_interleave(n_steps)  # [B*K]
        step_index = steps_t.flatten() if steps_t.dim() == 2 else steps_t.repeat(batch)  # [B*K]
        return TransitionBatch(
            latents=self.latents[sample_index, step_index],
            next_latents=self.latents[sample_index, step_index + 1],
            sigma=self.sigmas[step_index],
            sigma_next=self.sigmas[step_index + 1],
            log_probs=self.log_probs[sample_index, step_index],
            cond=self.cond.select(sample_index),
            sample_index=sample_index,
            step_index=step_index,
            guidance_scale=self.config.guidance_scale,
            noise_level=self.config.noise_level,
            sde_kind=self.config.sde_kind,
            log_prob_form=self.config.log_prob_form,
        )


def expand_groups(prompts: Sequence[str], group_sizes: int | Sequence[int]) -> torch.Tensor:
    """``[B]`` group index of every sample: prompt ``g`` repeated ``group_sizes[g]`` times.

    Raises:
        ValueError: lengths differ or a size is < 1.
    """
    sizes = [group_sizes] * len(prompts) if isinstance(group_sizes, int) else list(group_sizes)
    if len(sizes) != len(prompts):
        raise ValueError(f"group_sizes has {len(sizes)} entries for {len(prompts)} prompts")
    if any(n < 1 for n in sizes):
        raise ValueError(f"every group size must be >= 1, got {sizes}")
    return torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(sizes))


def velocity_batched(
    adapter: FlowAdapter,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond: Conditioning,
    guidance_scale: float,
    max_batch_size: int | None = None,
) -> torch.Tensor:
    """``adapter.velocity`` over ``x [B, ...]`` in chunks of at most ``max_batch_size`` samples."""
    batch = x.shape[0]
    sigma_b = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1).expand(batch)
    if max_batch_size is None or batch <= max_batch_size:
        return adapter.velocity(x, sigma_b, cond, guidance_scale)
    parts = []
    for start in range(0, batch, max_batch_size):
        rows = torch.arange(start, min(start + max_batch_size, batch))
        parts.append(adapter.velocity(x[rows], sigma_b[rows], cond.select(rows), guidance_scale))
    return torch.cat(parts)


def initial_noise(
    adapter: FlowAdapter,
    group_index: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[B, ...]`` standard-normal initial latents; with ``shared_noise`` one draw per group, repeated."""
    shape = adapter.latent_shape(config.height, config.width, config.num_frames)
    draws = int(group_index.max()) + 1 if config.shared_noise else group_index.numel()
    noise = torch.randn((draws, *shape), generator=generator, dtype=torch.float32)
    return noise[group_index] if config.shared_noise else noise


@torch.no_grad()
def rollout(
    adapter: FlowAdapter,
    prompts: Sequence[str],
    group_sizes: int | Sequence[int],
    config: SamplingConfig,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> Rollout:
    """Sample groups of trajectories with per-step log-probs (no gradients).

    Args:
        adapter: the model.
        prompts: ``P`` distinct prompts.
        group_sizes: samples per prompt, one int for all or ``P`` ints (allocation may differ per prompt).
        config: sampling settings.
        generator: CPU RNG for the initial noise and every SDE draw (reproducible rollouts).
        noise: ``[B, ...]`` initial latents to start from instead of drawing them (two-stage explore/train
            regenerates chosen seeds with their original noise).

    Returns:
        :class:`Rollout`.

    Raises:
        ValueError: bad group sizes, ``noise`` of the wrong shape, or an SDE window containing a step whose
            transition is deterministic (CPS at ``sigma_next = 0``, or ``noise_level = 0``).
    """
    # 1. samples and their groups
    group_index = expand_groups(prompts, group_sizes)  # [B]
    batch = group_index.numel()
    sample_prompts = [prompts[g] for g in group_index.tolist()]
    device = adapter.device

    # 2. encode each distinct prompt once, then expand to samples
    cfg = adapter.uses_cfg(config.guidance_scale)
    cond = adapter.encode(list(prompts), cfg=cfg, negative_prompt=config.negative_prompt).select(group_index)

    # 3. schedule and SDE steps
    sigmas = rollout_sigmas(adapter, config)  # [S+1]
    sde_steps = config.sde_steps()  # [S]
    check_sde_steps(config, sigmas, sde_steps)

    # 4. initial noise
    x = initial_noise(adapter, group_index, config, generator) if noise is None else noise.float()
    expected = (batch, *adapter.latent_shape(config.height, config.width, config.num_frames))
    if tuple(x.shape) != expected:
        raise ValueError(f"noise has shape {tuple(x.shape)}, expected {expected}")

    # 5. denoise, storing every state and the behaviour log-prob of every SDE action
    latents = [x]
    log_probs = torch.full((batch, config.num_steps), float("nan"))
    x = x.to(device)
    for i in range(config.num_steps):
        v = velocity_batched(adapter, x, sigmas[i], cond, config.guidance_scale, config.max_batch_size)
        if sde_steps[i]:
            step_noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(device)
            x, lp, _, _ = sde_step(
                x,
                v,
                sigmas[i],
                sigmas[i + 1],
                config.noise_level,
                config.sde_kind,
                noise=step_noise,
                log_prob_form=config.log_prob_form,
            )
            log_probs[:, i] = lp.cpu()
        else:
            x = ode_step(x, v, sigmas[i], sigmas[i + 1])
        latents.append(x.cpu())
    nfe = batch * config.num_steps * adapter.nfe_per_sample(config.guidance_scale)

    # 6. decode
    images = adapter.decode(x).cpu()
    return Rollout(
        prompts=sample_prompts,
        group_index=group_index,
        latents=torch.stack(latents, dim=1),  # [B, S+1, ...]
        log_probs=log_probs,
        sigmas=sigmas,
        sde_steps=sde_steps,
        images=images,
        nfe=nfe,
        cond=cond,
        config=config,
    )


def rescore(
    adapter: FlowAdapter, batch: TransitionBatch, guidance_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of stored transitions under the adapter's current weights (with gradients).

        v = velocity(x, sigma | c; w);  (mean, std) = SDE(x, v, sigma, sigma_next);  log N(x_next; mean, std^2)

    The policy ratio of GRPO is ``exp(log_probs - batch.log_probs)``; the KL to the reference policy uses the
    means of a second call with the LoRA disabled (``mmrl.core.losses.gaussian_mean_kl``).

    Args:
        adapter: the model (its ``transformer`` may carry a LoRA in training mode).
        batch: transitions from :meth:`Rollout.transitions` or any other rollout producing them.
        guidance_scale: override the sampling CFG scale (``1.0`` gives CFG-free log-probs: one forward).

    Returns:
        ``(log_probs [N], means [N, ...], stds [N, 1, ...])`` float32.
    """
    w = batch.guidance_scale if guidance_scale is None else guidance_scale
    device = adapter.device
    v = adapter.velocity(batch.latents.to(device), batch.sigma.to(device), batch.cond, w)
    _, log_probs, means, stds = sde_step(
        batch.latents.to(device),
        v,
        batch.sigma.to(device),
        batch.sigma_next.to(device),
        batch.noise_level,
        batch.sde_kind,
        prev_sample=batch.next_latents.to(device),
        log_prob_form=batch.log_prob_form,
    )
    return log_probs, means, stds
