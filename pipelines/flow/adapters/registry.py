"""Registry of flow-model families: register an adapter class with a decorator, load it by name.

Example::

    @register_flow_family("sd3")
    class SD3Adapter(FlowAdapter):
        pipeline_class = StableDiffusion3Pipeline
        ...

    adapter = load_adapter("sd3", "stabilityai/stable-diffusion-3.5-medium", torch_dtype=torch.bfloat16)

A new family is one file with its decorated adapter class, listed in ``_PROVIDERS`` below (or imported by the
caller before ``load_adapter``); configs name it in ``model.family``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from pipelines.hub import model_not_found, model_not_loadable

if TYPE_CHECKING:
    from pipelines.flow.adapters.base import FlowAdapter

__all__ = ["get_adapter", "list_adapters", "load_adapter", "register_flow_family"]

A = TypeVar("A", bound=type["FlowAdapter"])

_FAMILIES: dict[str, type[FlowAdapter]] = {}

# Modules whose import registers their families, imported on first lookup (as rewards/registry.py does).
_PROVIDERS: tuple[str, ...] = (
    "pipelines.flow.adapters.sd3",
    "pipelines.flow.adapters.flux",
    "pipelines.flow.adapters.sana",
    "pipelines.flow.adapters.wan",
    "pipelines.flow.adapters.wan22",
    "pipelines.flow.adapters.shapes",
    "pipelines.flow.adapters.qwen_image",
    "pipelines.flow.adapters.z_image",
    "pipelines.flow.adapters.flux2_klein",
    "pipelines.flow.adapters.flux2",
)


def register_flow_family(name: str) -> Callable[[A], A]:
    """Class decorator adding a :class:`~pipelines.flow.adapters.base.FlowAdapter` subclass under ``name``
    (also its ``family`` attribute).

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def wrap(cls: A) -> A:
        if name in _FAMILIES and _FAMILIES[name] is not cls:
            raise ValueError(f"flow family {name!r} is already registered to {_FAMILIES[name].__name__}")
        cls.family = name
        _FAMILIES[name] = cls
        return cls

    return wrap


def _load_providers() -> None:
    for module in _PROVIDERS:
        importlib.import_module(module)


def list_adapters() -> list[str]:
    """Names of every registered flow family, sorted."""
    _load_providers()
    return sorted(_FAMILIES)


def get_adapter(family: str) -> type[FlowAdapter]:
    """The adapter class of ``family``.

    Raises:
        KeyError: unknown family, listing the available ones.
    """
    _load_providers()
    if family not in _FAMILIES:
        raise KeyError(f"unknown flow adapter {family!r}. Available: {sorted(_FAMILIES)}")
    return _FAMILIES[family]


def load_adapter(
    family: str,
    model_id_or_path: str,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization_config: object | None = None,
    **kwargs,
) -> FlowAdapter:
    """``get_adapter(family).from_pretrained(model_id_or_path, ...)``.

    Raises:
        OSError: ``model_id_or_path`` is neither a local folder nor a Hub repository that can be reached; the
            message names both places looked at (a relative path is relative to the working directory).
        ValueError: a local path that exists but holds no such model that loads (the loader's reason named).
    """
    cls = get_adapter(family)
    try:
        return cls.from_pretrained(
            model_id_or_path,
            torch_dtype=torch_dtype,
            device=device,
            quantization_config=quantization_config,
            **kwargs,
        )
    except (torch.OutOfMemoryError, MemoryError):
        raise  # (the folder is fine; the device is full)
    except Exception as error:  # (safetensors' errors are no OSError; a broken config.json is a ValueError)
        if Path(model_id_or_path).exists():
            raise model_not_loadable(f"{family!r} model", model_id_or_path, error) from error
        if isinstance(error, OSError):
            raise model_not_found(f"{family!r} model", model_id_or_path, error) from error
        raise
