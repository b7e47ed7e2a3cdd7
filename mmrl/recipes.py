"""Registry of training recipes: the ``recipe:`` key of a config picks its schema and entry point.

Entries are import paths, imported on use, so ``mmrl --help`` does not pay for diffusers/transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmrl.config import Config

__all__ = ["Recipe", "get_recipe", "list_recipes"]


@dataclass(frozen=True)
class Recipe:
    module: str
    config_class: str
    description: str

    def load(self) -> tuple[type[Config], Callable[[Any], Any]]:
        mod = importlib.import_module(self.module)
        return getattr(mod, self.config_class), mod.main


_RECIPES: dict[str, Recipe] = {
    "bandit": Recipe("mmrl.bandit.trainer", "BanditRecipeConfig", "core demo: GRPO on a synthetic contextual bandit"),
}


def list_recipes() -> dict[str, str]:
    """Recipe names and one-line descriptions."""
    return {name: r.description for name, r in sorted(_RECIPES.items())}


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        raise KeyError(f"unknown recipe {name!r}. Available: {sorted(_RECIPES)}")
    return _RECIPES[name]
