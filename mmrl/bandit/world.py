"""A synthetic contextual bandit with a known optimum and a train/held-out split of prompts."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BanditPolicy", "BanditWorld"]


class BanditWorld:
    """Prompts ``x_i ~ N(0, I_d)``; the correct answer is ``argmax_k (x_i W*)_k`` for a hidden ``W*``.

    Args:
        num_prompts: total prompts; ``heldout_fraction`` of them (a seeded random subset) are never trained on.
        num_answers: K, the answers per prompt (chance success = 1/K).
        dim: feature dimension d.
        seed: seeds the world (features, ``W*``, split), independent of the training seed.
    """

    def __init__(
        self,
        num_prompts: int = 2000,
        num_answers: int = 8,
        dim: int = 16,
        heldout_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        if num_prompts < 2 or num_answers < 2 or dim < 1:
            raise ValueError("need num_prompts >= 2, num_answers >= 2, dim >= 1")
        if not 0 < heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        g = torch.Generator().manual_seed(seed)
        self.num_answers = num_answers
        self.features = torch.randn(num_prompts, dim, generator=g)  # [P, d]
        self.w_star = torch.randn(dim, num_answers, generator=g)  # [d, K]
        self.correct = (self.features @ self.w_star).argmax(-1)  # [P]
        order = torch.randperm(num_prompts, generator=g)
        n_held = max(1, round(heldout_fraction * num_prompts))
        self.heldout_ids = sorted(order[:n_held].tolist())
        self.train_ids = sorted(order[n_held:].tolist())

    def reward(self, prompt_idx: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """``[n]`` float rewards: 1 where the answer is correct."""
        return (answers == self.correct[prompt_idx]).float()


class BanditPolicy(nn.Module):
    """Softmax policy ``pi(k | x_i) = softmax(x_i W + b_i)_k``.

    ``kind="linear"`` trains the shared ``W`` (learning generalises to held-out prompts); ``kind="tabular"``
    freezes ``W`` and trains the per-prompt ``b`` only, so each prompt's success rate moves only when that
    prompt yields a learning signal (the setting of the allocation simulation).

    The initial ``W = init_scale * W* + init_noise * N(0, 1)`` is a weak "pretrained" policy whose success
    rates spread from near 0 to near 1 across prompts, where allocation matters.
    """

    def __init__(
        self,
        world: BanditWorld,
        kind: str = "linear",
        init_scale: float = 0.3,
        init_noise: float = 0.3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if kind not in ("linear", "tabular"):
            raise ValueError(f"kind must be 'linear' or 'tabular', got {kind!r}")
        g = torch.Generator().manual_seed(seed + 1)
        w0 = init_scale * world.w_star + init_noise * torch.randn(world.w_star.shape, generator=g)
        self.register_buffer("features", world.features.clone())
        self.weight = nn.Parameter(w0, requires_grad=kind == "linear")
        self.bias = nn.Parameter(
            torch.zeros(world.features.shape[0], world.num_answers), requires_grad=kind == "tabular"
        )

    def logits(self, prompt_idx: torch.Tensor) -> torch.Tensor:
        return self.features[prompt_idx] @ self.weight + self.bias[prompt_idx]  # [n, K]

    def log_prob(self, prompt_idx: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """``[n]`` log pi(answer | prompt)."""
        return torch.log_softmax(self.logits(prompt_idx), -1).gather(1, answers.unsqueeze(1)).squeeze(1)

    @torch.no_grad()
    def sample(self, prompt_idx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[n]`` sampled answers."""
        probs = torch.softmax(self.logits(prompt_idx), -1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    @torch.no_grad()
    def success_prob(self, prompt_idx: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
        """``[n]`` exact probability of answering correctly (the expected reward, no sampling noise)."""
        return (
            torch.softmax(self.logits(prompt_idx), -1).gather(1, correct[prompt_idx].unsqueeze(1)).squeeze(1)
        )
