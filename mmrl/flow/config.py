"""Config of the flow-matching GRPO recipe (``recipe: flow_grpo``): one section per component."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator, model_validator

from mmrl.config import Config, Field, RunConfig
from mmrl.core.estimators import check_estimator
from mmrl.device import DeviceName
from mmrl.flow.objectives import check_objective, list_objectives
from mmrl.flow.objectives.awm import TimeType
from mmrl.optim import OptimizerName, check_optimizer_dtype
from mmrl.schedule import LRSchedule, learning_rate
from mmrl.sections import (
    AllocationConfig,
    LoraSettings,
    PoolSettings,
    RewardSpec,
    check_gdpo_estimator,
    check_group_sizes,
    check_reward_inputs,
    check_reward_keys,
)
from pipelines.flow.branch import TreeConfig
from pipelines.flow.rollout import SamplingConfig
from pipelines.flow.sde import check_noise_level
from pipelines.quant import Scheme

__all__ = [
    "AWMSettings",
    "ExploreSettings",
    "FlowEvalSet",
    "FlowGRPOConfig",
    "FlowLora",
    "FlowModelConfig",
    "FlowSamplingConfig",
    "FlowTrainerConfig",
    "GuidanceDistillSettings",
    "TreeSettings",
]


class FlowLora(LoraSettings):
    """LoRA of a diffusers transformer (defaults: its attention projections)."""


class FlowModelConfig(Config):
    family: str = Field(
        "shapes",
        description="Registered flow family (pipelines.flow.adapters.list_adapters(): shapes, sd3, flux, "
        "flux2, flux2_klein, qwen_image, z_image, sana, wan, wan22, or one registered with register_flow_family).",
    )
    path: str = Field("checkpoints/shapes_flow", description="Hub id or local diffusers directory.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype; bfloat16 on GPUs. The SDE math is always float32."
    )
    device: DeviceName = Field(
        "auto", description="'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1'..."
    )
    master_weight_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype of the trained parameters (full fine-tuning's transformer, or the LoRA factors), their "
        "gradients, AdamW states and EMA; the frozen weights stay in model.dtype. float32 (Flow-Factory's "
        "master_weight_dtype default; peft's for LoRA): in bfloat16 an AdamW step below 2^-9 of a weight rounds "
        "away. bfloat16: pure bfloat16 training in half the memory.",
    )
    autocast: Literal["bfloat16", "float16"] | None = Field(
        None,
        description="Mixed precision: the transformer computes in this dtype under torch.autocast while its weights "
        "keep their dtypes (faster on GPUs and on CPUs with bfloat16 instructions). null: model.dtype when the "
        "trained parameters are kept in another dtype (float32 master weights of a bfloat16 model), else none.",
    )
    lora: FlowLora | None = Field(
        default_factory=FlowLora, description="LoRA settings; null trains the full transformer."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (less memory)."
    )
    init_lora: str | None = Field(
        None,
        description="Start from a saved LoRA: a checkpoint's adapter folder, or a Hub LoRA's id "
        "namespace/name.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="More from_pretrained / adapter options (revision, variant, max_sequence_length, ...).",
    )

    @field_validator("init_lora")
    @classmethod
    def _init_lora_exists(cls, path: str | None) -> str | None:
        """A local folder that is missing is refused here, not after the model loaded; ``namespace/name`` that
        is no local path is left to the Hub (``~`` is the home folder)."""
        if path is None:
            return None
        path = os.path.expanduser(path)
        local = Path(path)
        hub_id = not local.is_absolute() and len(local.parts) == 2 and local.parts[0][0] != "."
        if not local.is_dir() and (local.exists() or not hub_id):
            raise ValueError(
                f"no LoRA folder at {path}: give a LoRA checkpoint's adapter/ folder (it holds "
                "pytorch_lora_weights.safetensors) or a Hub LoRA's id namespace/name"
            )
        return path

    def compute_dtype(self) -> str | None:
        """What the transformer computes in under ``torch.autocast`` (None: no autocast): ``autocast``, else
        ``dtype`` when the trained parameters are kept in another dtype (``master_weight_dtype``)."""
        if self.autocast is not None:
            return self.autocast
        if self.dtype != "float32" and self.master_weight_dtype != self.dtype:
            return self.dtype
        return None


class FlowSamplingConfig(Config):
    num_steps: int = Field(10, ge=1, description="Denoising steps of training rollouts (Flow-GRPO: 10).")
    eval_num_steps: int = Field(10, ge=1, description="ODE steps of evaluation samples.")
    guidance_scale: float = Field(1.0, ge=1.0, description="CFG scale (1: no CFG). SD3.5: 4.5.")
    noise_level: float = Field(
        0.7, gt=0, description="SDE noise a (Flow-GRPO 0.7; at most 1 for sde_kind cps) or eta (DanceGRPO)."
    )
    sde_kind: Literal["flow_grpo", "dance", "cps"] = Field("flow_grpo", description="SDE variant.")
    log_prob_form: Literal["gaussian", "squared_error"] | None = Field(
        None,
        description="Log-prob of an SDE action. null (default): the form of the code of the paper the "
        "sde_kind is named after, so its published clip range carries over: the Gaussian density for flow_grpo "
        "and dance, Flow-GRPO's squared error -mean((x' - mean)^2) for cps (its log-ratios are 2 std^2 times the "
        "Gaussian ones). gaussian on cps: the exact density; divide a CPS clip range from Flow-GRPO by 2 std^2.",
    )
    sde_window: int | None = Field(
        None, ge=1, description="SDE steps per rollout (a window; ODE elsewhere). null: every step is SDE."
    )
    window_schedule: Literal["random", "sliding", "fixed"] = Field(
        "random",
        description="Where the SDE window sits each step (MixGRPO slides it, Flow-GRPO-Fast draws it).",
    )
    sde_window_range: tuple[int, int] | None = Field(
        None,
        description="[first, end]: the SDE window stays inside steps first <= i < end, its start drawn (or slid) "
        "in first .. end - sde_window, as Flow-GRPO-Fast's and verl's sde_window_range (verl's Qwen-Image OCR: "
        "[0, 5] with a window of 2). null: anywhere in the schedule.",
    )
    height: int = Field(32, ge=8, description="Image height in pixels.")
    width: int = Field(32, ge=8, description="Image width in pixels.")
    num_frames: int | None = Field(None, ge=1, description="Video frames (Wan).")
    shift: float | None = Field(
        None,
        gt=0,
        description="null: the family's own sigma schedule (SD3's static shift 3, FLUX's dynamic shift by image "
        "size, ...). A number: the static shift sigma = shift t / (1 + (shift - 1) t) of t = linspace(1, 0, "
        "steps + 1) for rollouts and evaluation (DanceGRPO's --shift: 3 for FLUX).",
    )
    shared_noise: bool = Field(False, description="One initial noise per prompt group.")
    negative_prompt: str = Field("", description="Unconditional prompt for CFG.")
    max_batch_size: int | None = Field(None, ge=1, description="Largest transformer batch per forward.")
    rollout: Literal["flat", "branch"] = Field(
        "flat",
        description="flat: independent groups; branch: trees with shared prefixes (see the tree section).",
    )

    def window_bounds(self) -> tuple[int, int]:
        """``(first, end)``: the steps ``first <= i < end`` an SDE window may cover, ``sde_window_range`` (every
        step without one), ending before the last step for cps, which adds no noise there (sigma_next = 0)."""
        first, end = self.sde_window_range or (0, self.num_steps)
        return first, min(end, self.num_steps - 1) if self.sde_kind == "cps" else end

    def rollout_settings(self, sde_window: tuple[int, int] | None, **changes: Any) -> SamplingConfig:
        """These settings as the pipeline's :class:`SamplingConfig` with the SDE steps ``sde_window`` (``(0, 0)``:
        a deterministic ODE sample); ``changes`` replace fields (evaluation: ``num_steps=eval_num_steps``)."""
        settings = SamplingConfig(
            num_steps=self.num_steps,
            guidance_scale=self.guidance_scale,
            noise_level=self.noise_level,
            sde_kind=self.sde_kind,
            sde_window=sde_window,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            shift=self.shift,
            shared_noise=self.shared_noise,
            negative_prompt=self.negative_prompt,
            max_batch_size=self.max_batch_size,
            log_prob_form=self.log_prob_form,
        )
        return dataclasses.replace(settings, **changes)


class TreeSettings(Config):
    split_steps: list[int] = Field(
        default_factory=lambda: [0, 2, 4, 6],
        description="Steps (counted from the SDE window's start) whose draw branches into children.",
    )
    branch_factor: int | list[int] = Field(
        2, description="Children per split: one int or one per split (>= 2)."
    )
    fusion: Literal["mean", "path_prob"] = Field(
        "mean", description="Node reward: mean of its leaves, or path-probability weighted (BranchGRPO)."
    )
    train_depths: list[int] | None = Field(None, description="Depth pruning: train only these node depths.")
    width: int | None = Field(
        None, ge=1, description="Width pruning: train the k nodes of largest |A| per depth."
    )


class ExploreSettings(Config):
    enabled: bool = Field(
        False, description="Two-stage explore/train (Sol-RL): preview seeds with a quantized copy."
    )
    scheme: Scheme = Field(
        "nf4",
        description="Explorer quantization: nf4/fp4/int8 (bitsandbytes, CPU+GPU), fp8_weight_only (torchao, "
        "CPU+GPU), fp8 (Hopper), nvfp4 (Blackwell); none: a full-precision copy.",
    )
    candidates: int = Field(16, ge=2, description="Seeds previewed per prompt (K).")
    preview_steps: int = Field(4, ge=1, description="Euler (ODE) steps of a preview.")
    keep_best: int = Field(2, ge=0, description="Best previews regenerated per prompt.")
    keep_worst: int = Field(2, ge=0, description="Worst previews regenerated per prompt.")
    selection: Literal["extremes", "random", "extremes_random"] = Field(
        "extremes", description="Selection rule."
    )
    extra_random: int = Field(0, ge=0, description="Middle seeds added by extremes_random.")


class AWMSettings(Config):
    """Advantage Weighted Matching (``trainer.objective: awm``; Xue et al., arXiv 2509.25050). Defaults: the
    paper's released SD3.5 recipes (GenEval, OCR)."""

    timesteps: int = Field(
        6,
        ge=1,
        description="Regression points (noise levels) per image: one sampler step drawn in each of this many equal "
        "strata of the step range below (AWM: 6).",
    )
    timestep_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="The strata cover sampler steps 1 .. floor(fraction * sampling.num_steps) - 1, at those steps' "
        "sigmas: the pure-noise first step and the last, nearly clean steps are never regressed (AWM: 0.9).",
    )
    time_type: TimeType = Field(
        "discrete_wo_init",
        description="Where the strata start (AWM's time_type): discrete_wo_init from step 1, never the pure-noise "
        "step 0 (AWM's GenEval and OCR configs); discrete from step 0 (its PickScore configs); discrete_with_init "
        "step 0 plus timesteps - 1 strata from step 1.",
    )
    weighting: Literal["uniform", "sigma", "sigma_squared", "huber", "ghuber"] = Field(
        "ghuber",
        description="Weighting w(l, s) of a point's matching error l at noise level s, log p = -w: uniform l (the "
        "pretraining loss), sigma s l, sigma_squared s^2 l, huber s sqrt(l), ghuber s l^p / p (AWM: ghuber; "
        "mmrl.core.losses.awm_log_likelihood).",
    )
    ghuber_power: float = Field(
        0.25, gt=0, description="p of the ghuber weighting: p < 1 damps points with large errors (AWM: 0.25)."
    )
    advantage_max: float = Field(
        1.0,
        gt=0,
        description="Advantages clipped to +-trainer.adv_clip_max are rescaled to +-advantage_max (AWM: 1 with "
        "clip 5, i.e. A / 5).",
    )
    clip_range: float = Field(
        1.0,
        gt=0,
        description="PPO clip of the ratio exp(log p - log p_old) of the weighted matching log-likelihoods (AWM: "
        "1). With one optimizer step per rollout batch and no trainer.old_policy_decay the ratio is exactly 1.",
    )
    old_kl_beta: float = Field(
        1.0,
        ge=0,
        description="Weight of mean((v - v_old)^2), the squared velocity distance to the sampling policy at each "
        "point (AWM's EMA KL, weight 1). It acts where the sampling policy differs from the trained weights: "
        "under trainer.old_policy_decay (an EMA of the weights samples) or several optimizer steps per batch "
        "(trainer.updates_per_step, trainer.gradient_accumulation). AWM's code keeps its EMA apart from the "
        "sampler, decay min(0.3, 0.001 step).",
    )


class GuidanceDistillSettings(Config):
    """Guidance distillation added to the likelihood-free objectives (nft, awm, rwr): at each regression point the
    trained CFG-free velocity is also pulled toward the frozen base's CFG velocity,
    ``weight * mean((v_theta - v_ref_w)^2)`` with ``v_ref_w = v_ref_uncond + w (v_ref_cond - v_ref_uncond)``
    (mmrl.core.losses.guidance_distillation_loss). It teaches the policy what guidance adds, on its own samples,
    without a reward; costs two reference forwards per point."""

    weight: float = Field(
        0.0,
        ge=0,
        description="Weight of the distillation term (0: off). Full fine-tuning then keeps a frozen copy of the "
        "start weights as the teacher; with LoRA the teacher is the base (adapter off).",
    )
    guidance_scale: float = Field(
        3.0,
        ge=1.0,
        description="CFG scale w of the teacher's velocity (the scale whose samples the policy should match; "
        "the shapes base scores 0.56 held-out strict at 3 against 0.36 CFG-free).",
    )
    schedule: LRSchedule = Field(
        "constant",
        description="How the weight changes over training, the learning rate's schedules (mmrl.schedule): "
        "constant: weight until step `steps`, then 0 (off); cosine: from weight down to 0 at step `steps`, 0 "
        "after. Once the weight is 0 the teacher's forwards are skipped.",
    )
    steps: int | None = Field(
        None,
        ge=1,
        description="Step at which the distillation ends (null: trainer.steps, i.e. a constant weight never "
        "ends and a cosine ends with the run). Ending it early leaves the reward alone in charge; on the shapes "
        "demo that lowered the held-out score (BENCHMARKS.md, 'Toward 0.80').",
    )
    refresh_every: int | None = Field(
        None,
        ge=1,
        description="The reward-improved policy as its own teacher: every this many training steps the teacher "
        "becomes a copy of the weights evaluated at that step (the EMA of the trained weights under "
        "trainer.ema_decay, else the trained weights), guided at guidance_scale. null: the frozen start weights "
        "throughout. Full fine-tuning only (model.lora=null); trainer.beta's reference stays the start weights. "
        "The policy already carries the guidance it was taught, so each refresh guides it again: on the shapes "
        "demo, every 50 steps at scale 3 compounded into a collapse.",
    )

    def weight_at(self, step: int, trainer_steps: int) -> float:
        """The distillation weight at training step ``step`` (0-based) of a run of ``trainer_steps`` steps:
        ``learning_rate(step, weight, S, schedule)`` for ``step < S``, 0 from ``S = steps or trainer_steps`` on.
        """
        horizon = self.steps if self.steps is not None else trainer_steps
        if step >= horizon:
            return 0.0
        return learning_rate(step, self.weight, horizon, schedule=self.schedule)


class FlowTrainerConfig(Config):
    objective: str = Field(
        "grpo",
        description="A registered flow objective (mmrl/flow/objectives/): grpo: clipped ratio on SDE log-probs; "
        "nft: DiffusionNFT (likelihood-free); rwr: advantage-weighted flow matching on the preferred samples "
        "(RAFT-style, likelihood-free); awm: Advantage Weighted Matching, the flow-matching loss weighted by every "
        "sample's advantage (likelihood-free; settings in trainer.awm).",
    )
    steps: int = Field(100, ge=1, description="Training steps (one rollout batch each).")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate.")
    lr_schedule: LRSchedule = Field(
        "constant",
        description="cosine: decay from lr to 0 over trainer.steps (late steps then add little drift).",
    )
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    optimizer: OptimizerName = Field(
        "adamw",
        description="adamw8bit: bitsandbytes 8-bit AdamW. adamw_kahan: AdamW with Kahan-compensated updates for "
        "pure bfloat16 training (model.master_weight_dtype: bfloat16), 12 bytes per trained value against 16 "
        "with float32 master weights (mmrl.optim).",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    advantage: str | None = Field(
        None,
        description="Advantage estimator, a name of mmrl.core.estimators.list_estimators(): grpo, dr_grpo, "
        "rloo, global_std, mc_grpo (odd group sizes), single (store baseline), gdpo, or one you registered; "
        "null: grpo, or gdpo where trainer.multi_reward=gdpo and there are several rewards.",
    )
    advantage_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the estimator (e.g. single: {center: true})."
    )
    multi_reward: Literal["weighted_sum", "gdpo"] = Field(
        "weighted_sum", description="How several rewards combine: weighted sum then GRPO, or GDPO."
    )
    adv_clip_max: float = Field(5.0, gt=0, description="Advantages are clipped to [-x, x] (Flow-GRPO: 5).")
    epsilon_low: float = Field(
        1e-4,
        ge=0,
        lt=1,
        description="Lower clip of the ratio: Flow-GRPO's clip_range (1e-4; DanceGRPO 1e-4); below 1, so that the "
        "lower bound 1 - epsilon_low is positive. Applies to the log-probs of sampling.log_prob_form, Flow-GRPO's "
        "form for each sde_kind by default.",
    )
    epsilon_high: float | None = Field(None, ge=0, description="Upper clip (default epsilon_low).")
    beta: float = Field(
        0.004,
        ge=0,
        description="KL coefficient to the reference: on SDE means (grpo, in the form kl_form names; "
        "Flow-GRPO: 0.04 for SD3.5-M GenEval/OCR, 0.01 PickScore; 0.004 Wan2.1 in the exact form), on the "
        "velocity at the regressed points (nft, rwr, awm; AWM: 0.001 GenEval, 0.003 OCR, 1e-4 PickScore). "
        "DiffusionNFT multiplies its policy loss by adv_clip_max / nft_beta (5 at its defaults) and mmrl's nft "
        "does not: its train.beta times nft_beta / adv_clip_max is the same KL here (1e-4 there: 2e-5 here), and "
        "its max_grad_norm likewise.",
    )
    kl_form: Literal["flow_grpo", "exact"] = Field(
        "flow_grpo",
        description="grpo's KL on SDE means, mean((mu - mu_ref)^2) / (2 s^2). flow_grpo (default, Flow-GRPO's "
        "code, so its beta carries over): s = sigma_t, the SDE noise scale (a sqrt(sigma / (1 - sigma)); eta for "
        "dance), a KL per unit time. exact: s = the step's std, sigma_t sqrt|dt|, the Gaussian KL of the "
        "transition, i.e. flow_grpo / |dt| (3.7-25x stronger on a 10-step shift-3 schedule): a beta tuned with "
        "exact keeps its effect under flow_grpo divided by |dt|. For cps both forms divide by the step's std.",
    )
    timestep_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of a step's SDE steps whose transitions are trained: int(timestep_fraction * SDE "
        "steps), at least one, as Flow-GRPO and DanceGRPO round it (0.99 of 10 steps trains 9).",
    )
    timestep_selection: Literal["random", "first", "per_sample"] = Field(
        "random",
        description="Which SDE steps timestep_fraction keeps: random (a fresh draw each training step, the same "
        "steps for every sample), first (Flow-GRPO: the first ones, so 0.99 never trains the last step) or "
        "per_sample (DanceGRPO: every sample draws its own steps).",
    )
    timestep_skip_last: bool = Field(
        False,
        description="Never train the last SDE step; timestep_fraction counts the others (0.6 of 12 steps trains 6 "
        "of the first 11). DanceGRPO's scripts pass --ignore_last, which its training code never reads: it draws "
        "from all steps, as the default here.",
    )
    train_cfg: bool = Field(
        True,
        description="Log-probs (grpo) or the regressed velocity (nft, awm, rwr) with CFG as sampled (true), or "
        "CFG-free (false, one forward per transition).",
    )
    minibatch_size: int = Field(32, ge=1, description="Transitions per forward/backward.")
    gradient_accumulation: int = Field(
        0,
        ge=0,
        description="Minibatches per optimizer step (0: trainer.updates_per_step optimizer steps per pass over the "
        "rollout batch).",
    )
    updates_per_step: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over a training step's rollouts: its minibatches in this many "
        "consecutive parts (the last may be shorter), each followed by its own optimizer step, so the later "
        "parts train off-policy against the sampler's log-probs, clipped (Flow-Factory's "
        "gradient_step_per_epoch, 2 in its examples; the VLM trainer's option of the same name). Set this or "
        "trainer.gradient_accumulation, which fixes the minibatches per step instead.",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    drop_zero_advantage: bool = Field(True, description="Skip samples whose advantage is exactly 0.")
    nft_beta: float = Field(1.0, gt=0, description="DiffusionNFT implicit-policy strength.")
    nft_timesteps: int = Field(
        2, ge=1, description="Noise levels sampled per image by the likelihood-free objectives (nft, rwr)."
    )
    shared_regression_noise: bool = Field(
        True,
        description="nft/awm/rwr: the images of one prompt share each regression point's sigma and noise, so the "
        "noise, common to the group, cancels in the advantage-weighted gradient (common random numbers).",
    )
    old_policy_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Soft-updated sampling policy (DiffusionNFT): rollouts and v_old come from "
        "an EMA of the trained weights with this decay (null: the current weights, fully on-policy); with "
        "old_policy_decay_rate it is the cap of DiffusionNFT's ramp.",
    )
    old_policy_decay_rate: float | None = Field(
        None,
        gt=0,
        description="DiffusionNFT's decay ramp: after training step n the old policy's decay is "
        "min(rate * max(0, n - old_policy_decay_flat_steps), old_policy_decay), so it starts as a copy of the "
        "trained weights (its default 0.001 up to 0.5; its OCR recipe 0.0075 after 75 steps up to 0.999, "
        "counted in its optimizer steps). null: old_policy_decay from the first step.",
    )
    old_policy_decay_flat_steps: int = Field(
        0, ge=0, description="Training steps before DiffusionNFT's decay ramp starts (decay 0 until then)."
    )
    nft_adaptive_weight: bool = Field(
        False,
        description="nft: divide each sample's x0-space error by its (detached) mean absolute value.",
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="EMA of the trained weights, ema <- d ema + (1 - d) theta after every trainer.ema_every-th "
        "training step's update, with d = min(ema_decay, (1 + n) / (10 + n)) at training step n (a warm-up, "
        "Flow-Factory's power schedule: the first averages follow the trained weights instead of staying at the "
        "start). Evaluation and the checkpoints' diffusers weights "
        "(transformer folder, LoRA adapter) are the EMA; state.pt keeps the live weights for resuming. It "
        "averages over about ema_every / (1 - d) training steps, so pick it from trainer.steps (null: off).",
    )
    ema_every: int = Field(
        1,
        ge=1,
        description="Training steps between EMA updates: the EMA updates after steps n with (n + 1) % ema_every "
        "== 0 (Flow-Factory's ema_update_interval, 4 in its examples; Flow-GRPO's every 8 optimizer steps at 2 "
        "per epoch is 4 too).",
    )
    awm: AWMSettings = Field(
        default_factory=AWMSettings, description="Advantage Weighted Matching settings (objective=awm)."
    )
    guidance_distill: GuidanceDistillSettings = Field(
        default_factory=GuidanceDistillSettings,
        description="Guidance distillation toward the base's CFG velocity (nft, awm, rwr; weight 0: off).",
    )
    eval_every: int = Field(10, ge=1, description="Evaluate on held-out prompts every this many steps.")
    eval_prompts: int = Field(64, ge=1, description="Held-out prompts scored per evaluation.")
    eval_images_per_prompt: int = Field(1, ge=1, description="Images per held-out prompt.")
    sample_every: int = Field(10, ge=1, description="Save an image grid of training samples every N steps.")


class FlowEvalSet(Config):
    """A further held-out set, scored at every evaluation beside ``eval_prompts`` with its own rewards (a second
    skill of the same model, e.g. the shapes verifier's score while training on OCR)."""

    prompts: str = Field(description="Prompt file or world split (shapes:heldout@200, digits:heldout, ...).")
    rewards: list[RewardSpec] = Field(description="Rewards of this set (at least one).")
    num_prompts: int | None = Field(None, ge=1, description="Score the first N prompts (null: all).")

    @model_validator(mode="after")
    def _check(self) -> FlowEvalSet:
        if not self.rewards:
            raise ValueError("extra_eval.*.rewards: give at least one reward")
        check_reward_keys(self.rewards, "extra_eval.*.rewards")
        return self


class FlowGRPOConfig(Config):
    recipe: Literal["flow_grpo"] = Field("flow_grpo", description="Which recipe this config runs.")
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="flow_grpo"))
    model: FlowModelConfig = Field(default_factory=FlowModelConfig)
    train_prompts: str = Field("shapes:train", description="Prompt file or shapes:train.")
    eval_prompts: str = Field("shapes:heldout", description="Prompt file or shapes:heldout.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="shapes")], description="Rewards and their weights."
    )
    eval_rewards: list[RewardSpec] | None = Field(
        None,
        description="Rewards of evaluation and `mmrl eval` (null: the training rewards), e.g. a strict "
        "verifier while training on its partial-credit form.",
    )
    extra_eval: dict[str, FlowEvalSet] = Field(
        default_factory=dict,
        description="Further held-out sets, name -> {prompts, rewards, num_prompts}, generated and scored at each "
        "evaluation and by `mmrl eval`, logged as eval/NAME/{reward}/mean.",
    )
    sampling: FlowSamplingConfig = Field(default_factory=FlowSamplingConfig)
    allocation: AllocationConfig = Field(default_factory=AllocationConfig)
    tree: TreeSettings = Field(
        default_factory=TreeSettings, description="Branching settings (sampling.rollout=branch)."
    )
    explore: ExploreSettings = Field(
        default_factory=ExploreSettings, description="Two-stage explore/train settings."
    )
    trainer: FlowTrainerConfig = Field(default_factory=FlowTrainerConfig)
    pool: PoolSettings = Field(
        default_factory=PoolSettings, description="Rollouts from a rollout pool (sync or async)."
    )

    @property
    def gdpo_applies(self) -> bool:
        """``trainer.multi_reward=gdpo`` replaces the estimator when there are several rewards."""
        return self.trainer.multi_reward == "gdpo" and len(self.rewards) > 1

    @property
    def allocates_groups(self) -> bool:
        """Whether the allocator sizes each prompt's group: flat rollouts only (trees and the explorer size their
        own, one tree or one preview set per prompt)."""
        return self.sampling.rollout == "flat" and not self.explore.enabled

    @property
    def estimator_name(self) -> str:
        """The advantage estimator the trainer uses: GDPO for several rewards with ``trainer.multi_reward=gdpo``,
        else ``trainer.advantage``, grpo by default."""
        return "gdpo" if self.gdpo_applies else self.trainer.advantage or "grpo"

    @model_validator(mode="after")
    def _check(self) -> FlowGRPOConfig:
        self._check_rewards()
        self._check_updates()
        self._check_estimator_and_budget()
        self._check_window()
        self._check_noise_level()
        self._check_rollout_modes()
        self._check_objective()
        return self

    def _check_rewards(self) -> None:
        """At least one training reward, distinct keys, and a family that decodes what each reward scores."""
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        if self.eval_rewards is not None and not self.eval_rewards:
            raise ValueError(
                "eval_rewards: give at least one reward, or null to evaluate with the training rewards"
            )
        check_reward_keys(self.rewards, "rewards")
        check_reward_keys(self.eval_rewards or [], "eval_rewards")
        self._check_family_and_reward_inputs()

    def _check_updates(self) -> None:
        """The optimizer suits the master weights; one setting decides the optimizer steps per training step;
        the old policy's decay ramp has a decay to ramp to."""
        t = self.trainer
        check_optimizer_dtype(t.optimizer, self.model.master_weight_dtype)
        if t.gradient_accumulation and t.updates_per_step > 1:
            raise ValueError(
                f"trainer.updates_per_step ({t.updates_per_step}) and trainer.gradient_accumulation "
                f"({t.gradient_accumulation}) both set how many optimizer steps a training step takes: set one"
            )
        if t.old_policy_decay is None and t.old_policy_decay_rate is not None:
            raise ValueError(
                "trainer.old_policy_decay_rate ramps the old policy's decay up to trainer.old_policy_decay, which "
                "is null (no old policy): set trainer.old_policy_decay (DiffusionNFT: 0.5) or drop the rate"
            )

    def _check_estimator_and_budget(self) -> None:
        """The advantage estimator and its options, and a step's image budget that holds its groups."""
        t = self.trainer
        if self.gdpo_applies:
            check_gdpo_estimator(t.advantage, len(self.rewards))
        estimator = check_estimator(self.estimator_name, t.advantage_options)
        flat = self.allocates_groups
        if flat and self.allocation.rollouts_per_step is None:
            raise ValueError(
                "allocation.rollouts_per_step: flat flow rollouts need a budget of images per step (null "
                "derives one from trainer.num_generations in the VLM recipe only)"
            )
        check_group_sizes(estimator, self.allocation, self.allocation.rollouts_per_step if flat else None)

    def _check_rollout_modes(self) -> None:
        """Branching trees, the quantized explorer and the rollout pool: their settings, and the ones they
        exclude."""
        t = self.trainer
        w = self.sampling.sde_window
        if self.sampling.rollout == "branch" and t.timestep_selection == "per_sample":
            raise ValueError(
                "trainer.timestep_selection=per_sample draws steps per sample; sampling.rollout=branch trains a "
                "tree's shared transitions: use random or first"
            )
        if self.sampling.rollout == "branch":
            span = w if w is not None else self.sampling.num_steps
            bad = [s for s in self.tree.split_steps if not 0 <= s < span]
            if not self.tree.split_steps or bad:
                raise ValueError(
                    f"tree.split_steps must be non-empty and inside 0..{span - 1} (the SDE steps), got {bad}"
                )
            twice = sorted({step for step in self.tree.split_steps if self.tree.split_steps.count(step) > 1})
            if twice:
                raise ValueError(f"tree.split_steps lists {twice} more than once")
            factors = self.tree.branch_factor
            try:
                TreeConfig(
                    tuple(self.tree.split_steps), factors if isinstance(factors, int) else tuple(factors)
                ).factors()
            except ValueError as err:
                raise ValueError(f"tree.branch_factor: {err}") from None
        if self.explore.enabled:
            e = self.explore
            keep = e.keep_best + e.keep_worst + (e.extra_random if e.selection == "extremes_random" else 0)
            if not 1 <= keep <= e.candidates:
                raise ValueError(
                    f"explore keeps {keep} of {e.candidates} candidates per prompt; need 1..candidates"
                )
            if self.allocation.method != "uniform":
                raise ValueError(
                    "explore decides the group sizes (kept seeds per prompt): use allocation.method=uniform"
                )
        if self.pool.enabled and (self.sampling.rollout != "flat" or self.explore.enabled):
            raise ValueError(
                "pool.enabled takes flat rollouts from the pool: set sampling.rollout=flat and explore.enabled=false "
                f"(got sampling.rollout={self.sampling.rollout}, explore.enabled={self.explore.enabled})"
            )

    def _check_objective(self) -> None:
        """The objective's own settings, and guidance distillation where the objective and sampling allow it."""
        objective = check_objective(self.trainer.objective)
        if objective.check_config is not None:
            objective.check_config(self)
        distill = self.trainer.guidance_distill
        if distill.weight > 0 and objective.trains_on != "final_samples":
            raise ValueError(
                "trainer.guidance_distill.weight applies to the objectives that regress on the final samples "
                f"({', '.join(list_objectives('final_samples'))}), not {objective.name}: set trainer.objective or "
                "the weight to 0"
            )
        if distill.weight > 0 and self.trainer.train_cfg and self.sampling.guidance_scale > 1:
            raise ValueError(
                "trainer.guidance_distill teaches the CFG-free velocity the base's guidance, but with "
                f"sampling.guidance_scale {self.sampling.guidance_scale} and trainer.train_cfg the regressed "
                "velocity is the guided one (guidance applied twice): sample at sampling.guidance_scale 1, "
                "or set the distillation weight to 0"
            )
        if distill.refresh_every is not None and (distill.weight == 0 or self.model.lora is not None):
            raise ValueError(
                f"trainer.guidance_distill.refresh_every ({distill.refresh_every}) refreshes the teacher of a "
                "full fine-tune: it needs trainer.guidance_distill.weight > 0 and model.lora=null (got weight "
                f"{distill.weight}, model.lora {'set' if self.model.lora is not None else 'null'})"
            )

    def _check_family_and_reward_inputs(self) -> None:
        """``model.family`` is registered, and each reward scores what the family decodes (images, or videos for
        a video family), so a video reward on an image model is refused here, not at the first step."""
        from pipelines.flow.adapters import get_adapter

        try:
            adapter = get_adapter(self.model.family)
        except KeyError as err:
            raise ValueError(f"model.family: {err.args[0]}") from None
        given = ("videos", "prompts") if adapter.is_video else ("images", "prompts")
        recipe = f"flow_grpo (model.family {self.model.family!r}: {given[0]})"
        check_reward_inputs(self.rewards, given, recipe, "rewards")
        check_reward_inputs(self.eval_rewards or [], given, recipe, "eval_rewards")
        for name, extra in self.extra_eval.items():
            check_reward_inputs(extra.rewards, given, recipe, f"extra_eval.{name}.rewards")

    def _check_noise_level(self) -> None:
        """CPS's noise level ``a`` lies in (0, 1] (Flow-GRPO's range): its std ``s' sin(a pi / 2)`` falls back to 0
        at ``a = 2`` and turns negative after it, where the flow_grpo and dance kinds take any ``a > 0``."""
        s = self.sampling
        try:
            check_noise_level(s.noise_level, s.sde_kind)  # the SDE's own rule, here naming the keys
        except ValueError as error:
            raise ValueError(
                f"sampling.noise_level ({s.noise_level}) must be at most 1 with sampling.sde_kind cps: its std "
                "s' sin(a pi / 2) peaks at a = 1 and is 0 at a = 2 (Flow-GRPO's CPS range is (0, 1])"
            ) from error

    def _check_window(self) -> None:
        """The SDE window fits the steps it may cover (:meth:`FlowSamplingConfig.window_bounds`), whatever the
        objective: every rollout samples its window, and one that cannot be placed failed at the first step."""
        s = self.sampling
        w = s.sde_window
        if w is not None and w > s.num_steps:
            raise ValueError(f"sampling.sde_window ({w}) exceeds sampling.num_steps ({s.num_steps})")
        if s.sde_window_range is not None:
            first, end = s.sde_window_range
            if w is None:
                raise ValueError("sampling.sde_window_range places a window: set sampling.sde_window too")
            usable_first, usable_end = s.window_bounds()
            if not 0 <= first < end <= s.num_steps or usable_end - usable_first < w:
                raise ValueError(
                    f"sampling.sde_window_range {[first, end]} must satisfy 0 <= first < end <= sampling.num_steps "
                    f"({s.num_steps}) and hold the sampling.sde_window of {w} steps (with sde_kind cps, before "
                    "the last step)"
                )
        if s.sde_kind == "cps" and (w is None or w >= s.num_steps):
            raise ValueError(
                "sde_kind=cps adds no noise at the last step: set sampling.sde_window < sampling.num_steps "
                f"(got {w}, num_steps {s.num_steps})"
            )
