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
    config_module: str | None = None  # where the config class lives, when importing the trainer is heavy
    memory_module: str | None = None  # where its estimate_memory(cfg) lives, for `mmrl memory`

    def load_config_class(self) -> type[Config]:
        return getattr(importlib.import_module(self.config_module or self.module), self.config_class)

    def load(self) -> tuple[type[Config], Callable[[Any], Any]]:
        return self.load_config_class(), importlib.import_module(self.module).main

    def load_evaluate(self) -> Callable[..., Any]:
        """The recipe's ``evaluate(cfg, prompts_file, out_dir, checkpoint, images_per_prompt)``."""
        mod = importlib.import_module(self.module)
        if not hasattr(mod, "evaluate"):
            raise ValueError(f"recipe {self.module} has no evaluate(); `mmrl eval` does not apply to it")
        return mod.evaluate

    def load_memory(self) -> Callable[[Any], Any]:
        """The recipe's ``estimate_memory(cfg) -> MemoryEstimate`` (:mod:`mmrl.memory`)."""
        if self.memory_module is None:
            raise ValueError(
                f"recipe {self.module} has no memory estimate; `mmrl memory` applies to flow_grpo and vlm_rlvr"
            )
        return importlib.import_module(self.memory_module).estimate_memory


_RECIPES: dict[str, Recipe] = {
    "bandit": Recipe(
        "mmrl.bandit.trainer", "BanditRecipeConfig", "core demo: GRPO on a synthetic contextual bandit"
    ),
    "flow_grpo": Recipe(
        "mmrl.flow.trainer",
        "FlowGRPOConfig",
        "flow-matching GRPO / DiffusionNFT for text-to-image/video",
        config_module="mmrl.flow.config",
        memory_module="mmrl.flow.memory",
    ),
    "flow_pretrain_shapes": Recipe(
        "mmrl.flow.pretrain_shapes",
        "PretrainShapesConfig",
        "flow-matching pretraining of the tiny shapes text-to-image model from random weights",
    ),
    "vlm_sft_reason": Recipe(
        "mmrl.vlm.sft_reason", "ReasonSFTConfig", "SFT of the tiny VLM on shapes-math reasoning traces"
    ),
    "vlm_sft_shapes": Recipe(
        "mmrl.vlm.sft_shapes", "SFTShapesConfig", "SFT of the tiny VLM from random weights on shapes VQA"
    ),
    "vlm_rlvr": Recipe(
        "mmrl.vlm.trainer",
        "VLMRLVRConfig",
        "single-rollout entropy-shaped RLVR (or group GRPO) for VLMs",
        config_module="mmrl.vlm.config",
        memory_module="mmrl.vlm.memory",
    ),
}


def list_recipes() -> dict[str, str]:
    """Recipe names and one-line descriptions."""
    return {name: r.description for name, r in sorted(_RECIPES.items())}


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        raise KeyError(f"unknown recipe {name!r}. Available: {sorted(_RECIPES)}")
    return _RECIPES[name]
