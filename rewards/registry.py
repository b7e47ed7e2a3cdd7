"""Registry of rewards by name: register with a decorator, build with options.

Example::

    @register("jpeg_compressibility")
    class JpegCompressibility(Reward): ...

    reward = build("jpeg_compressibility", quality=95)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from rewards.base import Reward

R = TypeVar("R", bound=type[Reward])

_REGISTRY: dict[str, type[Reward]] = {}

# Modules whose import registers their rewards. Imported on first lookup, not at package import, so that
# `import rewards` stays cheap and optional dependencies are only touched when their reward is built.
_PROVIDERS: tuple[str, ...] = (
    "rewards.jpeg",
    "rewards.clip",
    "rewards.pickscore",
    "rewards.aesthetic",
    "rewards.imagereward",
    "rewards.video",
    "rewards.text",
    "rewards.remote",
    "rewards.shapes",
    "rewards.ocr",
    "rewards.judge",
)


def register(name: str) -> Callable[[R], R]:
    """Class decorator adding a :class:`Reward` subclass to the registry under ``name``."""

    def wrap(cls: R) -> R:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"reward name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _load_providers() -> None:
    for module in _PROVIDERS:
        importlib.import_module(module)


def list_rewards() -> list[str]:
    """Names of every registered reward, sorted."""
    _load_providers()
    return sorted(_REGISTRY)


def get_reward_class(name: str) -> type[Reward]:
    _load_providers()
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}. Available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def build(name: str, **options: Any) -> Reward:
    """Build the reward registered as ``name`` with keyword ``options`` (model_id, device, ...)."""
    return get_reward_class(name)(**options)
