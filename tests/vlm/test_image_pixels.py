"""EasyR1's image pixel bounds (data.min_pixels / data.max_pixels): images scaled, aspect ratio kept, before the
processor."""

import json

import pytest
from PIL import Image

from mmrl.config import load_config
from mmrl.data.vqa import fit_pixels, load_vqa
from mmrl.vlm.config import VLMRLVRConfig
from pipelines.vlm.inputs import VLMPrompt


def test_fit_pixels_scales_by_the_square_root_of_the_bound_and_keeps_images_inside_it():
    big = Image.new("RGB", (3000, 2000))  # 6,000,000 pixels; sqrt(4,194,304 / 6e6) = 0.836096
    assert fit_pixels(big, 262_144, 4_194_304).size == (2508, 1672)
    small = Image.new("RGB", (100, 50))  # 5,000 pixels; sqrt(262,144 / 5,000) = 7.240773
    assert fit_pixels(small, 262_144, 4_194_304).size == (724, 362)
    inside = Image.new("RGB", (640, 480))
    assert fit_pixels(inside, 262_144, 4_194_304) is inside
    assert fit_pixels(big) is big and fit_pixels(small, max_pixels=10_000) is small


def test_load_vqa_bounds_every_image_and_the_config_refuses_crossed_bounds(tmp_path):
    Image.new("RGB", (1200, 900), "red").save(tmp_path / "wide.png")
    Image.new("RGB", (20, 10), "blue").save(tmp_path / "tiny.png")
    rows = [{"question": "q", "answer": "1", "image": ["wide.png", "tiny.png"]}]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    [example] = load_vqa(str(tmp_path / "q.jsonl"), min_pixels=800, max_pixels=250_000)
    # sqrt(250,000 / 1,080,000) = 0.481125; sqrt(800 / 200) = 2
    assert [image.size for image in example.images] == [(577, 433), (40, 20)]
    assert example.images[0].getpixel((300, 200)) == (255, 0, 0)
    [unbounded] = load_vqa(str(tmp_path / "q.jsonl"))
    assert [image.size for image in unbounded.images] == [(1200, 900), (20, 10)]
    [generated] = load_vqa("shapes:train", limit=1, image_size=32, min_pixels=4096)
    assert generated.images[0].size == (64, 64)
    with pytest.raises(ValueError, match=r"data\.min_pixels \(10\) exceeds data\.max_pixels \(5\)"):
        load_config(VLMRLVRConfig, None, ["data.min_pixels=10", "data.max_pixels=5"])


def test_image_placeholders_place_the_images_and_must_match_them_one_to_one(tmp_path):
    """EasyR1's and verl's datasets (Geometry3K) mark each image's place with ``<image>`` in the problem text: the
    prompt puts an image slot there and drops the placeholder; a row whose placeholders and images differ in
    number is refused at load, naming the row."""
    Image.new("RGB", (32, 32), "red").save(tmp_path / "a.png")
    rows = [
        {
            "question": "Compare <image> with <image>. Which is red?",
            "answer": "1",
            "image": ["a.png", "a.png"],
        },
        {"question": "<image>Find x.", "answer": "2", "image": "a.png"},
        {"question": "Find y.", "answer": "3", "image": "a.png"},
    ]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    two, leading, plain = load_vqa(str(tmp_path / "q.jsonl"))
    assert VLMPrompt.from_question(two.question, two.images).messages[0]["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " with "},
        {"type": "image"},
        {"type": "text", "text": ". Which is red?"},
    ]
    assert VLMPrompt.from_question(leading.question, leading.images).messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Find x."},
    ]
    assert VLMPrompt.from_question(plain.question, plain.images).messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Find y."},
    ]
    rows[2]["question"] = "<image> or <image>?"
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(
        ValueError, match=r"q\.jsonl row 2: the question has 2 <image> placeholder\(s\) but 1 image"
    ):
        load_vqa(str(tmp_path / "q.jsonl"))
