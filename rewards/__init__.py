"""Reward models and verifiers. Never imports ``mmrl`` or ``pipelines``."""

from rewards.base import Reward, RewardOutput
from rewards.registry import build, get_reward_class, list_rewards, register

__all__ = ["Reward", "RewardOutput", "build", "get_reward_class", "list_rewards", "register"]
