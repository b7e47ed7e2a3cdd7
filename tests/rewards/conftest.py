"""Tiny random-weight models for the reward tests, built once per session and saved to disk, so that every
reward is built through its real loading code (local paths instead of hub ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_OPEN_CLIP = "mmrl-tiny-clip"
# the CLIP BPE vocabulary (49408) with 1-layer 32-wide towers: ~1.6 M parameters, forwards in milliseconds
TINY_OPEN_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
TINY_SIZE = 32


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # the machine is shared; tiny models gain nothing from threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def open_clip_name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Register the tiny open-clip architecture (the model name is the config file's stem)."""
    import open_clip

    path = tmp_path_factory.mktemp("open_clip") / f"{TINY_OPEN_CLIP}.json"
    path.write_text(json.dumps(TINY_OPEN_CLIP_CFG))
    open_clip.add_model_config(path)
    return TINY_OPEN_CLIP


def _open_clip_state(name: str, seed: int) -> dict[str, torch.Tensor]:
    import open_clip

    torch.manual_seed(seed)
    return open_clip.create_model(name, pretrained=None).state_dict()


@pytest.fixture(scope="session")
def open_clip_weights(open_clip_name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local 'pretrained' file for the tiny architecture (open-clip loads a file path as pretrained)."""
    path = tmp_path_factory.mktemp("open_clip_weights") / "tiny.pt"
    torch.save(_open_clip_state(open_clip_name, seed=0), path)
    return path


@pytest.fixture(scope="session")
def hps_checkpoint(open_clip_name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in the HPSv2 release format, ``{"state_dict": ...}``."""
    path = tmp_path_factory.mktemp("hps") / "HPS_tiny.pt"
    torch.save({"state_dict": _open_clip_state(open_clip_name, seed=1)}, path)
    return path


def clip_tokenizer():
    """A transformers CLIPTokenizer with the real CLIP BPE vocabulary, built offline from open-clip's copy."""
    from open_clip.tokenizer import SimpleTokenizer
    from transformers import CLIPTokenizer

    simple = SimpleTokenizer()
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    return CLIPTokenizer(
        vocab=simple.encoder,
        merges=[tuple(m) for m in merges],
        bos_token="<start_of_text>",
        eos_token="<end_of_text>",
        unk_token="<end_of_text>",
        pad_token="<end_of_text>",
    )


def clip_image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": TINY_SIZE}, crop_size={"height": TINY_SIZE, "width": TINY_SIZE}
    )


@pytest.fixture(scope="session")
def hf_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny transformers CLIPModel + CLIPProcessor saved as a local 'hub' directory (the PickScore layout)."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={**tower, "vocab_size": 49408, "max_position_embeddings": 77},
        vision_config={**tower, "image_size": TINY_SIZE, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("pickscore")
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=clip_image_processor(), tokenizer=clip_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def aesthetic_parts(hf_clip_dir: Path) -> tuple[Path, Path]:
    """(directory of a tiny CLIPModel + image processor, MLP head state-dict file)."""
    from rewards.aesthetic import AestheticMLP

    torch.manual_seed(3)
    head_path = hf_clip_dir / "aesthetic-head.pth"
    torch.save(AestheticMLP(16).state_dict(), head_path)
    return hf_clip_dir, head_path


@pytest.fixture
def images() -> torch.Tensor:
    """``[4, 3, 32, 32]`` seeded random images in [0, 1]."""
    return torch.rand(4, 3, TINY_SIZE, TINY_SIZE, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def prompts() -> list[str]:
    return ["a red circle", "two blue squares", "a green triangle above a red circle", "three yellow circles"]
