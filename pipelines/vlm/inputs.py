"""Chat prompts with images -> model inputs, with processor-aware length handling.

Both generation backends and the log-prob recomputation start from the same place: a chat prompt
(``messages`` in the Hugging Face chat format, image slots written as ``{"type": "image"}``) plus its PIL images.
The model's own processor applies the chat template and expands each image slot into the number of image tokens
the vision tower produces for that image, so the prompt length is only known after processing. We therefore
process prompts one at a time, measure them, and *skip* (never truncate) a prompt that cannot fit: truncating
would cut image tokens, and the forward pass then fails with "Image features and image tokens do not match".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

logger = logging.getLogger(__name__)

#: where a question's text puts an image (EasyR1's and verl's datasets, e.g. Geometry3K's problems)
IMAGE_PLACEHOLDER = "<image>"


def check_image_placeholders(question: str, num_images: int) -> None:
    """Refuse a question whose ``<image>`` placeholders do not match its images one to one (a question without
    placeholders shows its images before the text).

    Raises:
        ValueError: naming both counts.
    """
    count = question.count(IMAGE_PLACEHOLDER)
    if count and count != num_images:
        raise ValueError(
            f"the question has {count} {IMAGE_PLACEHOLDER} placeholder(s) but {num_images} image(s); each "
            f"{IMAGE_PLACEHOLDER} marks where one image goes"
        )


@dataclass
class VLMPrompt:
    """One chat prompt with its images.

    Attributes:
        messages: chat messages in the Hugging Face format; each image is a ``{"type": "image"}`` item of a
            message's ``content`` list, in the order of ``images``.
        images: the PIL images, one per image slot of ``messages``.
        prompt_id: a stable id for the prompt (the key of the trainer's statistics store); optional.
    """

    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    prompt_id: str | None = None

    @classmethod
    def from_question(
        cls,
        question: str,
        images: Sequence[Image.Image] = (),
        *,
        system: str | None = None,
        prompt_id: str | None = None,
    ) -> VLMPrompt:
        """A single-turn user prompt. Each ``<image>`` in the question is where the next image goes, as EasyR1 and
        verl read their datasets (the text between them kept, the placeholders removed); a question without
        placeholders gets its images first, then its text (the Qwen-VL convention; a model family with another
        layout overrides :meth:`pipelines.vlm.families.VLMFamily.prompt`).

        Raises:
            ValueError: the question has placeholders, but not one per image.
        """
        check_image_placeholders(question, len(images))
        content: list[dict[str, Any]] = []
        if IMAGE_PLACEHOLDER in question:
            for i, text in enumerate(question.split(IMAGE_PLACEHOLDER)):
                if i:
                    content.append({"type": "image"})
                if text:
                    content.append({"type": "text", "text": text})
        else:
            content = [{"type": "image"} for _ in images]
            content.append({"type": "text", "text": question})
        messages: list[dict[str, Any]] = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": content})
        return cls(messages=messages, images=list(images), prompt_id=prompt_id)

    def num_image_slots(self) -> int:
        """Number of ``{"type": "image"}`` items in the messages."""
        count = 0
        for message in self.messages:
            content = message.get("content")
            if isinstance(content, list):
                count += sum(1 for item in content if item.get("type") == "image" or "image" in item)
        return count


@dataclass
class PreparedPrompt:
    """A prompt after the processor: what a backend needs to generate from it.

    Attributes:
        index: position of the prompt in the caller's list.
        prompt_id: the prompt's id, copied from :class:`VLMPrompt`.
        text: the chat-templated prompt, image slots not yet expanded (what vLLM takes): it tokenizes, with the
            tokenizer's special tokens as vLLM adds them, to ``input_ids`` before image expansion.
        input_ids: token ids with every image slot expanded to its image tokens.
        features: the processor's tensors for this prompt alone (``input_ids`` ``[1, L]``, ``attention_mask``,
            ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``, ... depending on the processor).
        images: the prompt's images (kept for re-processing at scoring time).
    """

    index: int
    prompt_id: str | None
    text: str
    input_ids: list[int]
    features: dict[str, torch.Tensor]
    images: list[Image.Image]


@dataclass
class SkippedPrompt:
    """A prompt that was not generated from, and why (reported in the result, logged at WARNING)."""

    index: int
    prompt_id: str | None
    reason: str


def _adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` puts its BOS token before a text it encodes with special tokens (Gemma's does)."""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def prepare_prompts(
    processor: Any,
    prompts: Sequence[VLMPrompt],
    *,
    max_prompt_length: int | None = None,
    max_model_len: int | None = None,
) -> tuple[list[PreparedPrompt], list[SkippedPrompt]]:
    """Apply the chat template and the processor to each prompt; skip those that cannot fit.

    A prompt is skipped when its processed length (image tokens included) exceeds ``max_prompt_length``, or
    leaves no room for a single generated token under ``max_model_len``. It is never truncated.

    Args:
        processor: the model's processor (``AutoProcessor.from_pretrained(...)``), with a chat template.
        prompts: the prompts.
        max_prompt_length: longest processed prompt accepted, in tokens; ``None`` for no limit.
        max_model_len: the model's context (prompt + completion) in tokens; ``None`` for no limit.

    Returns:
        ``(prepared, skipped)``, each in the order of ``prompts``.

    Raises:
        ValueError: a prompt's number of image slots differs from its number of images.
    """
    prepared: list[PreparedPrompt] = []
    skipped: list[SkippedPrompt] = []
    tokenizer_adds_bos = _adds_bos(processor.tokenizer)
    for index, prompt in enumerate(prompts):
        slots = prompt.num_image_slots()
        if slots != len(prompt.images):
            raise ValueError(
                f"prompt {index} (id {prompt.prompt_id!r}) has {slots} image slots in its messages but "
                f"{len(prompt.images)} images; add one {{'type': 'image'}} content item per image"
            )
        text = processor.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        # A template that writes the tokenizer's BOS itself (Gemma's) must not get a second one from the
        # tokenizer; the rule of transformers' own tokenizing apply_chat_template.
        bos = processor.tokenizer.bos_token
        template_wrote_bos = bos is not None and text.startswith(bos)
        features = processor(
            text=[text],
            images=list(prompt.images) or None,
            return_tensors="pt",
            padding=False,
            add_special_tokens=not template_wrote_bos,
        )
        if template_wrote_bos and tokenizer_adds_bos:
            # vLLM tokenizes a text prompt with the tokenizer's special tokens: without the written BOS, it
            # gets exactly the one BOS the ids above hold (with it, two: a prompt the policy never scores)
            text = text.removeprefix(bos)
        features = {key: value for key, value in features.items() if isinstance(value, torch.Tensor)}
        input_ids = features["input_ids"][0].tolist()
        length = len(input_ids)
        reason = None
        if max_prompt_length is not None and length > max_prompt_length:
            reason = (
                f"prompt has {length} tokens after image expansion, more than max_prompt_length="
                f"{max_prompt_length}; image tokens cannot be truncated"
            )
        elif max_model_len is not None and length >= max_model_len:
            reason = (
                f"prompt has {length} tokens after image expansion, leaving no room to generate under "
                f"max_model_len={max_model_len}; image tokens cannot be truncated"
            )
        if reason is not None:
            logger.warning("skipping prompt %d (id %r): %s", index, prompt.prompt_id, reason)
            skipped.append(SkippedPrompt(index=index, prompt_id=prompt.prompt_id, reason=reason))
            continue
        prepared.append(
            PreparedPrompt(
                index=index,
                prompt_id=prompt.prompt_id,
                text=text,
                input_ids=input_ids,
                features=features,
                images=list(prompt.images),
            )
        )
    return prepared, skipped


#: Processor outputs laid out along the token sequence (``[1, L]`` per prompt); padded when collated. Every
#: other tensor (``pixel_values`` ``[num_patches, D]``, ``image_grid_thw`` ``[num_images, 3]``) is concatenated.
_SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def collate_left_padded(prepared: Sequence[PreparedPrompt], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Batch prepared prompts for ``generate``: sequence tensors left-padded, vision tensors concatenated.

    Left padding puts every prompt's last token in the last column, which is what decoder-only generation needs
    (the first new token is predicted from the last column).

    Args:
        prepared: prompts from :func:`prepare_prompts`.
        pad_token_id: id written into padded ``input_ids`` positions (masked out by ``attention_mask``).

    Returns:
        ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids`` of shape ``[B, L]`` (``L`` the longest
        prompt) and the concatenation of the other processor tensors in prompt order.
    """
    if not prepared:
        raise ValueError("collate_left_padded needs at least one prompt")
    B = len(prepared)
    L = max(len(p.input_ids) for p in prepared)
    batch: dict[str, torch.Tensor] = {}
    for key in _SEQUENCE_KEYS:
        if key not in prepared[0].features:
            continue
        fill = pad_token_id if key == "input_ids" else 0
        out = torch.full((B, L), fill, dtype=prepared[0].features[key].dtype)
        for row, prompt in enumerate(prepared):
            values = prompt.features[key][0]
            out[row, L - values.shape[0] :] = values
        batch[key] = out
    other_keys = {k for p in prepared for k in p.features if k not in _SEQUENCE_KEYS}
    for key in sorted(other_keys):
        # Prompts without images have no pixel_values; the model matches features to image tokens in order.
        batch[key] = torch.cat([p.features[key] for p in prepared if key in p.features], dim=0)
    return batch
