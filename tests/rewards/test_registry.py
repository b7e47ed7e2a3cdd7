"""Every registered reward: built by name through its real loading code (tiny random weights from local
files), scores of shape [B], finite, deterministic, and independent of how the batch is split."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from rewards.server import ServerConfig, ServerThread

TEXT_BATCH = {
    "completions": [
        "<think>2+2</think><answer>4</answer>",
        "<think>hmm</think><answer>\\frac{1}{2}</answer>",
        "the answer is (B)",
        "no tags at all",
    ],
    "ground_truths": ["4", "0.5", "B", "7"],
}


@pytest.fixture(scope="module")
def jpeg_server():
    server = ServerThread(
        rewards.build("jpeg_incompressibility"), ServerConfig(reward="jpeg_incompressibility", port=0)
    )
    with server:
        yield server


def case(name: str, request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """(build options, batch) for the reward registered as ``name``."""
    images = request.getfixturevalue("images")
    prompts = request.getfixturevalue("prompts")
    image_batch = {"images": images, "prompts": prompts}
    videos = images.view(2, 2, *images.shape[1:])  # [B=2, T=2, 3, H, W]
    video_batch = {"videos": videos, "prompts": prompts[:2]}
    if name in ("clip_score", "temporal_consistency"):
        options = {
            "model_name": request.getfixturevalue("open_clip_name"),
            "pretrained": str(request.getfixturevalue("open_clip_weights")),
        }
        return options, image_batch if name == "clip_score" else video_batch
    if name == "hpsv2":
        options = {
            "model_name": request.getfixturevalue("open_clip_name"),
            "checkpoint": str(request.getfixturevalue("hps_checkpoint")),
        }
        return options, image_batch
    if name == "pickscore":
        path = str(request.getfixturevalue("hf_clip_dir"))
        return {"model_id": path, "processor_id": path}, image_batch
    if name == "aesthetic":
        path, head = request.getfixturevalue("aesthetic_parts")
        return {"clip_model_id": str(path), "head_path": str(head)}, {"images": images}
    if name == "imagereward":
        if importlib.util.find_spec("ImageReward") is None:
            pytest.skip("image-reward is an optional extra, not installed here")
        pytest.skip("ImageReward's loader downloads its weights; no download here")
    if name == "ocr":
        if importlib.util.find_spec("rapidocr_onnxruntime") is None:
            pytest.skip("rapidocr-onnxruntime is an optional extra (mmrl[ocr]), not installed here")
        targets = [{"target": t} for t in ("42", "sign", "7", "ab")]
        return {"mode": "recognize", "threads": 1}, {"images": images, "metadata": targets}
    if name in ("vlm_judge", "vlm_judge_pairwise"):
        vlm = str(Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm")
        # distinct prompts: a pairwise group is the samples sharing a prompt, so here every sample is alone
        # and its score cannot depend on how the batch is split
        judged = [f"a photo of a {o}" for o in ("red circle", "blue square", "green triangle", "grey circle")]
        return {"backend": "transformers", "model_path": vlm, "max_tokens": 8}, {
            "images": images,
            "prompts": judged,
        }
    if name == "video_frames":
        return {"reward": "jpeg_incompressibility", "aggregate": "min"}, video_batch
    if name == "remote":
        return {"url": request.getfixturevalue("jpeg_server").url, "retries": 0}, image_batch
    if name in ("jpeg_compressibility", "jpeg_incompressibility"):
        return {}, image_batch
    if name == "shapes":  # its own prompt grammar
        shapes_prompts = [
            "a photo of a red circle",
            "a photo of two squares",
            "a photo of a blue square left of a red circle",
            "a photo of a green triangle and a yellow circle",
        ]
        return {}, {"images": images, "prompts": shapes_prompts}
    if name in ("exact_match", "numeric", "math_verify", "multiple_choice", "format"):
        return {}, TEXT_BATCH
    if name == "reasoning_steps":  # the reference solution of each question
        return {}, {**TEXT_BATCH, "references": ["2+2=4", "1/2=0.5. x=1", "b", "7"]}
    raise AssertionError(f"no test case for reward {name!r}: add one here")


def batch_len(batch: dict[str, Any]) -> int:
    return len(next(iter(batch.values())))


def split(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in batch.items()}


@pytest.mark.parametrize("name", rewards.list_rewards())
def test_every_reward_shape_determinism_batch_split(name: str, request: pytest.FixtureRequest) -> None:
    options, batch = case(name, request)
    reward = rewards.build(name, **options)
    B = batch_len(batch)
    out = reward.score(**batch)
    assert out.scores.shape == (B,)
    assert out.scores.dtype == torch.float32
    assert torch.isfinite(out.scores).all()
    for value in out.components.values():
        assert value.shape == (B,)
    if out.reasons is not None:
        assert len(out.reasons) == B
    # deterministic: the same batch scores the same
    torch.testing.assert_close(reward(**batch), out.scores, rtol=0, atol=0)
    # a sample's score does not depend on its batch neighbours
    half = B // 2
    parts = torch.cat([reward(**split(batch, 0, half)), reward(**split(batch, half, B))])
    torch.testing.assert_close(parts, out.scores, rtol=1e-5, atol=1e-5)


def test_unknown_name_lists_the_available_ones() -> None:
    with pytest.raises(KeyError, match=r"Available: .*clip_score"):
        rewards.build("clip_scroe")


def test_shipped_server_configs_validate(monkeypatch):
    import yaml

    from rewards.server import ServerConfig

    monkeypatch.setenv("MMRL_REWARD_TOKEN", "secret")
    paths = sorted((Path(__file__).resolve().parents[2] / "configs/reward_server").glob("*.yaml"))
    assert paths
    for path in paths:
        ServerConfig.model_validate(yaml.safe_load(path.read_text()))
