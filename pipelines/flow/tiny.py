"""Tiny, randomly initialised instances of every supported diffusers pipeline family, built offline.

No weights can be downloaded where mmrl is tested, so tests (and the shapes world's text-to-image model) build
the *real* diffusers / transformers classes from small configs: the same transformer, VAE and text-encoder
classes as every registered family's published checkpoints (SD3.5, FLUX.1, FLUX.2 and FLUX.2 [klein], SANA,
Qwen-Image, Z-Image, Wan2.1 and Wan2.2; ``FAMILIES`` lists them), only with a few thousand parameters.
Tokenizers are trained here with the ``tokenizers`` library on a small corpus and wrapped as the transformers
tokenizer classes the real pipelines load (CLIP BPE, T5 unigram, Gemma BPE, Qwen2 BPE, Pixtral).

A built pipeline is meant to be ``save_pretrained`` to a directory and loaded back through an adapter's
``from_pretrained(directory)``, which is the code path users run with hub ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from diffusers import (
    AutoencoderDC,
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

# A few prompts so that trained tokenizers cover ordinary words; any corpus works, unknown words fall back to
# characters (every lower-case letter is in the initial alphabet).
DEFAULT_CORPUS: tuple[str, ...] = (
    "a photo of a red circle",
    "a photo of two blue squares",
    "a photo of a green triangle left of a yellow circle",
    "a cat sitting on a mat",
    "a painting of a mountain lake at sunset",
    "an astronaut riding a horse",
)
_ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789.,'-")
_QWEN_CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
# Qwen3's chat format for one user turn and the assistant's opening (what ZImagePipeline applies, thinking on)
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# QwenImagePipeline's prompt template (its ``prompt_template_encode``) with an empty prompt
_QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    "<|im_start|>assistant\n"
)

#: output sizes the tiny models are built for: 32x32 images, 5 frames of 16x16 video
IMAGE_SIZE: dict[str, int] = {"height": 32, "width": 32}
VIDEO_SIZE: dict[str, int] = {"height": 16, "width": 16, "num_frames": 5}


@dataclass(frozen=True)
class TinyFamily:
    """How tests build and load one family's tiny pipeline.

    Attributes:
        build: ``build(corpus) -> pipeline``, the real diffusers pipeline class with random tiny components.
        sizes: the ``height``/``width`` (and ``num_frames``) it is built for.
        load_kwargs: adapter ``from_pretrained`` options: short text sequences keep tiny forwards fast (and
            switch off SANA's long default instruction prefix for the same reason).
    """

    build: Callable[[Sequence[str]], DiffusionPipeline]
    sizes: dict[str, int]
    load_kwargs: dict[str, Any]


_TINY_FAMILIES: dict[str, TinyFamily] = {}

B = TypeVar("B", bound=Callable[..., DiffusionPipeline])


def tiny_family(name: str, sizes: dict[str, int] = IMAGE_SIZE, **load_kwargs: Any) -> Callable[[B], B]:
    """Register the decorated builder as family ``name``'s tiny pipeline (a new family: its builder here, with
    this decorator, beside its adapter file)."""

    def register(build: B) -> B:
        _TINY_FAMILIES[name] = TinyFamily(build, dict(sizes), load_kwargs)
        return build

    return register


# --------------------------------------------------------------------------------------------------------------
# Tokenizers trained offline
# --------------------------------------------------------------------------------------------------------------


def train_clip_tokenizer(
    corpus: Sequence[str], vocab_size: int = 256, model_max_length: int = 77
) -> CLIPTokenizer:
    """Train a CLIP-style byte-pair tokenizer (words end in ``</w>``) and wrap it as ``CLIPTokenizer``.

    Args:
        corpus: training text; its words become whole tokens when ``vocab_size`` allows.
        vocab_size: upper bound of the vocabulary (special tokens and the alphabet included).
        model_max_length: padded prompt length the pipelines use (``tokenizer_max_length``); 77 in real CLIP.
    """
    bpe = Tokenizer(models.BPE(unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        end_of_word_suffix="</w>",
        initial_alphabet=_ALPHABET,
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return CLIPTokenizer(
        vocab=_stable_ids(model["vocab"], merges), merges=merges, model_max_length=model_max_length
    )


def _stable_ids(vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> dict[str, int]:
    """``vocab`` renumbered: special tokens first (as trained), then the tokens no merge produced in sorted order,
    then the merged tokens in merge order.

    The BPE trainer numbers the end-of-word alphabet (``e</w>``) in hash order, which differs between processes;
    the merges come out in a fixed order. Sorting the alphabet makes a tokenizer trained twice on one corpus the
    same, hence a seeded model built on it the same.
    """
    merged = {"".join(pair) for pair in merges}
    by_id = sorted(vocab, key=vocab.__getitem__)
    specials = [t for t in by_id if t.startswith("<|") and t.endswith("|>")]
    alphabet = sorted(t for t in by_id if t not in merged and t not in specials)
    ordered = [*specials, *alphabet, *(t for t in by_id if t in merged and t not in specials)]
    return {token: index for index, token in enumerate(ordered)}


def train_t5_tokenizer(
    corpus: Sequence[str], vocab_size: int = 128, model_max_length: int = 512
) -> T5Tokenizer:
    """Train a sentencepiece-style unigram tokenizer (``▁`` word marker) and wrap it as ``T5Tokenizer``.

    Used for T5 (SD3's third encoder, FLUX) and UMT5 (Wan). ``pad`` is id 0 and ``</s>`` id 1, as in T5.
    """
    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.Lowercase()
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        initial_alphabet=_ALPHABET,
    )
    unigram.train_from_iterator(corpus, trainer)
    vocab = [tuple(entry) for entry in json.loads(unigram.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def train_gemma_tokenizer(corpus: Sequence[str], vocab_size: int = 160) -> GemmaTokenizer:
    """Train a Gemma-style byte-pair tokenizer (spaces written ``▁``) and wrap it as ``GemmaTokenizer`` (SANA)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
        initial_alphabet=[*_ALPHABET, "▁"],
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    return GemmaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])


def train_qwen2_tokenizer(corpus: Sequence[str], vocab_size: int = 500) -> Qwen2Tokenizer:
    """Train a byte-level byte-pair tokenizer (GPT-2 byte alphabet) and wrap it as ``Qwen2Tokenizer``
    (Qwen2.5-VL, the text encoder of Qwen-Image), with Qwen's chat markers as special tokens.

    Qwen-Image's chat template is part of the training text: at the default ``vocab_size`` its system prefix
    becomes 34 tokens, the count ``QwenImagePipeline`` drops (``prompt_template_encode_start_idx``), as with the
    real tokenizer; the prompt's own tokens are then what the caption keeps.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *_QWEN_CHAT_MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([*corpus, _QWEN_IMAGE_TEMPLATE], trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_CHAT_MARKERS)})
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# Text encoders
# --------------------------------------------------------------------------------------------------------------


def tiny_clip_text_encoder(
    tokenizer: CLIPTokenizer, hidden_size: int = 16, projection_dim: int | None = 16, num_layers: int = 2
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A CLIP text tower; ``projection_dim`` set gives ``CLIPTextModelWithProjection`` (SD3), else ``CLIPTextModel``."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim or hidden_size,
        # The pooled output is read at the first eos token; these ids must be the trained tokenizer's.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if projection_dim is None:
        return CLIPTextModel(config)
    return CLIPTextModelWithProjection(config)


def tiny_t5_encoder(tokenizer: T5Tokenizer, d_model: int = 32, umt5: bool = False) -> T5EncoderModel:
    """A T5 (or UMT5, for Wan) encoder stack with ``d_model`` hidden size."""
    kwargs = {
        "vocab_size": len(tokenizer),
        "d_model": d_model,
        "d_kv": 8,
        "d_ff": 2 * d_model,
        "num_layers": 1,
        "num_heads": 2,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kwargs))
    return T5EncoderModel(T5Config(**kwargs))


def tiny_gemma2_encoder(tokenizer: GemmaTokenizer, hidden_size: int = 16) -> Gemma2Model:
    """A one-layer Gemma-2 decoder used as SANA's text encoder (its last hidden state is the caption)."""
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Gemma2Model(config)


def tiny_qwen25vl_encoder(
    tokenizer: Qwen2Tokenizer, hidden_size: int = 16
) -> Qwen2_5_VLForConditionalGeneration:
    """A one-layer Qwen2.5-VL (text decoder with multimodal RoPE, one-block vision tower) whose last hidden state
    is Qwen-Image's caption."""
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            # the three mRoPE sections (time, height, width) split the head's rotary half: 8 / 2 = 1 + 1 + 2
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        },
        vision_config={
            "depth": 1,
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def tiny_qwen3_config(tokenizer: Qwen2Tokenizer, hidden_size: int = 16, num_layers: int = 2) -> Qwen3Config:
    """A small Qwen3 decoder configuration for the trained Qwen tokenizer."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )


def tiny_qwen3_encoder(tokenizer: Qwen2Tokenizer, hidden_size: int = 16) -> Qwen3Model:
    """A two-layer Qwen3 decoder (Z-Image reads its second-to-last hidden state as the caption)."""
    return Qwen3Model(tiny_qwen3_config(tokenizer, hidden_size))


# --------------------------------------------------------------------------------------------------------------
# Whole pipelines
# --------------------------------------------------------------------------------------------------------------


def tiny_autoencoder_kl(latent_channels: int = 4) -> AutoencoderKL:
    """A two-level ``AutoencoderKL`` (spatial factor 2) as used by SD3 and FLUX, with random weights."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        # SD3's VAE config carries both; non-trivial values check that decode applies them.
        scaling_factor=1.5,
        shift_factor=0.1,
    )


@tiny_family("sd3", max_sequence_length=8)
def build_tiny_sd3(corpus: Sequence[str] = DEFAULT_CORPUS, with_t5: bool = True) -> StableDiffusion3Pipeline:
    """SD3/SD3.5 layout: two CLIP-with-projection encoders, optional T5, MMDiT, AutoencoderKL, shift-3 Euler."""
    tokenizer = train_clip_tokenizer(corpus, model_max_length=16)
    tokenizer_2 = train_clip_tokenizer(corpus, model_max_length=16)
    tokenizer_3 = train_t5_tokenizer(corpus) if with_t5 else None
    return StableDiffusion3Pipeline(
        # pooled_projection_dim = sum of both CLIP projections; joint_attention_dim = T5 width >= both CLIP widths
        transformer=SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=16,
            pooled_projection_dim=32,
            pos_embed_max_size=16,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_autoencoder_kl(),
        text_encoder=tiny_clip_text_encoder(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=tiny_clip_text_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        text_encoder_3=tiny_t5_encoder(tokenizer_3) if tokenizer_3 is not None else None,
        tokenizer_3=tokenizer_3,
    )


@tiny_family("flux", max_sequence_length=8)
def build_tiny_flux(corpus: Sequence[str] = DEFAULT_CORPUS) -> FluxPipeline:
    """FLUX.1 layout: CLIP (pooled) + T5 (sequence), guidance-embedded MMDiT, AutoencoderKL, dynamic shift."""
    tokenizer = train_clip_tokenizer(corpus, model_max_length=16)
    tokenizer_2 = train_t5_tokenizer(corpus)
    return FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels packed 2x2
            out_channels=None,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
            axes_dims_rope=(4, 4, 8),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=tiny_autoencoder_kl(),
        text_encoder=tiny_clip_text_encoder(tokenizer, projection_dim=None),
        tokenizer=tokenizer,
        text_encoder_2=tiny_t5_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
    )


@tiny_family("sana", max_sequence_length=8, complex_human_instruction=None)
def build_tiny_sana(corpus: Sequence[str] = DEFAULT_CORPUS) -> SanaPipeline:
    """SANA layout: Gemma-2 text encoder, linear-attention DiT, deep-compression autoencoder (AutoencoderDC)."""
    tokenizer = train_gemma_tokenizer(corpus)
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_gemma2_encoder(tokenizer),
        vae=AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
            upsample_block_type="interpolate",
            downsample_block_type="Conv",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        ),
        transformer=SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_attention_heads=2,
            attention_head_dim=4,
            num_cross_attention_heads=2,
            cross_attention_head_dim=4,
            cross_attention_dim=8,
            caption_channels=16,
            sample_size=16,
        ),
        # SANA ships a flow-sigma DPM-Solver; its flow_shift defines the sigma schedule the adapter uses.
        scheduler=DPMSolverMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    )


@tiny_family("wan", VIDEO_SIZE, max_sequence_length=8)
def build_tiny_wan(
    corpus: Sequence[str] = DEFAULT_CORPUS, boundary_ratio: float | None = None
) -> WanPipeline:
    """Wan2.1 layout: UMT5 text encoder, 3-D DiT on video latents [B, C, F, H, W], causal video VAE. With
    ``boundary_ratio``, Wan2.2 A14B's: a second expert ``transformer_2`` denoises below that sigma."""
    tokenizer = train_t5_tokenizer(corpus)

    def expert() -> WanTransformer3DModel:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5_encoder(tokenizer, umt5=True),
        vae=AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
        transformer=expert(),
        transformer_2=expert() if boundary_ratio is not None else None,
        boundary_ratio=boundary_ratio,
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    )


# the low-noise expert denoises step 2 of a 3-step schedule (2 and 3 of 4): every tiny test setting reaches it
@tiny_family("wan22", VIDEO_SIZE, max_sequence_length=8, trained_expert="low")
def build_tiny_wan22(corpus: Sequence[str] = DEFAULT_CORPUS) -> WanPipeline:
    """Wan2.2 A14B layout: two Wan2.1 experts switched at ``boundary_ratio`` 0.8 (the real one is 0.875; 0.8 gives
    each expert an SDE step of a 3-step schedule: sigmas 1.0 and 0.86 are the high expert's, 0.60 the low one's)."""
    return build_tiny_wan(corpus, boundary_ratio=0.8)


@tiny_family("qwen_image", max_sequence_length=16)
def build_tiny_qwen_image(corpus: Sequence[str] = DEFAULT_CORPUS) -> QwenImagePipeline:
    """Qwen-Image layout: Qwen2.5-VL text encoder, double-stream MMDiT on 2x2-packed latents, the one-frame
    causal video VAE (``AutoencoderKLQwenImage``, spatial factor 8), exponential dynamic shift with terminal
    shift as in ``Qwen/Qwen-Image``'s scheduler config."""
    tokenizer = train_qwen2_tokenizer(corpus)
    return QwenImagePipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_qwen25vl_encoder(tokenizer),
        vae=AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            # non-trivial statistics check that decode applies them
            latents_mean=[0.1, -0.2, 0.0, 0.3],
            latents_std=[1.5, 0.8, 1.0, 2.0],
        ),
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,  # 4 latent channels packed 2x2
            out_channels=4,
            num_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(4, 6, 6),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            time_shift_type="exponential",
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
        ),
    )


@tiny_family("z_image", max_sequence_length=16)
def build_tiny_z_image(corpus: Sequence[str] = DEFAULT_CORPUS) -> ZImagePipeline:
    """Z-Image layout: Qwen3 text encoder behind its chat template, single-stream DiT with context and noise
    refiners, FLUX's 16-channel-style AutoencoderKL (here 4 channels), static shift 3 as ``Z-Image-Turbo``."""
    tokenizer = train_qwen2_tokenizer(corpus)
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return ZImagePipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_qwen3_encoder(tokenizer),
        vae=tiny_autoencoder_kl(),
        transformer=ZImageTransformer2DModel(
            in_channels=4,
            dim=32,
            n_layers=1,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6],  # sums to the head width 32 / 2
            axes_lens=[256, 32, 32],
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


# the tiny Qwen3 has 3 layers: its caption is layers 1-3 (the real 36-layer encoders are read at 9, 18, 27)
@tiny_family("flux2_klein", max_sequence_length=16, text_encoder_out_layers=[1, 2, 3])
def build_tiny_flux2_klein(
    corpus: Sequence[str] = DEFAULT_CORPUS, is_distilled: bool = False
) -> Flux2KleinPipeline:
    """FLUX.2 [klein] layout: Qwen3 causal LM (three hidden states concatenated as the caption), MMDiT with
    double- and single-stream blocks on 2x2-patchified latents, ``AutoencoderKLFlux2`` with batch-norm latent
    statistics, exponential dynamic shift. ``is_distilled`` as the 4-step checkpoints (no CFG); the default
    builds the undistilled base."""
    tokenizer = train_qwen2_tokenizer(corpus)
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    hidden_size = 16
    return Flux2KleinPipeline(
        tokenizer=tokenizer,
        text_encoder=Qwen3ForCausalLM(tiny_qwen3_config(tokenizer, hidden_size, num_layers=3)),
        vae=tiny_autoencoder_kl_flux2(),
        transformer=tiny_flux2_transformer(3 * hidden_size, guidance_embeds=False),
        scheduler=_flux2_scheduler(),
        is_distilled=is_distilled,
    )


def tiny_autoencoder_kl_flux2() -> AutoencoderKLFlux2:
    """FLUX.2's VAE (spatial factor 2 here) with non-trivial batch-norm latent statistics, so that decode is
    checked to apply them (16 = 4 channels x 2x2 patch)."""
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.num_features))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    return vae


def tiny_flux2_transformer(joint_attention_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """A one-double-block, one-single-block FLUX.2 MMDiT on 4 latent channels patchified 2x2."""
    return Flux2Transformer2DModel(
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_attention_dim,  # three text hidden states concatenated
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head width
        guidance_embeds=guidance_embeds,
    )


def _flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        time_shift_type="exponential",
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        shift=3.0,
    )


def train_pixtral_processor(corpus: Sequence[str], vocab_size: int = 400) -> PixtralProcessor:
    """A byte-level BPE tokenizer with Mistral's control tokens in a ``PixtralProcessor`` (what
    ``FLUX.2-dev``'s ``AutoProcessor`` loads), with a chat template for its system + user text turns."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    image_tokens = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + image_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    template = (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
        "{{ message['content'][0]['text'] }}[/SYSTEM_PROMPT]{% else %}[INST]{{ message['content'][0]['text'] }}"
        "[/INST]{% endif %}{% endfor %}"
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(),
        tokenizer=tokenizer,
        chat_template=template,
        patch_size=16,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )


# likewise the tiny Mistral-3 (the real one is read at 10, 20, 30)
@tiny_family("flux2", max_sequence_length=16, text_encoder_out_layers=[1, 2, 3])
def build_tiny_flux2(corpus: Sequence[str] = DEFAULT_CORPUS) -> Flux2Pipeline:
    """FLUX.2 [dev] layout: Mistral-3 (three hidden states of its text decoder as the caption) behind a Pixtral
    processor, guidance-embedded FLUX.2 MMDiT, ``AutoencoderKLFlux2``, exponential dynamic shift."""
    processor = train_pixtral_processor(corpus)
    hidden_size = 16
    vocab = len(processor.tokenizer)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 256,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "patch_size": 16,
            "image_size": 64,
        },
        image_token_index=processor.tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    return Flux2Pipeline(
        tokenizer=processor,
        text_encoder=Mistral3ForConditionalGeneration(config),
        vae=tiny_autoencoder_kl_flux2(),
        transformer=tiny_flux2_transformer(3 * hidden_size, guidance_embeds=True),
        scheduler=_flux2_scheduler(),
    )


def build_shapes_pipeline(
    prompts: Sequence[str],
    num_layers: int = 4,
    num_attention_heads: int = 4,
    attention_head_dim: int = 32,
    patch_size: int = 4,
    text_hidden_size: int = 32,
    resolution: int = 32,
    shift: float = 3.0,
) -> StableDiffusion3Pipeline:
    """The shapes world's text-to-image model, random-initialised: a pixel-space SD3 pipeline.

    ``SD3Transformer2DModel`` on RGB pixels (``in_channels = 3``, no VAE; ``patch_size`` 4 makes 64 image tokens
    at 32x32), two ``CLIPTextModelWithProjection`` encoders (``text_hidden_size`` wide, 2 layers) sharing a CLIP
    tokenizer trained on ``prompts``, no T5. Dimensions follow SD3's wiring: ``joint_attention_dim`` = the two
    CLIP widths concatenated, ``pooled_projection_dim`` = the two projections concatenated. ``shift`` is the
    Euler scheduler's shift (SD3's 3: more sampling steps at high noise, where the scene's layout is decided).

    Args:
        prompts: the prompt vocabulary (e.g. ``mmrl.data.shapes.all_prompts()``) the tokenizer is trained on.
    """
    longest = max(len(p.split()) for p in prompts)
    # every shapes word becomes one token, plus start and end tokens
    tokenizer = train_clip_tokenizer(prompts, vocab_size=512, model_max_length=longest + 2)
    tokenizer_2 = train_clip_tokenizer(prompts, vocab_size=512, model_max_length=longest + 2)
    width = num_attention_heads * attention_head_dim
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=resolution,
            patch_size=patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=2 * text_hidden_size,
            caption_projection_dim=width,
            pooled_projection_dim=2 * text_hidden_size,
            pos_embed_max_size=resolution // patch_size,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=None,
        text_encoder=tiny_clip_text_encoder(tokenizer, text_hidden_size, text_hidden_size),
        tokenizer=tokenizer,
        text_encoder_2=tiny_clip_text_encoder(tokenizer_2, text_hidden_size, text_hidden_size),
        tokenizer_2=tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def extend_shapes_vocabulary(
    pipe: StableDiffusion3Pipeline, corpus: Sequence[str], keep: Sequence[str], seed: int = 0
) -> list[str]:
    """Teach a built shapes pipeline's tokenizers new words, keeping what its text encoders know.

    Each CLIP tokenizer is retrained on ``keep`` + ``corpus`` (same trainer, same special tokens, so ``<|startoftext|>``
    and ``<|endoftext|>`` keep ids 0 and 1); each text encoder's token-embedding row of a token the old vocabulary
    had is copied to the token's new id, and a new token's row is the mean of the old rows plus noise of their
    per-dimension standard deviation x 0.1 (under ``seed``), so a new word starts as an average, distinguishable
    word. The position embeddings are unchanged: every prompt must still fit the old ``model_max_length``.

    Args:
        pipe: a pipeline of :func:`build_shapes_pipeline` (or loaded from one), changed in place.
        corpus: prompts with the new words (e.g. the digits world's).
        keep: prompts the model already reads (e.g. the shapes world's); their tokenization must not change.

    Returns:
        the new tokens (of the first tokenizer), in id order.

    Raises:
        ValueError: a ``keep`` prompt tokenizes differently afterwards, or a prompt is longer than the text
            encoders' positions.
    """
    generator = torch.Generator().manual_seed(seed)
    added: list[str] = []
    for tokenizer_name, encoder_name in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        old, encoder = getattr(pipe, tokenizer_name), getattr(pipe, encoder_name)
        new = train_clip_tokenizer([*keep, *corpus], vocab_size=512, model_max_length=old.model_max_length)
        for prompt in keep:
            if new.tokenize(prompt) != old.tokenize(prompt):
                raise ValueError(
                    f"{tokenizer_name}: {prompt!r} tokenizes as {new.tokenize(prompt)} after the extension, "
                    f"{old.tokenize(prompt)} before"
                )
        for prompt in corpus:
            length = len(new(prompt).input_ids)
            if length > old.model_max_length:
                raise ValueError(
                    f"{prompt!r} is {length} tokens; the text encoders have {old.model_max_length} positions"
                )
        old_vocab, new_vocab = old.get_vocab(), new.get_vocab()
        old_rows = encoder.get_input_embeddings().weight.detach()
        mean, std = old_rows.mean(dim=0), old_rows.std(dim=0)
        rows = mean + 0.1 * std * torch.randn(len(new_vocab), old_rows.shape[1], generator=generator)
        for token, index in new_vocab.items():
            if token in old_vocab:
                rows[index] = old_rows[old_vocab[token]]
        embedding = torch.nn.Embedding(len(new_vocab), old_rows.shape[1])
        embedding.weight.data.copy_(rows)
        encoder.set_input_embeddings(embedding)
        encoder.config.vocab_size = len(new_vocab)
        setattr(pipe, tokenizer_name, new)
        if not added:
            added = [t for t, _ in sorted(new_vocab.items(), key=lambda item: item[1]) if t not in old_vocab]
    return added


def build_tiny_pipeline(
    family: str, corpus: Sequence[str] = DEFAULT_CORPUS, seed: int = 0
) -> DiffusionPipeline:
    """Build the tiny random pipeline of ``family`` (one of :data:`FAMILIES`), seeded.

    Raises:
        ValueError: for an unknown family, listing the known ones.
    """
    if family not in _TINY_FAMILIES:
        raise ValueError(f"unknown pipeline family {family!r}. Available: {sorted(_TINY_FAMILIES)}")
    torch.manual_seed(seed)
    return _TINY_FAMILIES[family].build(corpus)


#: every family with a tiny pipeline, in registration order
FAMILIES: tuple[str, ...] = tuple(_TINY_FAMILIES)
#: adapter ``from_pretrained`` options and output sizes of each family's tiny pipeline
TINY_LOAD_KWARGS: dict[str, dict[str, Any]] = {
    name: tiny.load_kwargs for name, tiny in _TINY_FAMILIES.items()
}
TINY_SIZES: dict[str, dict[str, int]] = {name: tiny.sizes for name, tiny in _TINY_FAMILIES.items()}
