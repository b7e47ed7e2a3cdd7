"""GRPO on the synthetic contextual bandit: the core demo recipe (``recipe: bandit``).

Lifecycle (as every mmrl trainer): ``BanditTrainer(cfg)`` -> ``setup()`` -> ``train()`` -> ``cleanup()``;
``main(cfg)`` does all four. One step:

1. select prompts from the train pool (uniform, Thompson or priority, from the prompt statistics store);
2. allocate the rollout budget over them (uniform, knapsack or square-root rule);
3. sample answers, score them, fold the rewards into the store;
4. advantages (the registered estimator: GRPO / Dr.GRPO / RLOO / global-std ...) and the clipped surrogate (+ optional KL to the start policy).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Literal

import torch
from pydantic import model_validator

from mmrl.bandit.world import BanditPolicy, BanditWorld
from mmrl.config import Config, Field, RunConfig
from mmrl.core import allocation as alloc_lib
from mmrl.core import losses as loss_lib
from mmrl.core.estimators import RewardBatch, check_estimator, get_estimator
from mmrl.core.groups import effective_ratio
from mmrl.core.stats import PromptStats
from mmrl.loop import run_recipe
from mmrl.sections import AllocationConfig, check_group_sizes
from mmrl.trainer_base import TrainerBase

__all__ = ["BanditRecipeConfig", "BanditTrainer", "main"]

logger = logging.getLogger(__name__)


class WorldConfig(Config):
    num_prompts: int = Field(2000, ge=2, description="Prompts in the world (train + held-out).")
    num_answers: int = Field(8, ge=2, description="Answers per prompt; chance success is 1/num_answers.")
    dim: int = Field(16, ge=1, description="Prompt feature dimension.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of prompts never trained on.")
    seed: int = Field(0, description="Seed of the world itself (features, optimum, split).")


class PolicyConfig(Config):
    kind: Literal["linear", "tabular"] = Field(
        "linear", description="linear: shared weights (generalises to held-out); tabular: per-prompt logits."
    )
    init_scale: float = Field(0.3, description="Start weights = init_scale * optimum + init_noise * N(0,1).")
    init_noise: float = Field(0.3, ge=0, description="Noise of the start weights.")


class BanditAllocation(AllocationConfig):
    """The shared allocation section with the bandit's defaults (64 prompts, 512 rollouts, at most 64 each)."""

    prompts_per_step: int = Field(64, ge=1, description="Prompts picked per step.")
    rollouts_per_step: int = Field(512, ge=1, description="Rollout budget per step (sum over prompts).")
    n_max: int | None = Field(64, ge=1, description="Most rollouts a prompt gets (null: no cap).")


class TrainerConfig(Config):
    steps: int = Field(150, ge=1, description="Training steps.")
    lr: float = Field(0.1, gt=0, description="Adam learning rate.")
    advantage: str = Field(
        "grpo",
        description="Advantage estimator (mmrl.core.estimators.list_estimators()): grpo: group mean/std; "
        "dr_grpo: no std; rloo: leave-one-out; global_std: batch std; mc_grpo; single; ...",
    )
    advantage_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the estimator (e.g. single: {center: true})."
    )
    epsilon_low: float = Field(0.2, ge=0, description="Lower clip range of the ratio.")
    epsilon_high: float = Field(0.28, ge=0, description="Upper clip range (clip-higher, DAPO uses 0.28).")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the start policy (0: no KL term).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    ppo_epochs: int = Field(1, ge=1, description="Optimisation passes over each batch of rollouts.")
    eval_every: int = Field(25, ge=1, description="Evaluate held-out success every this many steps.")


class BanditRecipeConfig(Config):
    recipe: Literal["bandit"] = Field("bandit", description="Which recipe this config runs.")
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="bandit"))
    world: WorldConfig = Field(default_factory=WorldConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    allocation: BanditAllocation = Field(default_factory=BanditAllocation)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _check(self) -> BanditRecipeConfig:
        estimator = check_estimator(self.trainer.advantage, self.trainer.advantage_options)
        check_group_sizes(estimator, self.allocation, self.allocation.rollouts_per_step)
        return self


class BanditTrainer(TrainerBase):
    """GRPO over the bandit world with the core's selection, allocation, advantages and losses."""

    show = ("reward/mean", "eval/heldout_success")

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.setup_runtime()
        self.world = BanditWorld(**cfg.world.model_dump())
        if cfg.allocation.prompts_per_step > len(self.world.train_ids):
            raise ValueError(
                f"allocation.prompts_per_step ({cfg.allocation.prompts_per_step}) exceeds the "
                f"{len(self.world.train_ids)} train prompts"
            )
        self.policy = BanditPolicy(self.world, seed=cfg.world.seed, **cfg.policy.model_dump())
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.trainable, lr=cfg.trainer.lr)
        self.stats = PromptStats(rho=cfg.allocation.rho, prior_strength=cfg.allocation.prior_strength)
        self.resume()

    # ------------------------------------------------------------------ one step
    def rollout(self) -> dict[str, torch.Tensor]:
        """Select prompts, allocate the budget, sample and score; returns the flat batch."""
        a = self.cfg.allocation
        prompts = self.select_prompts(self.world.train_ids, a.prompts_per_step)
        counts = alloc_lib.allocate(
            self.stats, prompts, a.rollouts_per_step, method=a.method, n_min=a.n_min, n_max=a.n_max
        )
        prompt_idx = torch.repeat_interleave(torch.tensor(prompts), counts)  # [N]
        answers = self.policy.sample(prompt_idx, self.generator)
        rewards = self.world.reward(prompt_idx, answers)
        with torch.no_grad():
            old_logp = self.policy.log_prob(prompt_idx, answers)
        return {
            "prompt_idx": prompt_idx,
            "answers": answers,
            "rewards": rewards,
            "old_logp": old_logp,
            "counts": counts,
        }

    def train_step(self) -> dict[str, float]:
        t = self.cfg.trainer
        batch = self.rollout()
        prompt_idx, rewards = batch["prompt_idx"], batch["rewards"]
        estimator = get_estimator(t.advantage)
        prompts = prompt_idx.tolist()
        baseline = self.stats.value(prompts).float() if estimator.needs_baseline else None
        self.stats.update(prompts, rewards, step=self.step)
        result = estimator.fn(RewardBatch(rewards, prompt_idx, baseline=baseline), **t.advantage_options)
        adv = result.adv
        mask = result.keep_mask().float().unsqueeze(1)  # [N, 1]: samples the estimator excludes do not count
        for _ in range(t.ppo_epochs):
            logp = self.policy.log_prob(prompt_idx, batch["answers"])
            per_sample = loss_lib.clipped_surrogate(
                logp, batch["old_logp"], adv, eps_low=t.epsilon_low, eps_high=t.epsilon_high
            )
            loss = loss_lib.aggregate(per_sample.unsqueeze(1), mask, mode="token_mean")
            if t.beta > 0:
                ref_logp = self.reference.log_prob(prompt_idx, batch["answers"])
                kl = loss_lib.kl_estimate(logp, ref_logp, kind=t.kl_estimator)
                loss = loss + t.beta * loss_lib.aggregate(kl.unsqueeze(1), mask)
                self.metrics.add("policy/kl", kl.mean())
            loss.backward()
            # the shared step (rank averaging, train/grad_norm); the demo's recipe clips nothing
            self.optimizer_step(self.optimizer, self.trainable, max_grad_norm=math.inf)
            self.metrics.add("loss", loss)
            self.metrics.add_dict(
                loss_lib.clip_fractions(logp, batch["old_logp"], adv, t.epsilon_low, t.epsilon_high)
            )
        counts = batch["counts"]
        self.metrics.add("reward/mean", rewards.mean(), count=rewards.numel())
        self.metrics.add("train/effective_ratio", effective_ratio(rewards, prompt_idx))
        self.metrics.add("rollouts/per_prompt_max", counts.max().float())
        self.metrics.add("rollouts/per_prompt_min", counts.min().float())
        self.metrics.add("rollouts/total", counts.sum().float())
        return self.metrics.reduce()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact expected success (no sampling noise) on held-out and train prompts."""
        held = torch.tensor(self.world.heldout_ids)
        train = torch.tensor(self.world.train_ids)
        return {
            "eval/heldout_success": float(self.policy.success_prob(held, self.world.correct).mean()),
            "eval/train_success": float(self.policy.success_prob(train, self.world.correct).mean()),
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.base_state(),
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_base_state(state)
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self) -> None:
        if self.checkpoint_wanted():
            self.write_checkpoint(self.state_dict())


def main(cfg: BanditRecipeConfig) -> dict[str, float]:
    """Train end to end; returns the final metrics."""
    return run_recipe(cfg, BanditTrainer)
