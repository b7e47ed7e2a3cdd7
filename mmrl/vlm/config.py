"""Config of the VLM RLVR recipe (``recipe: vlm_rlvr``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import PositiveInt, field_validator, model_validator

from mmrl.config import Config, Field, RunConfig
from mmrl.core.estimators import check_estimator, get_estimator
from mmrl.data.vqa import format_question, hub_source
from mmrl.device import DeviceName
from mmrl.optim import OptimizerName, check_optimizer_dtype
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
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.families import VLMFamily, family_for_model_type, get_vlm_family, list_vlm_families

__all__ = ["REWARD_FIELDS", "VLMAllocation", "VLMPoolSettings", "VLMRLVRConfig"]

#: the batch fields the VLM trainer gives every verifier (VLMRLVRTrainer._reward_batch)
REWARD_FIELDS = ("completions", "ground_truths", "references")

logger = logging.getLogger(__name__)


class VLMLora(LoraSettings):
    rank: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale alpha / r).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Language-model modules that get adapters (the vision tower's are added when it is trained).",
    )


class VLMModelConfig(Config):
    path: str = Field(
        "checkpoints/shapes_vlm", description="Hub id or local directory (AutoModelForImageTextToText)."
    )
    family: str | None = Field(
        None,
        description="Registered VLM family (pipelines.vlm.families.list_vlm_families(): qwen2_5_vl, qwen3_vl, "
        "gemma3): its prompt layout, vision tokens and tower. null: the family serving the checkpoint's "
        "model_type.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights dtype (bfloat16 on GPUs): the frozen weights, the KL reference and what the model "
        "computes in; the trained parameters are kept in model.master_weight_dtype.",
    )
    master_weight_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype of the trained parameters (the LoRA factors, or the language model's weights in full "
        "fine-tuning), their gradients and AdamW states; float32 as verl's and EasyR1's FSDP actors and peft's "
        "LoRA: in bfloat16 an AdamW step below 2^-9 of a weight rounds away. The model then computes in "
        "model.dtype under torch.autocast. bfloat16: pure bfloat16 training in half the memory.",
    )
    device: DeviceName = Field(
        "auto", description="'auto' (cuda when available, else cpu), 'cpu', 'cuda', ..."
    )
    lora: VLMLora | None = Field(
        default_factory=VLMLora, description="LoRA settings; null: full fine-tuning."
    )
    train_vision: bool = Field(False, description="Also train the vision tower (frozen by default).")
    gradient_checkpointing: bool = Field(False, description="Activation checkpointing in the language model.")
    load_in_4bit: bool = Field(
        False, description="QLoRA: NF4 base weights through transformers' BitsAndBytesConfig."
    )

    def compute_dtype(self) -> str | None:
        """What the policy computes in under ``torch.autocast`` (None: no autocast): ``dtype`` when the trained
        parameters are kept in a wider dtype (``master_weight_dtype``)."""
        if self.dtype != "float32" and self.master_weight_dtype != self.dtype:
            return self.dtype
        return None

    @field_validator("family")
    @classmethod
    def _registered_family(cls, family: str | None) -> str | None:
        if family is not None and family not in list_vlm_families():
            raise ValueError(f"model.family={family!r} is not registered. Available: {list_vlm_families()}")
        return family

    def resolve_family(self) -> VLMFamily:
        """The model family's conventions: ``family``, or the family serving the checkpoint's ``model_type`` (read
        from its config; a published id's config is embedded, so nothing is downloaded).

        Raises:
            OSError: ``path`` is neither a local model folder nor a Hub repository whose config can be read.
        """
        from pipelines.vlm.published import model_config  # (transformers' config classes: loaded on demand)

        if self.family:
            return get_vlm_family(self.family)
        return family_for_model_type(model_config(self.path).model_type)


class VLMDataConfig(Config):
    train: str = Field("shapes:train", description="shapes:train, a json/jsonl/parquet file, or a hub id.")
    eval: str = Field("shapes:heldout", description="Held-out questions, same forms.")
    train_limit: int | None = Field(2000, ge=1, description="Train examples kept (shapes: generated).")
    train_mix: dict[str, PositiveInt] = Field(
        default_factory=dict,
        description="Further training sources, source -> examples kept (same forms as train), added to data.train's "
        "examples; prompts are drawn from all of them alike, so each source's share is its count's (e.g. "
        "shapes_count:train: 2000 beside 4000 shapes_math questions: a third one-step count questions).",
    )
    eval_limit: int | None = Field(200, ge=1, description="Eval examples kept.")
    split: str = Field(
        "train",
        description="Split of a hub dataset named without one; 'org/name@test' names its own (EasyR1's form).",
    )
    question_column: str = Field("question", description="Column of the question text.")
    answer_column: str = Field("answer", description="Column of the ground truth the verifiers check.")
    image_column: str | None = Field(
        "image",
        description="Column of each question's image(s): a path, a list of paths, a datasets.Image or bytes; "
        "null: text-only questions.",
    )
    id_column: str | None = Field(
        None, description="Column of the question ids the statistics store keys on; null: the row index."
    )
    reference_column: str | None = Field(
        None,
        description="Column of reference solutions (worked steps), which the reasoning_steps reward compares a "
        "completion's <think> steps against; generated shapes_math items carry theirs.",
    )
    image_root: str | None = Field(
        None,
        description="Folder that relative image paths are resolved against; null: the data file's folder.",
    )
    question_template: str = Field("{question}", description="Formats the question text.")
    system_prompt: str | None = Field(None, description="Optional system message.")
    image_size: int = Field(
        32,
        ge=24,
        description="Side of generated shapes images (at least 24: four objects fit with clear gaps).",
    )
    min_pixels: int | None = Field(
        None,
        ge=1,
        description="Images with fewer pixels are scaled up to about this many, aspect ratio kept, before the "
        "processor (EasyR1's data.min_pixels, 262144 in its examples). null: as loaded.",
    )
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="Images with more pixels are scaled down to about this many, aspect ratio kept, before the "
        "processor (EasyR1's data.max_pixels, 4194304 in its examples): fewer visual tokens for large images. "
        "null: as loaded (the processor's own limits apply).",
    )
    extra_eval: dict[str, str] = Field(
        default_factory=dict,
        description="Further held-out sets, name -> source (same forms as eval, eval_limit items each), scored "
        "beside data.eval and logged as eval/NAME/... (e.g. templates: shapes_math:heldout_templates).",
    )


class VLMRewardSpec(RewardSpec):
    name: str = Field(
        description="Registered text verifier (exact_match, math_verify, multiple_choice, ...)."
    )


class GenerationConfig(Config):
    backend: Literal["hf", "vllm"] = Field("hf", description="hf: transformers generate; vllm: GPU engine.")
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of rollouts (> 0: the policy gradient needs samples of the policy; a "
        "greedy rollout is not one, and a group of greedy rollouts is one answer repeated). Held-out answers: "
        "eval_temperature, greedy at 0.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (1: full distribution, on-policy).")
    eval_temperature: float = Field(
        0.0,
        ge=0,
        description="Temperature of the held-out answers, one per question: 0 (default) greedy; EasyR1 and verl "
        "validate by sampling (EasyR1: 0.6 with eval_top_p 0.95), which scores lower than greedy and varies.",
    )
    eval_top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass of sampled held-out answers.")
    max_new_tokens: int = Field(16, ge=1, description="Completion budget.")
    max_prompt_length: int | None = Field(
        None, ge=1, description="Longer prompts are skipped, never truncated."
    )
    max_model_len: int | None = Field(None, ge=1, description="Context length of prompt + completion.")
    batch_size: int | None = Field(None, ge=1, description="Prompts per generate call (hf).")
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="vLLM memory share while awake.")
    vllm_fp8: bool = Field(False, description="FP8 rollouts in vLLM (corrected by TIS).")
    vllm_max_images_per_prompt: int = Field(
        1,
        ge=1,
        description="Most images one prompt may carry in vLLM (its limit_mm_per_prompt; the engine reserves "
        "memory for that many). Raise it for multi-image data; the hf backend has no such limit.",
    )

    def sampling(
        self, temperature: float, top_p: float, n: int = 1, seed: int | None = None
    ) -> SamplingParams:
        """Sampling parameters of a generate call (greedy at temperature 0, where a nucleus means nothing)."""
        return SamplingParams(
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            max_new_tokens=self.max_new_tokens,
            n=n,
            seed=seed,
        )

    def vllm_engine_options(self) -> dict[str, Any]:
        """The ``VLLMBackend`` arguments these settings fix, for the trainer's engine and a pool member's."""
        return dict(
            max_model_len=self.max_model_len or 4096,
            max_prompt_length=self.max_prompt_length,
            gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            max_images_per_prompt=self.vllm_max_images_per_prompt,
            quantization="fp8" if self.vllm_fp8 else None,
        )

    def hf_backend_options(self) -> dict[str, Any]:
        """The ``HFBackend`` arguments these settings fix, for the trainer's backend and a pool member's."""
        return dict(
            max_model_len=self.max_model_len,
            max_prompt_length=self.max_prompt_length,
            batch_size=self.batch_size,
        )


class EntropyShaping(Config):
    enabled: bool = Field(True, description="A_t + min(alpha H_t, |A_t|/kappa) (Cheng et al. 2506.14758).")
    alpha: float = Field(0.4, ge=0, description="Entropy coefficient (paper: 0.4).")
    kappa: float = Field(2.0, gt=1, description="Bonus cap ratio; > 1 keeps the sign (paper: 2).")
    kind: Literal["full", "sampled"] = Field(
        "full", description="full-vocabulary entropy, or the sampled token's -p log p (MSSR's code)."
    )


class ProcessCredit(Config):
    reward: str | None = Field(
        None,
        description="Key (label or name) of a reward in `rewards` that scores each step a completion states "
        "(reasoning_steps); null: off. Its step scores, normalised over the batch's steps (single) or a group's "
        "steps (group), become token advantages added to the sequence advantage (DeepSeekMath's process "
        "supervision, mmrl.core.advantages.process_supervised).",
    )
    weight: float = Field(
        1.0, gt=0, description="Scale of the step advantages added to the sequence advantage."
    )
    credit: Literal["return", "step"] = Field(
        "return",
        description="return: a token gets the sum of the normalised scores of the steps ending at or after it "
        "(DeepSeekMath); step: the tokens of a step get that step's score only.",
    )
    normalize: Literal["all", "position"] = Field(
        "all",
        description="all: a step's score is normalised among every step of the batch (single) or group (group), "
        "as DeepSeekMath; position: among the steps written at the same position (the k-th of each completion).",
    )
    single_groups: Literal["batch", "kind"] = Field(
        "batch",
        description="Which steps a single-rollout step is normalised among: batch: the batch's; kind: those of "
        "completions of questions of the same kind (a dataset's kind column, the shapes_math template), the "
        "nearest a single rollout has to group's comparison within one question.",
    )


class VLMTrainerConfig(Config):
    mode: Literal["single", "group"] = Field(
        "single", description="single: MSSR/SPO one rollout; group: GRPO family."
    )
    steps: int = Field(100, ge=1, description="Training steps.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="cosine: decay from lr to 0 over trainer.steps (late steps then add little drift).",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW's decoupled weight decay (verl / EasyR1: 1e-2)."
    )
    optimizer: OptimizerName = Field(
        "adamw",
        description="adamw8bit: bitsandbytes 8-bit AdamW. adamw_kahan: AdamW with Kahan-compensated updates for "
        "pure bfloat16 training (model.master_weight_dtype: bfloat16; EasyR1's adamw_bf16 with a float32 second "
        "moment), 12 bytes per trained value against 16 with float32 master weights (mmrl.optim).",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global norm.")
    advantage: str | None = Field(
        None,
        description="Advantage estimator (mmrl.core.estimators.list_estimators()); null: single in single "
        "mode, grpo in group mode. Group mode: grpo, dr_grpo, rloo, global_std, mc_grpo (G+1 rollouts), ...",
    )
    advantage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the estimator, e.g. single: {center: true} centres the advantages on "
        "the batch mean (off in MSSR: it can turn a correct answer negative), {scale: none} leaves them undivided "
        "by the batch std; grpo: {center: median}.",
    )
    # group mode
    num_generations: int = Field(
        8, ge=2, description="Rollouts per prompt in group mode (G; MC-GRPO uses G+1)."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose rewards are all equal (whole groups; every sample of a group "
        "whose rewards vary stays, even one with zero advantage). DAPO also regenerates to refill the batch: "
        "trainer.dynamic_sampling_rounds.",
    )
    dynamic_sampling_rounds: int = Field(
        1,
        ge=1,
        description="With dynamic_sampling, generation rounds of allocation.prompts_per_step prompts a step may "
        "take until that many groups whose rewards vary are kept (DAPO's refill; verl's max_num_gen_batches); "
        "the kept groups beyond it are dropped. 1: one round, the step trains on the varied groups it got.",
    )
    dynamic_sampling_key: str | None = Field(
        None,
        description="With dynamic_sampling, the reward (its key: label or name) whose scores decide which groups "
        "stay (EasyR1's filter_key, e.g. accuracy: a group whose answers are all right stays out even when its "
        "format scores vary); null: the weighted sum of the rewards (EasyR1's overall; under GDPO, without a "
        "band, a group stays when any one reward varies).",
    )
    dynamic_sampling_band: tuple[float, float] | None = Field(
        None,
        description="With dynamic_sampling, EasyR1's online filtering: keep the groups whose mean score lies "
        "strictly between the two values (its filter_low / filter_high, [0.01, 0.99] in its DAPO launches); "
        "null: DAPO's rule, keep the groups whose scores vary. The same groups for 0/1 scores.",
    )
    multi_reward: Literal["weighted_sum", "gdpo"] = Field(
        "weighted_sum",
        description="Group mode with several rewards (e.g. format + answer): the weighted sum then the "
        "estimator, or GDPO (each reward normalised in its group, then weighted and whitened; mmrl.core.advantages"
        ".decoupled_multi_reward), which is then the estimator: leave trainer.advantage null. Single mode always "
        "uses the weighted sum (its baseline is one success rate).",
    )
    # shared
    entropy_shaping: EntropyShaping = Field(default_factory=EntropyShaping)
    process_credit: ProcessCredit = Field(default_factory=ProcessCredit)
    epsilon_low: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Lower clip range: TRL's epsilon, verl's clip_ratio_low (PPO/GRPO: 0.2); below 1, so that the "
        "lower bound 1 - epsilon_low of the ratio is positive (at 1 or above no ratio is ever clipped low).",
    )
    epsilon_high: float = Field(
        0.28,
        ge=0,
        description="Upper clip range: TRL's and verl's epsilon_high / clip_ratio_high (DAPO's "
        "clip-higher: 0.28). TRL defaults it to epsilon: set 0.2 here for TRL's default.",
    )
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant (verl's clip_ratio_c, 3.0).")
    policy_loss: Literal["clip", "cispo"] = Field(
        "clip",
        description="clip: PPO's clipped surrogate (epsilon_low, epsilon_high, dual_clip). cispo: MiniMax-M1's "
        "CISPO as ScaleRL and TRL's loss_type=cispo write it: REINFORCE on every token weighted by its detached "
        "importance ratio capped at trainer.cispo_weight_max, so no token leaves the gradient.",
    )
    cispo_weight_max: float = Field(
        5.0, gt=0, description="CISPO's cap on the importance weight (ScaleRL's and TRL's 5.0)."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's own ratio (GRPO). sequence: GSPO, every token of a completion gets its "
        "length-normalised sequence ratio exp(mean_t log(pi / pi_old)), clipped per sequence (GSPO-token form: "
        "token advantages still apply; TRL's name). The GSPO paper: epsilon_low 3e-4, epsilon_high 4e-4, beta 0, "
        "loss_agg seq_mean_token_mean, trainer.updates_per_step 4. The levels differ only off-policy: with "
        "trainer.updates_per_step and trainer.ppo_epochs 1 every ratio is 1 and both give the same gradient.",
    )
    beta: float = Field(
        0.01,
        ge=0,
        description="KL coefficient to the reference (adapter disabled): the k3 estimator per token, "
        "added to the per-token loss before aggregation, as TRL's beta (TRL's default 0.0; DeepSeekMath GRPO 0.04; "
        "verl's kl_loss_coef with kl_loss_type low_var_kl; with trainer.kl_clamp its clamps too).",
    )
    kl_clamp: bool = Field(
        False,
        description="Clamp the k3 estimator as verl's and EasyR1's low_var_kl: ref_logp - logp to [-20, 20] and "
        "the KL to at most 10 (a token the reference finds far likelier adds at most 10 and no gradient). Off: "
        "TRL's plain k3, which grows as exp(ref_logp - logp).",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="Loss aggregation (verl's loss_agg_mode). TRL's loss_type: dapo = token_mean (every "
        "token of the step weighs the same, across minibatches), grpo = seq_mean_token_mean, dr_grpo = "
        "seq_mean_token_sum_norm (normalised by generation.max_new_tokens, TRL's max_completion_length). "
        "TRL's bnpo normalises each micro-batch by its own token count, then divides by the accumulation "
        "steps: it equals token_mean only when every minibatch holds the same number of completion tokens.",
    )
    tis: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Truncated importance sampling vs the rollout engine (auto: on for vllm, or for any backend "
        "when generation.top_p < 1: samples from the truncated nucleus). true / false are read as on / off.",
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="TIS cap C of the weight min(pi_trainer / pi_engine, C); >= 1 so that a token the engine and "
        "the trainer score alike keeps weight 1 (as pool.tis_cap).",
    )
    tis_mode: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's own capped ratio; sequence: one ratio per completion, the product of "
        "its tokens' (capped as a whole).",
    )
    minibatch_size: int = Field(
        16,
        ge=1,
        description="Sequences per forward/backward; an update accumulates its minibatches' gradients.",
    )
    updates_per_step: int = Field(
        1,
        ge=1,
        description="Optimizer steps per training step: the step's samples are split into this many parts, each "
        "trained and followed by its own AdamW step, so the later parts are off-policy (verl's "
        "ppo_mini_batch_size = the step's samples / this; TRL's steps_per_generation / gradient_accumulation_steps; "
        "the GSPO paper: 4). The later parts' old-policy log-probs come from a forward without gradients before "
        "the first update. (The flow trainer's option of the same name.)",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over the step's samples (each part once per pass).")
    logprob_chunk_size: int = Field(128, ge=1, description="Positions per chunk of the head/softmax.")
    eval_every: int = Field(10, ge=1, description="Evaluate on the held-out questions every N steps.")
    sample_every: int = Field(10, ge=1, description="Write example completions every N steps.")

    @field_validator("tis", mode="before")
    @classmethod
    def _tis_from_yaml_boolean(cls, value: Any) -> Any:
        """YAML 1.1 reads an unquoted ``on`` / ``off`` (and ``yes`` / ``no``, ``true`` / ``false``) as a boolean,
        so ``trainer.tis: off`` arrives as False: True -> ``"on"``, False -> ``"off"``."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value


class VLMPoolSettings(PoolSettings):
    """The flow trainer's pool settings, plus APRIL partial rollouts (mmrl/vlm/pooled.py)."""

    enabled: bool = Field(
        False,
        description="Take the rollouts from a rollout pool of VLMRolloutWorkers (pipelines/pool, "
        "mmrl/vlm/pooled.py) instead of generating them in the training loop.",
    )
    overprovision: float = Field(
        0.0,
        ge=0,
        description="APRIL partial rollouts (arXiv 2509.18521): request this fraction more prompts than "
        "a step needs and train once the step's samples are complete; unfinished requests are carried to the next "
        "step, never discarded. 0: off.",
    )
    prompts_per_request: int | None = Field(
        None,
        ge=1,
        description="Prompts per request (the unit a partial rollout resumes by); null: a step's "
        "prompts split into one request per worker.",
    )


class VLMAllocation(AllocationConfig):
    """The shared allocation section with the VLM recipe's defaults: 16 prompts, group sizes from
    ``trainer.num_generations``, forgetting 0.9 (the single-rollout baseline tracks a moving policy)."""

    prompts_per_step: int = Field(16, ge=1, description="Prompts picked per step.")
    rollouts_per_step: int | None = Field(
        None,
        ge=1,
        description="Rollout budget per step in group mode; null: prompts_per_step * trainer.num_generations "
        "(+1 each for mc_grpo). Single mode: one rollout per prompt.",
    )
    rho: float = Field(0.9, gt=0, le=1, description="Forgetting factor of the per-prompt baseline.")
    prior_groups: Literal["none", "kind"] = Field(
        "none",
        description="Centre of each question's shrinkage prior (the single-rollout baseline of a question seen "
        "rarely or never): none = the running mean of every reward; kind = the running mean of the questions of "
        "its kind (the shapes worlds' template), itself shrunk to every reward's mean with prior_strength "
        "(mmrl/core/stats.py). With one rollout per question and few revisits a question's baseline is then what "
        "its kind scores, not the whole population.",
    )


#: keys of the VLM trainer section that moved to the shared allocation section: old -> new name
MOVED_TO_ALLOCATION = {
    "prompts_per_step": "prompts_per_step",
    "selection": "selection",
    "allocation": "method",
    "rho": "rho",
    "prior_strength": "prior_strength",
}


class VLMRLVRConfig(Config):
    recipe: Literal["vlm_rlvr"] = "vlm_rlvr"
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="vlm_rlvr"))
    model: VLMModelConfig = Field(default_factory=VLMModelConfig)
    data: VLMDataConfig = Field(default_factory=VLMDataConfig)
    rewards: list[VLMRewardSpec] = Field(default_factory=lambda: [VLMRewardSpec(name="exact_match")])
    eval_rewards: list[VLMRewardSpec] = Field(
        default_factory=list,
        description="Verifiers scored on the held-out answers only (never trained on), logged as eval/KEY and "
        "eval/KEY_KIND, e.g. a lenient numeric check (label lenient_accuracy) beside a strict training reward.",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    allocation: VLMAllocation = Field(default_factory=VLMAllocation)
    trainer: VLMTrainerConfig = Field(default_factory=VLMTrainerConfig)
    pool: VLMPoolSettings = Field(
        default_factory=VLMPoolSettings, description="Rollouts from a rollout pool."
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """The selection/allocation keys of the trainer section moved to ``allocation:`` (shared with the other
        recipes); old configs still load, with a warning naming the new key."""
        trainer = data.get("trainer") if isinstance(data, dict) else None
        if not isinstance(trainer, dict) or not set(trainer) & {*MOVED_TO_ALLOCATION, "center"}:
            return data
        data = {**data, "trainer": dict(trainer)}
        allocation = dict(data.get("allocation") or {})
        if "center" in data["trainer"]:
            center = data["trainer"].pop("center")
            data["trainer"]["advantage_options"] = {
                **data["trainer"].get("advantage_options", {}),
                "center": center,
            }
            logger.warning("config key trainer.center is deprecated: use trainer.advantage_options.center")
        for old, new in MOVED_TO_ALLOCATION.items():
            if old in data["trainer"]:
                if new in allocation:
                    raise ValueError(
                        f"trainer.{old} and allocation.{new} are both set; keep allocation.{new}"
                    )
                allocation[new] = data["trainer"].pop(old)
                logger.warning("config key trainer.%s is deprecated: use allocation.%s", old, new)
        data["allocation"] = allocation
        return data

    @property
    def _gdpo_applies(self) -> bool:
        """``trainer.multi_reward=gdpo`` replaces the estimator: group mode with several rewards."""
        t = self.trainer
        return t.mode == "group" and t.multi_reward == "gdpo" and len(self.rewards) > 1

    @property
    def estimator_name(self) -> str:
        """The advantage estimator the trainer uses: GDPO for several rewards with ``trainer.multi_reward=gdpo`` (group
        mode), else ``trainer.advantage``, or the mode's default."""
        t = self.trainer
        if self._gdpo_applies:
            return "gdpo"
        if t.advantage is not None:
            return t.advantage
        return "single" if t.mode == "single" else "grpo"

    @property
    def group_size(self) -> int:
        """Rollouts per prompt before allocation: 1 in single mode, ``num_generations`` (+ the estimator's extra,
        MC-GRPO's pivot) in group mode."""
        if self.trainer.mode == "single":
            return 1
        return self.trainer.num_generations + get_estimator(self.estimator_name).extra_per_group

    @property
    def rollouts_per_step(self) -> int:
        """The step's rollout budget: ``allocation.rollouts_per_step`` or ``prompts_per_step * group_size``."""
        a = self.allocation
        return (
            a.rollouts_per_step if a.rollouts_per_step is not None else a.prompts_per_step * self.group_size
        )

    @model_validator(mode="after")
    def _check(self) -> VLMRLVRConfig:
        self._check_rewards()
        check_optimizer_dtype(self.trainer.optimizer, self.model.master_weight_dtype)
        self._check_dynamic_sampling()
        d = self.data
        eval_hub, train_hub = (
            None if ":" in source or Path(source).suffix else hub_source(source, d.split)
            for source in (d.eval, d.train)
        )
        if eval_hub is not None and eval_hub == train_hub:
            raise ValueError(
                f"data.eval: {d.eval!r} reads split {eval_hub[1]!r} of {eval_hub[0]!r}, as data.train does, so "
                f"held-out scores would be training scores; name the held-out split, e.g. "
                f"data.eval={eval_hub[0]}@test"
            )
        if d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
            raise ValueError(f"data.min_pixels ({d.min_pixels}) exceeds data.max_pixels ({d.max_pixels})")
        # a template that cannot be filled fails here, not when the data loads (after the model)
        format_question(self.data.question_template, "question")
        self._check_estimator_and_budget()
        self._check_pool()
        return self

    def _check_rewards(self) -> None:
        """At least one reward, distinct keys, each scorable on what a VLM run gives, and the keys other
        settings name among them."""
        if not self.rewards:
            raise ValueError("rewards: at least one verifier is needed")
        check_reward_keys(self.rewards, "rewards")
        check_reward_keys([*self.rewards, *self.eval_rewards], "rewards + eval_rewards")
        for where, specs in (("rewards", self.rewards), ("eval_rewards", self.eval_rewards)):
            check_reward_inputs(specs, REWARD_FIELDS, "vlm_rlvr", where)
        t = self.trainer
        keys = [spec.key for spec in self.rewards]
        if t.dynamic_sampling_key is not None and t.dynamic_sampling_key not in keys:
            raise ValueError(
                f"trainer.dynamic_sampling_key={t.dynamic_sampling_key!r} is not the key of a reward in "
                f"`rewards` ({keys})"
            )
        if t.process_credit.reward is not None and t.process_credit.reward not in keys:
            raise ValueError(
                f"trainer.process_credit.reward={t.process_credit.reward!r} is not the key of a reward in "
                f"`rewards` ({keys})"
            )

    def _check_dynamic_sampling(self) -> None:
        """DAPO's dynamic sampling settings apply to group mode with it on, and fit the rollout source."""
        t = self.trainer
        if t.dynamic_sampling and t.mode != "group":
            raise ValueError(
                "trainer.dynamic_sampling=true drops the groups whose rewards are all equal; trainer.mode=single "
                "rolls out once per prompt, so there is no group: set trainer.mode=group or "
                "trainer.dynamic_sampling=false"
            )
        if t.dynamic_sampling_rounds > 1 and not (t.mode == "group" and t.dynamic_sampling):
            raise ValueError(
                f"trainer.dynamic_sampling_rounds={t.dynamic_sampling_rounds} refills DAPO's dynamic sampling: set "
                "trainer.mode=group and trainer.dynamic_sampling=true, or leave it at 1"
            )
        for key, value in (
            ("dynamic_sampling_key", t.dynamic_sampling_key),
            ("dynamic_sampling_band", t.dynamic_sampling_band),
        ):
            if value is not None and not (t.mode == "group" and t.dynamic_sampling):
                raise ValueError(
                    f"trainer.{key}={value} chooses the groups DAPO's dynamic sampling keeps: set "
                    f"trainer.mode=group and trainer.dynamic_sampling=true, or leave it null"
                )
        band = t.dynamic_sampling_band
        if band is not None and not band[0] < band[1]:
            raise ValueError(
                f"trainer.dynamic_sampling_band={list(band)}: the low bound must be below the high one"
            )
        if t.dynamic_sampling_rounds > 1 and self.pool.enabled:
            raise ValueError(
                "trainer.dynamic_sampling_rounds > 1 generates more rounds in the training loop; a rollout pool "
                "(pool.enabled) delivers one batch per step: leave it at 1"
            )

    def _check_estimator_and_budget(self) -> None:
        """The estimator matches trainer.mode, and the step's rollout budget holds its groups."""
        t, a = self.trainer, self.allocation
        if self._gdpo_applies:
            check_gdpo_estimator(t.advantage, len(self.rewards))
        if t.importance_sampling_level == "sequence" and t.loss_agg != "seq_mean_token_mean":
            logger.warning(
                "trainer.importance_sampling_level=sequence with trainer.loss_agg=%s weighs each completion by "
                "its length; GSPO's objective averages per completion: trainer.loss_agg=seq_mean_token_mean",
                t.loss_agg,
            )
        estimator = check_estimator(self.estimator_name, t.advantage_options)
        if estimator.single_rollout != (t.mode == "single"):
            raise ValueError(
                f"trainer.advantage={estimator.name} is a {'single' if estimator.single_rollout else 'group'} "
                f"estimator but trainer.mode={t.mode}; set trainer.mode="
                f"{'single' if estimator.single_rollout else 'group'} or another estimator"
            )
        if t.mode == "single" and (
            a.method != "uniform" or a.rollouts_per_step not in (None, a.prompts_per_step)
        ):
            raise ValueError(
                "trainer.mode=single rolls out once per prompt: set allocation.method=uniform and leave "
                "allocation.rollouts_per_step null"
            )
        if t.mode == "group":
            budget_key = "allocation.rollouts_per_step"
            if a.rollouts_per_step is None:
                # the budget the trainer derives: a wrong one must fail here, not after the model has loaded
                group = "trainer.num_generations"
                if estimator.extra_per_group:
                    group = f"({group} + {estimator.extra_per_group})"
                budget_key = (
                    f"allocation.rollouts_per_step (null: allocation.prompts_per_step * {group} = "
                    f"{a.prompts_per_step} * {self.group_size})"
                )
                a.check_budget(self.rollouts_per_step, budget_key)
            check_group_sizes(estimator, a, self.rollouts_per_step, budget_key)

    def _check_pool(self) -> None:
        """Rollout-pool settings that cannot work together."""
        p = self.pool
        if p.enabled:
            if self.generation.backend == "vllm" and p.device is not None:
                raise ValueError(
                    f"pool.device={p.device!r} with generation.backend=vllm: a worker's engine runs on the first "
                    "CUDA GPU its process sees (a Ray actor: its own) and its weight copy on CPU; leave pool.device "
                    "null"
                )
            if self.model.load_in_4bit:
                raise ValueError(
                    "pool.enabled with model.load_in_4bit: the pool's workers load the base in "
                    "model.dtype, not NF4; set model.load_in_4bit=false"
                )
            if p.overprovision > 0 and p.max_staleness > 1:
                raise ValueError(
                    f"pool.overprovision > 0 needs pool.max_staleness <= 1 (got {p.max_staleness}): a step's new "
                    "requests are sized by what the previous step left unfinished, known one step ahead only"
                )
            if p.overprovision > 0 and p.prompts_per_request is None:
                raise ValueError(
                    "pool.overprovision > 0 resumes by request: set pool.prompts_per_request (e.g. 1) "
                    "so that a step has several requests"
                )
