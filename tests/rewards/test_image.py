"""Image rewards against their reference formulas, computed with each library's own preprocessing."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import rewards
from rewards.images import clip_preprocess, pil_to_tensor


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    arrays = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arrays]


@pytest.fixture
def open_clip_model(open_clip_name, open_clip_weights):
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(
        open_clip_name, pretrained=str(open_clip_weights)
    )
    return model.eval(), preprocess, open_clip.get_tokenizer(open_clip_name)


def test_clip_score_is_cosine_with_open_clip_preprocessing(
    open_clip_model, open_clip_weights, open_clip_name, images, prompts
):
    model, preprocess, tokenizer = open_clip_model
    pil = to_pil(images)
    with torch.no_grad():
        f_img = F.normalize(model.encode_image(torch.stack([preprocess(p) for p in pil])), dim=-1)
        f_txt = F.normalize(model.encode_text(tokenizer(prompts)), dim=-1)
    expected = (f_img * f_txt).sum(-1)
    reward = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    torch.testing.assert_close(reward(images=pil, prompts=prompts), expected, rtol=1e-4, atol=1e-5)
    # the tensor path sees the same pixels once rounded to uint8
    rounded = torch.stack([pil_to_tensor(p) for p in pil])
    torch.testing.assert_close(reward(images=rounded, prompts=prompts), expected, rtol=1e-4, atol=1e-5)
    assert expected.abs().max() <= 1.0 and expected.std() > 0


def test_resize_matches_open_clip_transform(open_clip_model):
    """Larger, non-square images: our tensor transform vs open-clip's PIL transform (resize + centre crop)."""
    _, preprocess, _ = open_clip_model
    y, x = torch.meshgrid(torch.linspace(0, 1, 72), torch.linspace(0, 1, 90), indexing="ij")
    smooth = torch.stack([x, y, (x + y) / 2])  # [3, 72, 90], smooth so that resampling filters agree
    pil = to_pil(smooth[None])[0]
    cfg = open_clip_model[0].visual.preprocess_cfg
    ours = clip_preprocess(pil_to_tensor(pil)[None], cfg["size"], cfg["mean"], cfg["std"])[0]
    reference = preprocess(pil)
    assert ours.shape == reference.shape == (3, 32, 32)
    # resampling floats vs uint8 (PIL) differs by about one grey level: 1/255/std ~ 0.015
    assert (ours - reference).abs().max() < 0.05


def test_hpsv2_loads_checkpoint_and_scores_cosine(open_clip_name, hps_checkpoint, images, prompts):
    import open_clip

    reward = rewards.build("hpsv2", model_name=open_clip_name, checkpoint=str(hps_checkpoint))
    state = torch.load(hps_checkpoint, weights_only=True)["state_dict"]
    for key, value in reward.model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    model = open_clip.create_model(open_clip_name, output_dict=True).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        out = model(clip_preprocess(images, (32, 32), reward.mean, reward.std), reward.tokenizer(prompts))
    # HPSv2 score.py: diag(image_features @ text_features.T) of the (normalised) output_dict features
    expected = torch.diagonal(out["image_features"] @ out["text_features"].T)
    torch.testing.assert_close(reward(images=images, prompts=prompts), expected, rtol=1e-4, atol=1e-5)


def test_hpsv2_letterboxes_a_non_square_image(open_clip_name, hps_checkpoint, prompts):
    """HPSv2's scorer (img_score.py, light_augmentation=True) fits an image with ResizeMaxSize: the longer
    side resized to the model size, black padding around it; CLIP's centre crop would cut a landscape's
    sides."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    reward = rewards.build("hpsv2", model_name=open_clip_name, checkpoint=str(hps_checkpoint))
    y, x = torch.meshgrid(torch.linspace(0, 1, 32), torch.linspace(0, 1, 64), indexing="ij")
    landscape = torch.stack([x, y, 1 - x])  # [3, 32, 64], 1:2, smooth so that bicubic does not overshoot
    # ResizeMaxSize at size 32: 32 x 64 -> 16 x 32, then pad [left, top, right, bottom] = [0, 8, 0, 8] with 0
    resized = TF.resize(landscape, [16, 32], InterpolationMode.BICUBIC, antialias=True)
    letterbox = TF.pad(resized, padding=[0, 8, 0, 8], fill=0.0)
    assert letterbox.shape == (3, 32, 32) and letterbox[:, :8].abs().max() == 0
    with torch.no_grad():
        f_img = F.normalize(
            reward.model.encode_image(TF.normalize(letterbox, reward.mean, reward.std)[None]), dim=-1
        )
        f_txt = F.normalize(reward.model.encode_text(reward.tokenizer(prompts[:1])), dim=-1)
    expected = (f_img * f_txt).sum(-1)
    torch.testing.assert_close(
        reward(images=landscape[None], prompts=prompts[:1]), expected, rtol=1e-5, atol=1e-6
    )
    # a PIL image of the same pixels is letterboxed too (to within uint8 rounding)
    torch.testing.assert_close(
        reward(images=to_pil(landscape[None]), prompts=prompts[:1]), expected, atol=2e-3, rtol=0
    )
    # the centre crop scores another picture; a square image is resized alike in both modes
    crop = clip_preprocess(landscape[None], (32, 32), reward.mean, reward.std)
    assert not torch.allclose(crop, TF.normalize(letterbox, reward.mean, reward.std)[None], atol=0.1)
    square = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        clip_preprocess(square, (32, 32), reward.mean, reward.std, "longest"),
        clip_preprocess(square, (32, 32), reward.mean, reward.std, "shortest"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("recipe", ["flux2_dev_clip_pickscore", "flux2_dev_clip_pickscore_explore_nvfp4"])
def test_flux2_dev_recipes_use_flow_factorys_clip(recipe):
    """Flow-Factory's CLIP reward (rewards/clip.py) is openai/clip-vit-large-patch14 in bfloat16: ViT-L/14 at
    224 px with QuickGELU, OpenAI's weights; in open-clip, ViT-L-14-quickgelu / openai (the plain ViT-L-14
    config would run those weights with GELU)."""
    import open_clip
    import yaml

    path = Path(__file__).resolve().parents[2] / "configs" / "flow" / f"{recipe}.yaml"
    (clip,) = [r for r in yaml.safe_load(path.read_text())["rewards"] if r["name"] == "clip_score"]
    options = clip["options"]
    assert (options["model_name"], options["pretrained"], options["precision"]) == (
        "ViT-L-14-quickgelu",
        "openai",
        "bf16",
    )
    model_cfg = open_clip.get_model_config(options["model_name"])
    tag_cfg = open_clip.get_pretrained_cfg(options["model_name"], options["pretrained"])
    assert model_cfg["vision_cfg"] == {"image_size": 224, "layers": 24, "width": 1024, "patch_size": 14}
    assert model_cfg["quick_gelu"] is tag_cfg["quick_gelu"] is True
    assert tag_cfg["hf_hub"] == "timm/vit_large_patch14_clip_224.openai/"


def test_hpsv2_rejects_a_checkpoint_of_another_architecture(open_clip_name, tmp_path):
    path = tmp_path / "bad.pt"
    torch.save({"state_dict": {"logit_scale": torch.tensor(1.0)}}, path)
    with pytest.raises(ValueError, match="does not fit the model: missing"):
        rewards.build("hpsv2", model_name=open_clip_name, checkpoint=str(path))
    with pytest.raises(ValueError, match="version"):
        rewards.build("hpsv2", version="v3", model_name=open_clip_name, checkpoint=str(path))


def test_pickscore_matches_processor_path(hf_clip_dir, images, prompts):
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(hf_clip_dir).eval()
    processor = AutoProcessor.from_pretrained(hf_clip_dir)
    pil = to_pil(images)
    # the PickScore reference inference: processor -> embeddings -> normalise -> logit_scale.exp() * dot
    inputs = processor(
        images=pil, text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        img = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        txt = model.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).pooler_output
    expected = model.logit_scale.exp() * (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)
    reward = rewards.build("pickscore", model_id=str(hf_clip_dir), processor_id=str(hf_clip_dir))
    out = reward.score(images=pil, prompts=prompts)
    torch.testing.assert_close(out.scores, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.scores, model.logit_scale.exp() * out.components["cosine"])


def test_aesthetic_is_mlp_of_normalised_embedding(aesthetic_parts, images):
    from transformers import CLIPImageProcessor, CLIPModel

    from rewards.aesthetic import AestheticMLP

    path, head_path = aesthetic_parts
    model = CLIPModel.from_pretrained(path).eval()
    pixel_values = CLIPImageProcessor.from_pretrained(path)(images=to_pil(images), return_tensors="pt")[
        "pixel_values"
    ]
    head = AestheticMLP(16).eval()
    head.load_state_dict(torch.load(head_path, weights_only=True))
    assert sorted(head.state_dict()) == [
        f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("bias", "weight")
    ]
    with torch.no_grad():
        expected = head(
            F.normalize(model.get_image_features(pixel_values=pixel_values).pooler_output, dim=-1)
        )
    reward = rewards.build("aesthetic", clip_model_id=str(path), head_path=str(head_path))
    torch.testing.assert_close(reward(images=to_pil(images)), expected, rtol=1e-4, atol=1e-5)
    # dropout is off: scoring is deterministic
    torch.testing.assert_close(reward(images=images), reward(images=images), rtol=0, atol=0)


def test_differentiable_scores_pass_gradients_to_pixels_only(
    open_clip_name, open_clip_weights, images, prompts
):
    reward = rewards.build(
        "clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights), differentiable=True
    )
    pixels = images[:, :, :24, :28].clone().requires_grad_(True)  # odd size: gradient through the resize too
    reward(images=pixels, prompts=prompts).sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in reward.model.parameters())
    # and the default is no graph at all
    plain = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    assert not plain(images=pixels, prompts=prompts).requires_grad


def test_image_inputs_are_validated(open_clip_name, open_clip_weights, images, prompts):
    reward = rewards.build(
        "clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights), batch_size=3
    )
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(images=images, prompts=prompts[:3])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(images=images[:, :1], prompts=prompts)
    with pytest.raises(ValueError, match="needs prompts"):
        reward(images=images)
    # PIL images of different sizes and modes in one batch; chunked by batch_size=3
    mixed = [Image.new("L", (40, 30), 90), Image.new("RGBA", (32, 32)), *to_pil(images[:2])]
    assert reward(images=mixed, prompts=prompts).shape == (4,)


def test_imagereward_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ImageReward", None)  # makes `import ImageReward` raise ImportError
    with pytest.raises(ImportError, match=r"pip install mmrl\[imagereward\]"):
        rewards.build("imagereward")


def test_uint8_tensor_equals_float_tensor(open_clip_name, open_clip_weights, images, prompts):
    reward = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    as_uint8 = (images * 255).round().to(torch.uint8)
    torch.testing.assert_close(
        reward(images=as_uint8, prompts=prompts), reward(images=as_uint8.float() / 255, prompts=prompts)
    )
    assert np.isfinite(reward(images=as_uint8, prompts=prompts).numpy()).all()


def test_half_precision_open_clip(open_clip_name, open_clip_weights, images, prompts):
    full = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    half = rewards.build(
        "clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights), precision="bf16"
    )
    assert next(half.model.parameters()).dtype == torch.bfloat16
    scores = half(images=images, prompts=prompts)
    assert scores.dtype == torch.float32  # scores are float32 whatever the weights
    torch.testing.assert_close(scores, full(images=images, prompts=prompts), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="precision"):
        rewards.build(
            "clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights), precision="fp8"
        )


def test_half_precision_input_is_preprocessed_in_float32(images):
    """bf16/fp16 model input is the float32 transform cast after: antialiased bicubic has no half CPU kernel."""
    from rewards.images import prepare_pixels

    odd = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(6))
    geometry = ((32, 32), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    full = prepare_pixels(odd, *geometry, "cpu")
    for dtype in (torch.bfloat16, torch.float16):
        for batch in (odd, to_pil(odd)):
            half = prepare_pixels(batch, *geometry, "cpu", dtype)
            expected = full if isinstance(batch, torch.Tensor) else prepare_pixels(batch, *geometry, "cpu")
            assert half.dtype == dtype and half.shape == (2, 3, 32, 32)
            torch.testing.assert_close(half, expected.to(dtype), rtol=0, atol=0)


def _learned_reward_options(name: str, request) -> dict[str, str]:
    """The build options of a learned reward on this suite's tiny random models (conftest fixtures)."""
    if name == "pickscore":
        path = str(request.getfixturevalue("hf_clip_dir"))
        return {"model_id": path, "processor_id": path}
    if name == "aesthetic":
        path, head = request.getfixturevalue("aesthetic_parts")
        return {"clip_model_id": str(path), "head_path": str(head)}
    options = {"model_name": request.getfixturevalue("open_clip_name")}
    if name == "hpsv2":
        options["checkpoint"] = str(request.getfixturevalue("hps_checkpoint"))
    else:
        options["pretrained"] = str(request.getfixturevalue("open_clip_weights"))
    return options


@pytest.mark.parametrize(
    ("name", "half"),
    [
        ("clip_score", {"precision": "bf16"}),
        ("hpsv2", {"precision": "fp16"}),
        ("pickscore", {"dtype": "float16"}),
    ],
)
def test_half_precision_rewards_score_images_that_need_a_resize(name, half, request, prompts):
    options = _learned_reward_options(name, request)
    odd = torch.rand(4, 3, 48, 64, generator=torch.Generator().manual_seed(7))  # not the model's 32 x 32
    out = rewards.build(name, **options, **half).score(images=odd, prompts=prompts)
    full = rewards.build(name, **options).score(images=odd, prompts=prompts)
    cosine = out.components.get("cosine", out.scores)  # (pickscore's score is logit_scale * cosine)
    torch.testing.assert_close(cosine, full.components.get("cosine", full.scores), atol=0.05, rtol=0)


@pytest.mark.parametrize("name", ["clip_score", "hpsv2", "pickscore", "aesthetic"])
def test_every_learned_reward_is_differentiable_on_request(name, request, images, prompts):
    options = _learned_reward_options(name, request)
    reward = rewards.build(name, differentiable=True, batch_size=3, **options)
    pixels = images.clone().requires_grad_(True)
    scores = reward(images=pixels, prompts=prompts)
    scores.sum().backward()
    assert pixels.grad is not None
    assert (pixels.grad.flatten(1).abs().sum(1) > 0).all()  # every image gets a gradient, across chunks
    # the differentiable path computes the same scores as the default one
    plain = rewards.build(name, **options)
    torch.testing.assert_close(scores.detach(), plain(images=images, prompts=prompts), rtol=1e-5, atol=1e-5)


def test_16_bit_and_float_pil_images_are_scaled_to_8_bits_not_clipped():
    from rewards.images import images_to_uint8, pil_to_rgb

    # 16 bits: v8 = round(v * 255 / 65535): 32768 -> 127.502 -> 128, 65535 -> 255, 257 -> 1
    grey16 = Image.fromarray(np.array([[0, 257, 32768, 65535]], dtype=np.uint16))
    assert grey16.mode == "I;16"
    as_int32 = Image.fromarray(
        np.array([[0, 257, 32768, 65535]], dtype=np.int32)
    )  # mode I, as older PNGs open
    # float: v8 = round(v * 255), the [0, 1] range float tensors have: 0.5 -> 127.5 -> 128 (half to even)
    float01 = Image.fromarray(np.array([[0.0, 1 / 255, 0.5, 1.0]], dtype=np.float32))
    for image in (grey16, as_int32, float01):
        assert np.asarray(pil_to_rgb(image))[0].tolist() == [[0] * 3, [1] * 3, [128] * 3, [255] * 3]
    assert images_to_uint8([grey16])[0][0, 2].tolist() == [128, 128, 128]
    torch.testing.assert_close(pil_to_tensor(grey16)[:, 0, 2], torch.full((3,), 128 / 255))
    with pytest.raises(
        ValueError, match=r"images\[0\]: a float \(mode F\) image must hold values in \[0, 1\], got"
    ):
        images_to_uint8([Image.fromarray(np.array([[0.0, 255.0]], dtype=np.float32))])
    with pytest.raises(ValueError, match=r"holds values in \[-1, 70000\]"):
        pil_to_rgb(Image.fromarray(np.array([[-1, 70000]], dtype=np.int32)))


def test_16_bit_png_over_the_wire_decodes_scaled():
    import base64
    import io

    from rewards.wire import decode_batch

    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(buffer, format="PNG")
    _, batch = decode_batch({"images": [base64.b64encode(buffer.getvalue()).decode()]})
    assert batch["images"][0].mode == "RGB" and batch["images"][0].getpixel((3, 3)) == (128, 128, 128)


def _dark_to_light() -> torch.Tensor:
    """``[2, 3, 2, 2]`` images in [0, 1], each with both ends, 0 and 1."""
    image = torch.full((2, 3, 2, 2), 0.5)
    image[:, 0, 0, 0], image[:, 2, 1, 1] = 0.0, 1.0
    return image


def _with(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def put(images: torch.Tensor) -> torch.Tensor:
        images[1, 1, 0, 0] = value
        return images

    return put


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda x: x * 255, "must be float in [0, 1] (or uint8), got values in [0, 255]"),
        (lambda x: x * 2 - 1, "must be float in [0, 1] (or uint8), got values in [-1, 1]"),
        (lambda x: x * 1.01, "must be float in [0, 1] (or uint8), got values in [0, 1.01]"),
        (_with(float("nan")), "holds NaN or infinite values (range [nan, nan])"),
        (_with(float("-inf")), "holds NaN or infinite values (range [-inf, 1.0])"),
    ],
)
def test_float_images_outside_0_1_are_refused_naming_the_range(make, found):
    jpeg = rewards.build("jpeg_incompressibility")
    with pytest.raises(ValueError, match=re.escape(f"images {found}")):
        jpeg(images=make(_dark_to_light()))
    first_bad = 1 if "NaN" in found else 0  # (_with puts its value in the second image)
    with pytest.raises(ValueError, match=re.escape(f"images[{first_bad}] {found}")):
        jpeg(images=list(make(_dark_to_light())))  # an image of a list is named by its index


def test_a_refused_float_image_says_how_to_map_it():
    with pytest.raises(ValueError) as error:
        rewards.build("jpeg_incompressibility")(images=_dark_to_light() * 255)
    assert str(error.value) == (
        "images must be float in [0, 1] (or uint8), got values in [0, 255]: map [-1, 1] images with (x + 1) / 2 "
        "and [0, 255] ones with x / 255"
    )


def test_float_images_within_the_tolerance_are_accepted(images):
    from rewards.images import RANGE_TOLERANCE, check_image_tensor

    assert RANGE_TOLERANCE == 1e-3
    edge = images.clone()
    edge[0, 0, 0, :2] = torch.tensor([-0.0009, 1.0009])  # a decoder's rounding
    assert check_image_tensor(edge) is edge
    edge[0, 0, 0, 0] = -0.0011
    with pytest.raises(ValueError, match=r"got values in \[-0\.0011, 1\.001\]"):
        check_image_tensor(edge)
    assert check_image_tensor(torch.zeros(0, 3, 4, 4)).shape == (0, 3, 4, 4)  # an empty batch has no range


def _truncated_png() -> Image.Image:
    """A PNG cut in half: PIL opens it (the header is intact) and fails only when the pixels are read."""
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, "PNG")
    return Image.open(io.BytesIO(buffer.getvalue()[: len(buffer.getvalue()) // 2]))


class _SaysFive:
    def answer(self, requests, logprobs):
        from rewards.judge import JudgeAnswer

        return [JudgeAnswer("5") for _ in requests]


@pytest.mark.parametrize("name", ["clip_score", "jpeg_incompressibility", "shapes", "vlm_judge"])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: Image.new("RGB", (0, 0)), r"images\[2\] is empty \(0x0 pixels\)"),
        (lambda: Image.new("RGB", (0, 5)), r"images\[2\] is empty \(0x5 pixels\)"),
        (_truncated_png, r"images\[2\]: the image cannot be decoded \(image file is truncated"),
    ],
)
def test_an_empty_or_truncated_image_is_refused_by_its_index(
    name, bad, message, open_clip_name, open_clip_weights
):
    """Every image reward refuses it in the shared checks of rewards.images, naming its index in the batch,
    also where the batch is scored in chunks (clip_score, batch_size=1: the third chunk's image is
    images[2])."""
    options = {
        "clip_score": {"model_name": open_clip_name, "pretrained": str(open_clip_weights), "batch_size": 1},
        "vlm_judge": {"judge": _SaysFive()},
    }.get(name, {})
    reward = rewards.build(name, **options)
    good = Image.new("RGB", (32, 32), (200, 30, 30))
    with pytest.raises(ValueError, match=message):
        reward(images=[good, good, bad()], prompts=["a photo of a red circle"] * 3)


def test_a_tensor_batch_of_empty_images_is_refused(open_clip_name, open_clip_weights):
    reward = rewards.build("clip_score", model_name=open_clip_name, pretrained=str(open_clip_weights))
    with pytest.raises(ValueError, match=r"images has empty images \(shape \(2, 3, 0, 0\)\): .* H, W >= 1"):
        reward(images=torch.zeros(2, 3, 0, 0), prompts=["a", "b"])
    with pytest.raises(ValueError, match=r"images\[1\] has empty images \(shape \(1, 3, 4, 0\)\)"):
        reward(images=[torch.zeros(3, 4, 4), torch.zeros(3, 4, 0)], prompts=["a", "b"])
