"""The shared RL core: prompt statistics, rollout allocation, advantages and losses. Pure tensor math."""

from mmrl.core import advantages, allocation, losses, stats
from mmrl.core.groups import effective_ratio
from mmrl.core.stats import PromptStats

__all__ = ["PromptStats", "advantages", "allocation", "effective_ratio", "losses", "stats"]
