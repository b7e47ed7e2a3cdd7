"""VLM model families: what differs between Qwen2.5-VL, Qwen3-VL, and others, behind one interface.

A family says how a question with images becomes a chat prompt, which vision special tokens generation must
never emit, how token types and image features are built for a scoring forward, and where the vision tower sits.
The generation backends, the log-prob recomputation and the trainer ask the family instead of assuming Qwen.

Example::

    @register_vlm_family("qwen2_5_vl")
    class Qwen25VL(VLMFamily):
        model_types = ("qwen2_5_vl", "qwen2_vl")
        ...

    family = family_for_model_type(model.config.model_type)   # or get_vlm_family("qwen2_5_vl")

A new family is one file with its decorated class, listed in ``_PROVIDERS`` below (or imported by the caller);
configs name it in ``model.family`` (null: detected from the checkpoint's ``model_type``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from PIL import Image

from pipelines.vlm.inputs import VLMPrompt

__all__ = [
    "DEFAULT_FAMILY",
    "VLMFamily",
    "family_for_model_type",
    "get_vlm_family",
    "list_vlm_families",
    "register_vlm_family",
    "special_token_ids",
]

#: the family assumed when a caller names none and there is no model config to detect it from
DEFAULT_FAMILY = "qwen2_5_vl"


def special_token_ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    """Ids of the ``tokens`` that exist in ``tokenizer``'s vocabulary, sorted.

    Tokens absent from the vocabulary are left out (``convert_tokens_to_ids`` would map them to the unknown
    token, and suppressing that would be a silent change of the distribution).
    """
    vocab = tokenizer.get_vocab()
    return sorted({vocab[token] for token in tokens if token in vocab})


class VLMFamily(ABC):
    """The conventions of one family of vision-language models.

    Attributes:
        name: registry key (``model.family``).
        model_types: the transformers ``config.model_type`` values this family serves (detection).
        vision_special_tokens: tokens generation must never emit (they open or fill image regions).
        vision_module: attribute name of the vision tower on the backbone; parameters whose name contains it
            are the vision tower's (frozen unless ``model.train_vision``).
        vision_lora_targets: the vision tower's linear layers (names or dotted suffixes), adapted by LoRA when
            the tower is trained: every linear layer of the tower and its merger, as EasyR1's ``all-linear``.
        token_type_key: the model input that carries per-token modality types, or ``None``.
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    vision_special_tokens: tuple[str, ...] = ()
    vision_module: str = "visual"
    vision_lora_targets: tuple[str, ...] = ()
    token_type_key: str | None = None

    def prompt(
        self,
        question: str,
        images: Sequence[Image.Image] = (),
        *,
        system: str | None = None,
        prompt_id: str | None = None,
    ) -> VLMPrompt:
        """The single-turn chat prompt of a question about ``images`` (default: the images, then the text)."""
        return VLMPrompt.from_question(question, images, system=system, prompt_id=prompt_id)

    def suppressed_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids generation must never sample: the :attr:`vision_special_tokens` in the vocabulary."""
        return special_token_ids(tokenizer, self.vision_special_tokens)

    @abstractmethod
    def image_token_id(self, processor: Any) -> int:
        """Id of the token each image feature fills."""

    @abstractmethod
    def token_type_ids(self, input_ids: torch.Tensor, processor: Any) -> torch.Tensor | None:
        """``[B, L]`` modality type per token (what :attr:`token_type_key` carries), or ``None`` if the family
        has none."""

    @abstractmethod
    def image_inputs(
        self, processor: Any, images: Sequence[Image.Image]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The vision tensors of ``images`` for a forward (``pixel_values``...) and the number of image tokens
        each image expands to, in order."""

    def position_ids(
        self, backbone: torch.nn.Module, model_inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The position ids ``backbone`` computes itself for the rows of ``model_inputs`` (with images), or
        ``None`` when the family does not say. Scoring a prompt once for all its completions
        (:func:`pipelines.vlm.logprobs.completion_token_stats`) runs prompt and completions as two forwards and
        passes these positions to both; without them it scores every row whole."""
        return None

    def vision_tower(self, backbone: torch.nn.Module) -> torch.nn.Module | None:
        """The vision tower module of the backbone (an FSDP unit of its own), or ``None``."""
        return getattr(backbone, self.vision_module, None)

    def is_vision_parameter(self, name: str) -> bool:
        """Whether the parameter ``name`` belongs to the vision tower."""
        return self.vision_module in name

    def lora_target_pattern(self, names: Sequence[str], train_vision: bool) -> str:
        """peft ``target_modules`` (a regex on module names): ``names`` outside the vision tower, and with the
        tower trained its :attr:`vision_lora_targets` inside it."""

        def suffixes(targets: Sequence[str]) -> str:
            return "|".join(target.replace(".", r"\.") for target in targets)

        language = rf"^(?!.*{self.vision_module}).*\.({suffixes(names)})$"
        if not train_vision:
            return language
        return rf"{language}|^.*{self.vision_module}.*\.({suffixes(self.vision_lora_targets)})$"


F = TypeVar("F", bound=type[VLMFamily])

_FAMILIES: dict[str, type[VLMFamily]] = {}

# Modules whose import registers their families, imported on first lookup (as rewards/registry.py does).
_PROVIDERS: tuple[str, ...] = (
    "pipelines.vlm.families.qwen2_5_vl",
    "pipelines.vlm.families.qwen3_vl",
    "pipelines.vlm.families.gemma3",
)


def register_vlm_family(name: str) -> Callable[[F], F]:
    """Class decorator adding a :class:`VLMFamily` subclass under ``name``.

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def wrap(cls: F) -> F:
        if name in _FAMILIES and _FAMILIES[name] is not cls:
            raise ValueError(f"VLM family {name!r} is already registered to {_FAMILIES[name].__name__}")
        cls.name = name
        _FAMILIES[name] = cls
        return cls

    return wrap


def _load_providers() -> None:
    for module in _PROVIDERS:
        importlib.import_module(module)


def list_vlm_families() -> list[str]:
    """Names of every registered VLM family, sorted."""
    _load_providers()
    return sorted(_FAMILIES)


def get_vlm_family(name: str) -> VLMFamily:
    """An instance of the family registered as ``name``.

    Raises:
        KeyError: unknown name, listing the registered ones.
    """
    _load_providers()
    if name not in _FAMILIES:
        raise KeyError(f"unknown VLM family {name!r}. Available: {sorted(_FAMILIES)}")
    return _FAMILIES[name]()


def family_for_model_type(model_type: str) -> VLMFamily:
    """The family serving transformers ``model_type`` (a checkpoint's ``config.model_type``).

    Raises:
        ValueError: no registered family serves it; names the registered families and their model types.
    """
    _load_providers()
    for cls in _FAMILIES.values():
        if model_type in cls.model_types:
            return cls()
    served = {name: list(cls.model_types) for name, cls in sorted(_FAMILIES.items())}
    raise ValueError(
        f"no VLM family serves model_type {model_type!r} (registered: {served}); register one with "
        "pipelines.vlm.families.register_vlm_family, or set model.family"
    )
