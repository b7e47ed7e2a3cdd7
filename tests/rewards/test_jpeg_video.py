"""JPEG (in)compressibility against hand-checked sizes; video aggregation and temporal consistency."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import rewards

# A baseline JFIF file from Pillow at quality 95 is 625 bytes of headers (SOI 2, APP0 18, two DQT 2x69,
# SOF0 19, four DHT 2x33 + 2x183, SOS 14, EOI 2) plus the entropy-coded scan. A 16x16 solid image is one
# 4:2:0 MCU (4 Y + Cb + Cr blocks, DC only): 6 bytes of scan. Checked by walking the markers of the file.
HEADER_BYTES = 2 + 18 + 2 * 69 + 19 + 2 * 33 + 2 * 183 + 14 + 2
BLACK_16_BYTES = HEADER_BYTES + 6


def test_jpeg_black_image_hand_checked() -> None:
    assert BLACK_16_BYTES == 631
    black = torch.zeros(1, 3, 16, 16)
    incompress = rewards.build("jpeg_incompressibility").score(images=black)
    torch.testing.assert_close(incompress.scores, torch.tensor([0.631]))  # kB = 1000 bytes, not KiB
    torch.testing.assert_close(incompress.components["jpeg_kb"], torch.tensor([0.631]))
    torch.testing.assert_close(rewards.build("jpeg_compressibility")(images=black), torch.tensor([-0.631]))


def _encoded_kb(array: np.ndarray, quality: int) -> float:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000


def test_jpeg_sizes_follow_the_formula_and_order() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    flat = np.full((64, 64, 3), 128, dtype=np.uint8)
    pil = [Image.fromarray(noise), Image.fromarray(flat)]
    scores = rewards.build("jpeg_incompressibility")(images=pil)
    torch.testing.assert_close(scores, torch.tensor([_encoded_kb(noise, 95), _encoded_kb(flat, 95)]))
    # noise barely compresses (~5.4 kB of 12.3 kB raw; 4:2:0 subsampling drops 3/4 of the chroma); a flat
    # image is almost all header
    assert 5.0 < scores[0] < 6.0 and scores[1] < 0.7
    low = rewards.build("jpeg_incompressibility", quality=50)(images=pil)
    assert low[0] < scores[0] / 2
    with pytest.raises(ValueError, match="quality"):
        rewards.build("jpeg_compressibility", quality=0)


def test_jpeg_compressibility_is_on_ddpos_scale_and_flow_grpos_divides_by_500() -> None:
    """DDPO scores -size_kB, Flow-GRPO -size_kB / 500: the same advantages within a group, not in a sum."""
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    images[1] = 0.5  # flat: small file
    kb = rewards.build("jpeg_incompressibility").score(images=images).components["jpeg_kb"]
    ddpo = rewards.build("jpeg_compressibility")(images=images)
    torch.testing.assert_close(ddpo, -kb, rtol=0, atol=0)

    def advantages(r: torch.Tensor) -> torch.Tensor:
        return (r - r.mean()) / r.std()

    flow_grpo = -kb / 500
    torch.testing.assert_close(advantages(ddpo), advantages(flow_grpo))
    other = torch.tensor([0.30, 0.10, 0.20])  # another reward of weight 1
    assert not torch.allclose(advantages(ddpo + other), advantages(flow_grpo + other), atol=0.1)
    torch.testing.assert_close(advantages(ddpo / 500 + other), advantages(flow_grpo + other))


def test_jpeg_tensor_rounding_as_ddpo() -> None:
    # 0.5 * 255 = 127.5 rounds to 128 (round half to even keeps 128): the same bytes as a PIL image of 128
    tensor = torch.full((1, 3, 24, 24), 0.5)
    pil = [Image.fromarray(np.full((24, 24, 3), 128, dtype=np.uint8))]
    reward = rewards.build("jpeg_compressibility")
    torch.testing.assert_close(reward(images=tensor), reward(images=pil), rtol=0, atol=0)


def test_video_frames_mean_and_min_of_frame_scores() -> None:
    rng = np.random.default_rng(1)
    flat = torch.full((3, 32, 32), 0.25)
    noisy = torch.from_numpy(rng.random((3, 32, 32), dtype=np.float32))
    videos = torch.stack(
        [torch.stack([flat, noisy, flat]), torch.stack([noisy, noisy, noisy])]
    )  # [2, 3, 3, H, W]
    per_frame = rewards.build("jpeg_incompressibility")(images=videos.flatten(0, 1)).view(2, 3)
    mean = rewards.build("video_frames", reward="jpeg_incompressibility").score(videos=videos)
    torch.testing.assert_close(mean.scores, per_frame.mean(1))
    torch.testing.assert_close(mean.components["frame_min"], per_frame.min(1).values)
    torch.testing.assert_close(mean.components["jpeg_kb"], per_frame.mean(1))
    worst = rewards.build("video_frames", reward="jpeg_incompressibility", aggregate="min", frame_stride=2)
    torch.testing.assert_close(worst(videos=videos), per_frame[:, ::2].min(1).values)
    # lists of PIL frames, of different lengths
    as_pil = [
        [Image.fromarray((f.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for f in v]
        for v in videos
    ]
    torch.testing.assert_close(
        rewards.build("video_frames", reward="jpeg_incompressibility")(videos=[as_pil[0], as_pil[1][:2]]),
        torch.stack([per_frame[0].mean(), per_frame[1, :2].mean()]),
    )
    with pytest.raises(ValueError, match="aggregate"):
        rewards.build("video_frames", reward="jpeg_incompressibility", aggregate="median")


def test_video_frames_pass_prompts_per_frame(open_clip_name, open_clip_weights, prompts) -> None:
    clip = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    frames = torch.rand(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    expected = torch.stack([clip(images=frames[i], prompts=[prompts[i]] * 3).mean() for i in range(2)])
    reward = rewards.build("video_frames", reward=clip)
    torch.testing.assert_close(reward(videos=frames, prompts=prompts[:2]), expected, rtol=1e-5, atol=1e-6)


def test_temporal_consistency(open_clip_name, open_clip_weights) -> None:
    reward = rewards.build(
        "temporal_consistency", model_name=open_clip_name, pretrained=str(open_clip_weights)
    )
    g = torch.Generator().manual_seed(5)
    a, b = torch.rand(3, 32, 32, generator=g), torch.rand(3, 32, 32, generator=g)
    static = torch.stack([a, a, a, a])
    cut = torch.stack([a, a, b, b])
    out = reward.score(videos=torch.stack([static, cut]))
    e = reward.image_features(torch.stack([a, b]))
    cos_ab = (e[0] * e[1]).sum()
    torch.testing.assert_close(
        out.scores, torch.stack([torch.tensor(1.0), (2 + cos_ab) / 3]), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        out.components["min_pair"], torch.stack([torch.tensor(1.0), cos_ab]), atol=1e-5, rtol=1e-5
    )
    assert cos_ab < 0.999  # different frames are told apart
    with pytest.raises(ValueError, match=">= 2 frames"):
        reward(videos=static[None, :1])


def test_video_rewards_score_an_empty_batch_as_empty(open_clip_name, open_clip_weights) -> None:
    """As image rewards do (``jpeg(images=[])`` is an empty tensor), not a torch.stack error."""
    frames = rewards.build("video_frames", reward="jpeg_incompressibility").score(videos=[], prompts=[])
    assert frames.scores.shape == (0,) and frames.components["frame_min"].shape == (0,)
    temporal = rewards.build(
        "temporal_consistency", model_name=open_clip_name, pretrained=str(open_clip_weights)
    ).score(videos=torch.zeros(0, 2, 3, 32, 32))
    assert temporal.scores.shape == (0,) and temporal.components["min_pair"].shape == (0,)
