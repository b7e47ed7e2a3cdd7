"""ImageReward (Xu et al. 2023, arXiv 2304.05977): a BLIP-based human-preference reward.

Optional: needs the ``image-reward`` package (``pip install mmrl[imagereward]``), imported only when the reward
is built. Its own loader downloads the weights (``ImageReward.load("ImageReward-v1.0")``) or reads a local
``.pt`` file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rewards.base import Reward, RewardOutput
from rewards.images import ImageBatch, batch_size_of, check_prompts, images_to_pil
from rewards.registry import register

INSTALL_HINT = "the 'imagereward' reward needs the image-reward package: pip install mmrl[imagereward]"


@register("imagereward")
class ImageRewardScore(Reward):
    """ImageReward score of each (image, prompt) pair, as returned by ``ImageReward.score`` (a standardised
    preference logit: about 0 on average images, higher is better).

    Not differentiable through this wrapper (the package preprocesses PIL images itself).

    Args:
        model_id: ``"ImageReward-v1.0"`` or a local checkpoint path (``ImageReward.load``'s ``name``).
        download_root: where the package caches its download (its default when ``None``).
        med_config: the BLIP text-encoder config file for a local checkpoint (the package's default when None).
        device: torch device.

    Raises:
        ImportError: the image-reward package is not installed (with the pip command that installs it).
    """

    def __init__(
        self,
        model_id: str = "ImageReward-v1.0",
        download_root: str | None = None,
        med_config: str | None = None,
        device: str | torch.device = "cpu",
    ):
        try:
            import ImageReward
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        options: dict[str, Any] = {"device": str(device)}
        if download_root is not None:
            options["download_root"] = download_root
        if med_config is not None:
            options["med_config"] = med_config
        self.model = ImageReward.load(model_id, **options).eval()

    @torch.no_grad()
    def score(self, *, images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> RewardOutput:
        prompt_list = check_prompts(prompts, batch_size_of(images), self.name)
        pil = images_to_pil(images)
        # the package scores one prompt against a list of images: group samples that share a prompt
        scores = torch.empty(len(pil), dtype=torch.float32)
        for prompt in dict.fromkeys(prompt_list):
            index = [i for i, p in enumerate(prompt_list) if p == prompt]
            values = self.model.score(prompt, [pil[i] for i in index])
            values = values if isinstance(values, list) else [values]
            scores[index] = torch.tensor(values, dtype=torch.float32)
        return RewardOutput(scores=scores)
