"""The OCR reward: Flow-GRPO's score formula by hand, and the real PP-OCR model (rapidocr-onnxruntime) reading
PIL renders of known text."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.ocr import levenshtein, normalise_text, ocr_similarity, quoted_text, render_text

needs_rapidocr = pytest.mark.skipif(
    importlib.util.find_spec("rapidocr_onnxruntime") is None,
    reason="rapidocr-onnxruntime is an optional extra (mmrl[ocr]), not installed here",
)

WORDS = ["hello", "mmrl", "river", "GRPO", "flow", "reward", "open sky", "cat", "Stop", "night", "42", "2026"]
DIGITS = [
    "0",
    "7",
    "13",
    "42",
    "64",
    "90",
    "316",
    "555",
    "800",
    "2026",
    "4096",
    "7391",
    "08",
    "29",
    "71",
    "1",
]


def test_quoted_text_takes_the_first_span() -> None:
    assert quoted_text('a sign that says "Hello World" and "x"') == "Hello World"
    assert quoted_text("a neon sign “OPEN 24h” at night") == "OPEN 24h"
    assert quoted_text('empty "" quotes') == ""
    assert quoted_text("no quotes at all") is None


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("42", "24", 2),
        ("ab", "ba", 2),
    ],
)
def test_levenshtein_known_values(a: str, b: str, distance: int) -> None:
    assert levenshtein(a, b) == distance == levenshtein(b, a)


def test_ocr_similarity_formula() -> None:
    assert normalise_text(" Hello\u3000 World\n") == "helloworld"
    assert ocr_similarity("Hello World", "hello world") == 1.0
    # the target inside longer text counts as read
    assert ocr_similarity("EXIT 42 left", "42") == 1.0
    # one substitution in 4 characters: 1 - 1/4
    assert ocr_similarity("2O26", "2026") == pytest.approx(0.75)
    # one deletion in 5: 1 - 1/5
    assert ocr_similarity("helo", "hello") == pytest.approx(0.8)
    # unrelated text costs at most the whole target
    assert ocr_similarity("completely different words", "42") == 0.0
    assert ocr_similarity("", "47") == 0.0
    with pytest.raises(ValueError, match="empty"):
        ocr_similarity("x", "  ")


@needs_rapidocr
def test_targets_from_metadata_or_prompt_and_clear_errors() -> None:
    reward = rewards.build("ocr", mode="recognize", threads=1)
    assert reward.targets(2, ['a sign "47"', "plain"], [{}, {"target": "x"}]) == ["47", "x"]
    with pytest.raises(ValueError, match=r"sample 1 has no target text: prompt 'plain'"):
        reward.targets(2, ['a sign "47"', "plain"], None)
    with pytest.raises(ValueError, match="one entry of prompts per image"):
        reward.targets(2, ['"a"'], None)


@needs_rapidocr
def test_an_empty_target_is_refused_before_anything_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reward = rewards.build("ocr", mode="recognize", threads=1)
    reward.check_prompt('a sign that says "hi"')
    with pytest.raises(ValueError, match=r"its quoted target ' ' is empty once whitespace is removed"):
        reward.check_prompt('a blank sign that says " "')
    with pytest.raises(ValueError, match=r"first double-quoted span, and 'a blank sign' has none"):
        reward.check_prompt("a blank sign")

    def read(images: object) -> list[str]:
        raise AssertionError("the OCR ran on a batch it cannot score")

    monkeypatch.setattr(reward, "read", read)
    image = render_text("hi", 64, 32, 20)
    with pytest.raises(ValueError, match=r"the quoted target of prompt 1 '' is empty"):
        reward.score(images=[image, image], prompts=['"hi"', 'a blank sign that says ""'])
    with pytest.raises(ValueError, match=r"metadata\[0\]\['target'\] '\\n' is empty"):
        reward.score(images=[image], metadata=[{"target": "\n"}])


@needs_rapidocr
def test_recognize_mode_reads_each_image_alone_whatever_the_batch() -> None:
    """The recogniser pads the crops of one call to the widest of them: read in one call with a long line,
    this noisy "Hello 47" loses its last character ("Hello 4", 6/7). Read alone, as Flow-GRPO reads each
    image, it scores the same in any batch."""
    reward = rewards.build("ocr", mode="recognize", threads=1)
    pixels = np.asarray(render_text("Hello 47", 140, 40, 20)).astype(np.float32)
    noise = np.random.default_rng(2).normal(0, 40, pixels.shape)
    noisy = Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))
    wide = render_text("the quick brown fox jumps over the lazy dog again and again", 1400, 48, 28)
    alone = reward.score(images=[noisy], prompts=['"Hello 47"'])
    together = reward.score(images=[noisy, wide], prompts=['"Hello 47"', '"the quick brown fox"'])
    assert alone.scores.tolist() == [1.0] and alone.reasons == [None]
    assert together.scores.tolist() == [1.0, 1.0] and together.reasons == [None, None]


@needs_rapidocr
def test_detect_mode_reads_clean_word_renders() -> None:
    reward = rewards.build("ocr", threads=1)
    images = [render_text(word, 256, 96, 40) for word in WORDS]
    prompts = [f'a white card with "{word}" written on it' for word in WORDS]
    out = reward.score(images=images, prompts=prompts)
    exact = out.components["exact"]
    assert exact.mean().item() >= 0.95, list(zip(WORDS, out.reasons, strict=True))
    assert torch.equal(out.scores == 1.0, exact == 1.0)


@needs_rapidocr
@pytest.mark.parametrize("size", [12, 22])
def test_recognize_mode_reads_small_digit_renders(size: int) -> None:
    reward = rewards.build("ocr", mode="recognize", threads=1, batch_size=8)
    images = [render_text(d, 64, 32, size) for d in DIGITS]  # upscaled to 64 px high inside
    out = reward.score(images=images, metadata=[{"target": d} for d in DIGITS])
    assert out.components["exact"].mean().item() >= 0.95, list(zip(DIGITS, out.reasons, strict=True))
    # a tensor batch in [0, 1] reads the same as the PIL images
    tensor = torch.stack([torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1) for im in images]).float()
    torch.testing.assert_close(
        reward(images=tensor / 255, metadata=[{"target": d} for d in DIGITS]), out.scores
    )


@needs_rapidocr
@pytest.mark.parametrize("mode", ["detect", "recognize"])
def test_blank_and_noise_score_about_zero(mode: str) -> None:
    reward = rewards.build("ocr", mode=mode, threads=1)
    rng = np.random.default_rng(0)
    images = [Image.new("RGB", (128, 64), colour) for colour in ("white", "black", (120, 30, 200))]
    images += [Image.fromarray(rng.integers(0, 256, (64, 128, 3), dtype=np.uint8)) for _ in range(3)]
    targets = ["hello", "2026", "river", "flow", "47", "mmrl"]
    out = reward.score(images=images, prompts=[f'a sign with "{t}"' for t in targets])
    assert out.scores.max().item() <= 0.25, list(zip(targets, out.reasons, strict=True))
    assert out.components["exact"].sum().item() == 0
    blank_reasons = out.reasons[:3]
    assert all(r is not None and r.startswith("nothing read") for r in blank_reasons), blank_reasons


@needs_rapidocr
def test_wrong_text_is_scored_by_edit_distance_with_a_reason() -> None:
    reward = rewards.build("ocr", mode="recognize", threads=1)
    out = reward.score(images=[render_text("2027", 128, 48, 30)], prompts=['the year "2026"'])
    assert out.scores.tolist() == [pytest.approx(0.75)]  # one substitution in 4
    assert out.reasons == ["read '2027', expected '2026'"]


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install mmrl\[ocr\]"):
        rewards.build("ocr")
