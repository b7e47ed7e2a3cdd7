"""Video rewards: an image reward aggregated over frames, and CLIP temporal consistency.

``videos`` is a ``[B, T, 3, H, W]`` float tensor in [0, 1] or a list of ``B`` videos, each a list of PIL frames
or a ``[T, 3, H, W]`` tensor (videos may differ in length when given as a list).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rewards.base import Reward, RewardOutput
from rewards.clip import OpenClipReward, Precision, Tokenizer
from rewards.images import ImageBatch, check_image_tensor, check_prompts
from rewards.registry import build, register

VideoBatch = torch.Tensor | Sequence[ImageBatch]


def video_list(videos: VideoBatch, stride: int = 1) -> list[ImageBatch]:
    """Any accepted video batch -> list of frame batches (``[T, 3, H, W]`` tensors or lists of PIL)."""
    if isinstance(videos, torch.Tensor):
        if videos.ndim != 5:
            raise ValueError(f"videos must be a [B, T, 3, H, W] tensor, got shape {tuple(videos.shape)}")
        out: list[ImageBatch] = [
            check_image_tensor(v, f"videos[{i}]") for i, v in enumerate(videos.unbind(0))
        ]
    elif isinstance(videos, Sequence) and not isinstance(videos, str):
        out = [v if isinstance(v, torch.Tensor) else list(v) for v in videos]
    else:
        raise ValueError(
            f"videos must be a [B, T, 3, H, W] tensor or a list of frame lists, got {type(videos).__name__}"
        )
    out = [v[::stride] for v in out]
    for i, video in enumerate(out):
        if len(video) == 0:
            raise ValueError(f"videos[{i}] has no frames")
    return out


def all_frames(clips: list[ImageBatch]) -> ImageBatch:
    """Every frame of ``clips`` (from :func:`video_list`) in one image batch, video after video: a
    ``[sum T, 3, H, W]`` tensor when the clips are tensors of one frame size, else a list of frames."""
    if all(isinstance(c, torch.Tensor) for c in clips) and len({tuple(c.shape[1:]) for c in clips}) == 1:
        return torch.cat(list(clips))
    return [frame for clip in clips for frame in (clip.unbind(0) if isinstance(clip, torch.Tensor) else clip)]


@register("video_frames")
class FrameAggregate(Reward):
    """Any image reward applied to every frame (all frames of the batch in one call), aggregated per video:

        score(video) = mean_t r(frame_t, prompt)   or   min_t r(frame_t, prompt)

    ``min`` penalises a single bad frame (flicker, a broken frame) that the mean would hide.

    Args:
        reward: registry name of the image reward (built with ``reward_options``), or a built :class:`Reward`.
        reward_options: options of the image reward (``model_id``, ``device``, ...).
        aggregate: ``"mean"`` or ``"min"`` over frames.
        frame_stride: score every ``frame_stride``-th frame (1 = all), to bound the cost on long videos.

    Components: ``frame_mean`` and ``frame_min`` (both aggregates, whichever is the score), plus each component
    of the image reward averaged over frames.
    """

    def __init__(
        self,
        reward: str | Reward = "clip_score",
        reward_options: dict[str, Any] | None = None,
        aggregate: Literal["mean", "min"] = "mean",
        frame_stride: int = 1,
    ):
        if aggregate not in ("mean", "min"):
            raise ValueError(f"aggregate must be 'mean' or 'min', got {aggregate!r}")
        if frame_stride < 1:
            raise ValueError(f"frame_stride must be >= 1, got {frame_stride}")
        self.reward = build(reward, **(reward_options or {})) if isinstance(reward, str) else reward
        # the frames of the whole batch are the image reward's batch
        self.batch_dependent = self.reward.batch_dependent
        self.aggregate = aggregate
        self.frame_stride = frame_stride

    def score(self, *, videos: VideoBatch, prompts: Sequence[str] | None = None, **_: Any) -> RewardOutput:
        clips = video_list(videos, self.frame_stride)
        prompt_list = None if prompts is None else check_prompts(prompts, len(clips), self.name)
        if not clips:  # an empty batch scores nothing (and torch.stack refuses an empty list)
            empty = torch.zeros(0)
            return RewardOutput(scores=empty, components={"frame_mean": empty, "frame_min": empty})
        lengths = [len(c) for c in clips]
        # 1. all frames in one image batch, each frame with its video's prompt
        batch: dict[str, Any] = {"images": all_frames(clips)}
        if prompt_list is not None:
            batch["prompts"] = [p for p, n in zip(prompt_list, lengths, strict=True) for _ in range(n)]
        # 2. score every frame at once, 3. aggregate per video
        output = self.reward.score(**batch)
        per_video = output.scores.split(lengths)
        means = torch.stack([s.mean() for s in per_video])
        mins = torch.stack([s.min() for s in per_video])
        components = {"frame_mean": means, "frame_min": mins}
        for name, value in output.components.items():
            components[name] = torch.stack([v.mean() for v in value.split(lengths)])
        return RewardOutput(scores=means if self.aggregate == "mean" else mins, components=components)


@register("temporal_consistency")
class TemporalConsistency(OpenClipReward):
    """Mean CLIP cosine similarity of consecutive frames (the "CLIP-Temp" / frame-consistency metric of
    video generation benchmarks, e.g. EvalCrafter arXiv 2310.11440):

        score = 1/(T-1) * sum_{t=1}^{T-1} <e_t, e_{t+1}>,   e_t = f_img(frame_t) / |f_img(frame_t)|

    Prompts are not used. Components: ``min_pair``, the least similar consecutive pair (a cut or a jump).

    Args:
        model_name, pretrained, model, tokenizer, cache_dir, precision: the open-clip model, as in
            ``clip_score``.
        frame_stride: compare every ``frame_stride``-th frame.
        device, differentiable, batch_size: see :class:`rewards.images.ImageRewardBase` (``batch_size`` counts
            frames).

    Raises:
        ValueError: a video with fewer than 2 frames (after striding).
    """

    needs_prompts = False

    def __init__(
        self,
        model_name: str = "ViT-H-14",
        pretrained: str | None = "laion2b_s32b_b79k",
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
        frame_stride: int = 1,
        precision: Precision = "fp32",
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        if frame_stride < 1:
            raise ValueError(f"frame_stride must be >= 1, got {frame_stride}")
        super().__init__(
            model_name, pretrained, model, tokenizer, cache_dir, precision, device, differentiable, batch_size
        )
        self.frame_stride = frame_stride

    def score(self, *, videos: VideoBatch, **_: Any) -> RewardOutput:  # type: ignore[override]
        clips = video_list(videos, self.frame_stride)
        for i, clip in enumerate(clips):
            if len(clip) < 2:
                raise ValueError(
                    f"temporal_consistency needs >= 2 frames per video; videos[{i}] has {len(clip)}"
                )
        if not clips:  # an empty batch scores nothing (and torch.cat refuses an empty list)
            return self.finish(RewardOutput(scores=torch.zeros(0), components={"min_pair": torch.zeros(0)}))
        lengths = [len(c) for c in clips]
        frames = all_frames(clips)
        with self.grad_mode():
            embeds = torch.cat(
                [
                    self.image_features(frames[s : s + self.batch_size])
                    for s in range(0, len(frames), self.batch_size)
                ]
            )  # [sum T, D]
            sims = [F.cosine_similarity(e[:-1], e[1:], dim=-1) for e in embeds.split(lengths)]  # each [T-1]
            output = RewardOutput(
                scores=torch.stack([s.mean() for s in sims]),
                components={"min_pair": torch.stack([s.min() for s in sims])},
            )
        return self.finish(output)
