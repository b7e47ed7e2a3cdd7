"""The one interface every flow-model adapter implements, and the conditioning it passes around.

An adapter wraps a diffusers pipeline of one model family and exposes exactly what RL needs, statelessly:

    cond = adapter.encode(prompts, cfg=True)           # text embeddings (+ unconditional ones for CFG)
    sigmas = adapter.sigmas(num_steps, height, width)  # [S+1] float32, from 1 towards 0, last entry 0
    x = torch.randn(B, *adapter.latent_shape(height, width))
    v = adapter.velocity(x, sigma, cond, guidance_scale)
    images = adapter.decode(x)                         # [B, 3, H, W] in [0, 1]  (video: [B, T, 3, H, W])

``adapter.transformer`` is the module RL trains (LoRA through peft's ``add_adapter``). Latents are always kept
in the layout the SDE step works on; families whose transformer wants another layout (FLUX's packed 2x2
patches) convert inside ``velocity`` so the SDE math and the stored trajectories stay family-agnostic.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, SchedulerMixin
from diffusers.pipelines.flux.pipeline_flux import calculate_shift


@dataclass
class Conditioning:
    """Text conditioning for a batch of ``B`` samples.

    Attributes:
        cond: named ``[B, ...]`` tensors the family's transformer reads (e.g. ``prompt_embeds``,
            ``pooled_projections``, ``attention_mask``).
        uncond: the same names for the negative/empty prompt, present only when CFG was requested at encode time.
    """

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return next(iter(self.cond.values())).shape[0]

    def select(self, index: torch.Tensor | Sequence[int]) -> Conditioning:
        """Rows ``index`` of every tensor (repeats allowed): expands prompts to samples, or picks transitions."""
        idx = torch.as_tensor(index, dtype=torch.long)

        def pick(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: t.index_select(0, idx.to(t.device)) for k, t in d.items()}

        return Conditioning(pick(self.cond), pick(self.uncond) if self.uncond is not None else None)

    def with_cfg_batch(self) -> dict[str, torch.Tensor]:
        """``uncond`` then ``cond`` stacked on the batch dimension ``[2B, ...]``, for one batched CFG forward."""
        if self.uncond is None:
            raise ValueError(
                "classifier-free guidance needs unconditional embeddings: encode(prompts, cfg=True)"
            )
        return {k: torch.cat([self.uncond[k], self.cond[k]], dim=0) for k in self.cond}


def stack_padded(sequences: Sequence[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad text embeddings ``[L_i, D]`` with zeros into one ``[B, length, D]`` tensor and its ``[B, length]``
    mask (1 for real tokens), so that every batch of a family has one text length and rows can be regrouped.

    Raises:
        ValueError: a sequence is longer than ``length`` (naming its row).
    """
    first = sequences[0]
    padded = first.new_zeros(len(sequences), length, first.shape[-1])
    mask = torch.zeros(len(sequences), length, dtype=torch.long, device=first.device)
    for row, sequence in enumerate(sequences):
        if sequence.shape[0] > length:
            raise ValueError(
                f"prompt {row}: text of {sequence.shape[0]} tokens is longer than max_sequence_length={length}"
            )
        padded[row, : sequence.shape[0]] = sequence
        mask[row, : sequence.shape[0]] = 1
    return padded, mask


# load_config accepts these of from_pretrained's keyword arguments (where and which revision to read)
_CONFIG_KWARGS = ("cache_dir", "local_files_only", "revision", "token", "force_download", "proxies")


def load_pipeline(
    pipeline_cls: type[DiffusionPipeline],
    model_id_or_path: str,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization_config: object | None = None,
    **kwargs,
) -> DiffusionPipeline:
    """``pipeline_cls.from_pretrained`` with mmrl's loading options, moved to ``device``.

    Args:
        pipeline_cls: the diffusers pipeline class of the family (``StableDiffusion3Pipeline``...).
        model_id_or_path: a hub id (``stabilityai/stable-diffusion-3.5-medium``) or a local directory.
        torch_dtype: weights dtype (``torch.bfloat16`` on GPUs; float32 on CPU).
        device: where the modules go after loading (a quantized pipeline is placed by its quantizer, not moved).
        quantization_config: a diffusers ``PipelineQuantizationConfig`` (bitsandbytes / torchao) or ``None``.
        kwargs: passed on (``revision``, ``variant``, ``local_files_only``...).
    """
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    # A component saved as absent (model_index entry [null, null]: SD3 without T5, the pixel-space shapes model
    # without VAE) must be passed as None, or diffusers refuses the directory as incomplete.
    index = pipeline_cls.load_config(
        model_id_or_path, **{k: v for k, v in kwargs.items() if k in _CONFIG_KWARGS}
    )
    for name, entry in index.items():
        if isinstance(entry, list | tuple) and list(entry) == [None, None]:
            kwargs.setdefault(name, None)
    # diffusers >= 0.42 names the argument `dtype` (`torch_dtype` is deprecated there)
    pipe = pipeline_cls.from_pretrained(model_id_or_path, dtype=torch_dtype, **kwargs)
    if quantization_config is None:
        pipe.to(device)
    # RL drives the denoising loop itself; the pipeline's progress bars would only add noise to the logs.
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flow_match_sigmas(
    scheduler: SchedulerMixin,
    num_steps: int,
    image_seq_len: int | None = None,
    explicit_linspace: bool = False,
    mu: float | None = None,
) -> torch.Tensor:
    """The sigma schedule ``[S+1]`` (last entry 0) of a pipeline's flow scheduler, computed by diffusers.

    Static shift (SD3, SANA, Wan): ``sigma = shift t / (1 + (shift - 1) t)``. Dynamic shift (FLUX, SD3.5 option):
    ``mu`` from the image token count by diffusers' ``calculate_shift`` (linear between ``base_shift`` at
    ``base_image_seq_len`` and ``max_shift`` at ``max_image_seq_len``), then ``sigma = e^mu / (e^mu + 1/t - 1)``.
    A ``FlowMatchEulerDiscreteScheduler`` is copied from its config (so every option it carries applies and the
    pipeline's own scheduler state is untouched). Multistep flow solvers (SANA's DPM-Solver, Wan's UniPC, both
    with ``use_flow_sigmas``) are copied the same way and asked for their own sigmas,
    ``shift(linspace(1, 1/1000, S + 1)[:-1])`` with ``shift = flow_shift``: the steps their pipelines sample on,
    so a policy is trained on the noise levels it is used at (and Wan2.2's experts on the steps the pipeline
    gives them). Their Euler counterpart would space the steps down to an already shifted ``sigma_min`` (at
    shift 3 and 10 steps its last step sits at 0.009 where the solver's is at 0.252). The first sigma is 1 and
    the last 0: a rollout starts from pure noise and ends at a clean sample. (DPM-Solver's flow sigmas start at
    ``shift(0.999)`` = 0.9997, from which its pipeline also starts on pure noise; there Flow-GRPO's SDE std
    ``a sqrt(sigma / (1 - sigma))``, which it evaluates with the next sigma at sigma = 1, would be 58 a. A solver
    configured with ``final_sigmas_type: sigma_min`` would stop just short of a clean sample.)

    Args:
        scheduler: the pipeline's scheduler.
        num_steps: number of denoising steps ``S``.
        image_seq_len: transformer image tokens, needed when the scheduler uses dynamic shifting.
        explicit_linspace: pass ``sigmas = linspace(1, 1/S, S)`` as ``FluxPipeline`` does, instead of letting
            the scheduler space timesteps between its ``sigma_max`` and ``sigma_min``.
        mu: the dynamic shift, for pipelines that compute it their own way (FLUX.2's empirical ``mu`` of image
            tokens and steps); ``None`` derives it from ``image_seq_len`` as above.

    Raises:
        ValueError: ``num_steps < 1``, or dynamic shifting without ``image_seq_len``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    solver = type(scheduler).from_config(scheduler.config)
    euler = isinstance(solver, FlowMatchEulerDiscreteScheduler)
    if not euler and not solver.config.get("use_flow_sigmas", False):
        raise ValueError(f"{type(scheduler).__name__} is not a flow-matching scheduler (no use_flow_sigmas)")
    kwargs: dict = {}
    if solver.config.get("use_dynamic_shifting", False) and mu is not None:
        kwargs["mu"] = mu
    elif solver.config.get("use_dynamic_shifting", False):
        if image_seq_len is None:
            raise ValueError("this scheduler uses dynamic shifting: pass image_seq_len")
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            solver.config.get("base_image_seq_len", 256),
            solver.config.get("max_image_seq_len", 4096),
            solver.config.get("base_shift", 0.5),
            solver.config.get("max_shift", 1.15),
        )
    if explicit_linspace:
        kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        solver.set_timesteps(device="cpu", **kwargs)
    else:
        solver.set_timesteps(num_steps, device="cpu", **kwargs)
    sigmas = solver.sigmas.float().clone()
    sigmas[0], sigmas[-1] = 1.0, 0.0
    return sigmas


class FlowAdapter(ABC):
    """A flow-matching text-to-image (or -video) model, seen as RL sees it.

    Subclasses hold the diffusers pipeline in ``self.pipe`` and implement the abstract methods. ``family`` names
    the adapter in the registry; ``is_video`` tells whether ``decode`` returns ``[B, T, 3, H, W]``.
    """

    family: str = ""
    is_video: bool = False
    #: the diffusers pipeline class of the family (``StableDiffusion3Pipeline``...), loaded by ``from_pretrained``
    pipeline_class: ClassVar[type[DiffusionPipeline]]

    def __init__(self, pipe: DiffusionPipeline) -> None:
        self.pipe = pipe
        #: mixed precision: the transformer's forwards run under ``torch.autocast`` in this dtype (weights and
        #: gradients stay in their own dtype); ``None`` computes in the weights' dtype
        self.autocast_dtype: torch.dtype | None = None

    # ---- loading --------------------------------------------------------------------------------------------

    @classmethod
    def adapter_options(cls) -> list[str]:
        """Keyword options of the adapter's ``__init__`` besides the pipeline (``max_sequence_length``...)."""
        params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # (self, pipe, ...)
        return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str,
        torch_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quantization_config: object | None = None,
        **kwargs,
    ) -> FlowAdapter:
        """Load :attr:`pipeline_class` from a hub id or a local directory and wrap it.

        ``kwargs`` named in :meth:`adapter_options` go to the adapter's ``__init__`` (their defaults are the
        family's), the others to :func:`load_pipeline` (``revision``, ``variant``, ``local_files_only``...).
        """
        options = {name: kwargs.pop(name) for name in cls.adapter_options() if name in kwargs}
        pipe = load_pipeline(
            cls.pipeline_class, model_id_or_path, torch_dtype, device, quantization_config, **kwargs
        )
        return cls(pipe, **options)

    @classmethod
    def trained_components(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The pipeline components RL trains when the adapter is built with ``options`` (``model.options``),
        known before anything is loaded (a memory estimate builds the published architecture on ``meta`` and
        gives these gradients and optimizer states): the transformer."""
        return ("transformer",)

    # ---- the interface ---------------------------------------------------------------------------------------

    @property
    def trained_component(self) -> str:
        """The pipeline attribute holding the denoiser RL trains (``transformer``; Wan2.2's low-noise expert is
        ``transformer_2``); :meth:`swapped_denoiser` swaps a policy (reference, explorer) in there."""
        return "transformer"

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoiser RL trains."""
        return getattr(self.pipe, self.trained_component)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def trained_parts(self) -> dict[str, torch.nn.Module]:
        """The trained denoisers by the pipeline attribute (and diffusers folder) each is saved as:
        ``{trained_component: transformer}``, both experts for Wan2.2 trained whole."""
        return {self.trained_component: self.transformer}

    @contextmanager
    def swapped_denoiser(self, module: torch.nn.Module) -> Iterator[None]:
        """Run the pipeline with ``module`` (a reference copy, a quantized explorer: a module built from
        :attr:`transformer`) in place of the trained denoiser; the trained one is back afterwards."""
        pipe, component = self.pipe, self.trained_component
        live = getattr(pipe, component)
        setattr(pipe, component, module)
        try:
            yield
        finally:
            setattr(pipe, component, live)

    # ---- LoRA files --------------------------------------------------------------------------------------------

    def save_lora(self, directory: Path) -> None:
        """The trained LoRA in diffusers/PEFT format: ``pipe.load_lora_weights(directory)`` loads it on the base
        model (Wan2.2's low expert: with ``load_into_transformer_2=True``)."""
        self._save_lora_file(directory, self.transformer)

    def load_lora(self, directory: Path) -> None:
        """Load a folder written by :meth:`save_lora` into the trained LoRA layers (added beforehand).

        Raises:
            ValueError: the folder holds no transformer LoRA, or one that does not fit the model.
        """
        self._load_lora_file(directory, self.transformer)

    def _save_lora_file(
        self, directory: Path, model: torch.nn.Module, weight_name: str | None = None
    ) -> None:
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(model)
        # the LoRA config (rank, alpha) goes into the file: without it diffusers loads the update scaled by 1, not
        # by the trained alpha / r
        config = model.peft_config["default"].to_dict()
        type(self.pipe).save_lora_weights(
            directory,
            transformer_lora_layers=layers,
            transformer_lora_adapter_metadata=config,
            weight_name=weight_name,
        )

    def _load_lora_file(
        self, directory: Path, model: torch.nn.Module, weight_name: str | None = None
    ) -> None:
        """Load ``directory``'s LoRA file (``weight_name``, by default diffusers'
        ``pytorch_lora_weights.safetensors``) into ``model``'s LoRA layers; ``directory`` may also be a Hub id
        ``namespace/name`` (no such local path).

        Raises:
            FileNotFoundError: no such folder (named, with what a LoRA folder holds).
            ValueError: the folder holds no transformer LoRA, or one that does not fit the model.
        """
        from peft.utils import set_peft_model_state_dict

        # a missing folder would reach diffusers as a Hub repository id and fail there after the model loaded,
        # naming neither the path nor what belongs in it
        hub_id = (
            not directory.is_absolute() and len(directory.parts) == 2 and directory.parts[0][0] not in ".~"
        )
        if not directory.is_dir() and (directory.exists() or not hub_id):
            raise FileNotFoundError(
                f"no LoRA folder at {directory}: a LoRA is a folder as save_lora writes it (a LoRA "
                f"checkpoint's adapter/), holding {weight_name or 'pytorch_lora_weights.safetensors'}"
            )
        state = type(self.pipe).lora_state_dict(str(directory), weight_name=weight_name)
        state = state[0] if isinstance(state, tuple) else state
        prefix = "transformer."
        layers = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        if not layers:
            raise ValueError(
                f"{directory} holds no transformer LoRA weights ({weight_name or 'default file'})"
            )
        result = set_peft_model_state_dict(model, layers)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"LoRA at {directory} does not fit this model: unexpected keys {unexpected[:3]}")

    @abstractmethod
    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        """Text conditioning ``[B, ...]``; ``cfg=True`` also encodes ``negative_prompt`` for guidance."""

    @staticmethod
    def conditioning_from(
        encode_batch: Callable[[list[str]], dict[str, torch.Tensor]],
        prompts: Sequence[str],
        cfg: bool,
        negative_prompt: str,
    ) -> Conditioning:
        """:meth:`encode` for a family whose text encoder maps a list of prompts to the transformer's keyword
        tensors: the prompts, and with ``cfg`` as many copies of ``negative_prompt`` (no gradients)."""
        prompts = list(prompts)
        with torch.no_grad():
            cond = encode_batch(prompts)
            uncond = encode_batch([negative_prompt] * len(prompts)) if cfg else None
        return Conditioning(cond, uncond)

    @abstractmethod
    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Per-sample latent shape (without batch) for an output of ``height x width`` (and frames)."""

    @abstractmethod
    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        """``[num_steps + 1]`` float32 sigma schedule, decreasing from ~1 to 0, as the family's pipeline uses."""

    @abstractmethod
    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        """One transformer forward on ``x [N, ...]`` at per-sample ``sigma [N]``; returns the velocity ``[N, ...]``."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` (video ``[B, T, 3, H, W]``) float32 in [0, 1]."""

    def trains_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: whether the trained denoiser computes the velocity at each of ``sigma [N]`` (all of them,
        except on pipelines whose experts split the schedule, as Wan2.2's). Training points elsewhere carry no
        gradient, and the trainer leaves them out."""
        return torch.ones_like(sigma, dtype=torch.bool)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether ``velocity`` runs classifier-free guidance (two forwards per sample) at this scale."""
        return guidance_scale > 1.0

    def nfe_per_sample(self, guidance_scale: float) -> int:
        """Transformer evaluations per sample and step: 2 with CFG (cond + uncond), else 1."""
        return 2 if self.uses_cfg(guidance_scale) else 1

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0
    ) -> torch.Tensor:
        """Velocity ``v(x, sigma | prompt)`` in float32 (computed under :attr:`autocast_dtype` when set), with
        classifier-free guidance when it applies:

            v = v_uncond + w (v_cond - v_uncond)          (Ho & Salimans, arXiv 2207.12598)

        The conditional and unconditional halves run as one batched forward of size ``2B``.

        Args:
            x: ``[B, *latent_shape]`` latents.
            sigma: scalar or ``[B]`` sigmas in [0, 1].
            cond: conditioning of the same ``B`` rows.
            guidance_scale: ``w``; CFG is used when :meth:`uses_cfg` says so (FLUX embeds it instead).
        """
        batch = x.shape[0]
        sigma_b = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1).expand(batch)
        if len(cond) != batch:
            raise ValueError(f"conditioning has {len(cond)} rows but x has batch {batch}")
        autocast = torch.autocast(
            x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )
        if not self.uses_cfg(guidance_scale):
            with autocast:
                return self._forward(x, sigma_b, cond.cond, guidance_scale).float()
        return self.guide(
            *self.cfg_halves(x, sigma_b, cond, guidance_scale), self.guidance_at(sigma_b, guidance_scale)
        )

    def cfg_halves(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional and conditional velocities ``([B, ...], [B, ...])`` float32 that :meth:`velocity`
        guides, from one batched forward of ``2B`` rows (``cond`` needs its ``uncond``)."""
        batch = x.shape[0]
        sigma_b = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1).expand(batch)
        with torch.autocast(
            x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            v = self._forward(
                torch.cat([x, x]), torch.cat([sigma_b, sigma_b]), cond.with_cfg_batch(), guidance_scale
            )
        v_uncond, v_cond = v.float().chunk(2)
        return v_uncond, v_cond

    def guidance_at(self, sigma: torch.Tensor, guidance_scale: float) -> float | torch.Tensor:
        """The guidance scale ``w`` of rows at ``sigma [B]``: ``guidance_scale`` itself, except for a family whose
        pipeline guides some steps with another scale (Wan2.2's low-noise expert), which returns ``[B]``."""
        return guidance_scale

    def guide(
        self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """Combine the two halves of a CFG forward ``[B, ...]`` each: ``v_uncond + w (v_cond - v_uncond)``, ``w``
        a number or one per row ``[B]`` (:meth:`guidance_at`).

        Families whose pipeline guides differently (Qwen-Image rescales the result to the conditional norm)
        override this, so that RL samples and scores exactly what the pipeline generates.
        """
        if isinstance(guidance_scale, torch.Tensor):
            guidance_scale = guidance_scale.to(v_cond).reshape(-1, *([1] * (v_cond.dim() - 1)))
        return v_uncond + guidance_scale * (v_cond - v_uncond)
