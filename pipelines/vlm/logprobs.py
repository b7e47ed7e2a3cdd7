"""Recompute completion-token log-probs and entropies in the trainer, chunked over the sequence.

For a batch of (prompt with images, completion) pairs, one forward of the model's backbone gives the hidden
states; the language-model head and the ``log_softmax`` are then applied to ``chunk_size`` sequence positions at
a time, so the ``[B, T, V]`` logits tensor never exists: peak memory is ``B x chunk_size x V`` floats however
long the completions or large the vocabulary (Qwen's is 151,936). With gradients enabled each chunk is
activation-checkpointed, so the backward pass also holds one chunk of logits at a time.

Rows that share a prompt (a group's completions) share its forward: the distinct prompts run once, with their
images through the vision tower once, and the completions run on their prompt's key/value states
(:func:`prompt_shared_hidden`). Causal attention makes a prompt's states independent of what follows it, so
this is the same computation as scoring every row whole (equal to float rounding, ~1e-6 in fp32), with the
prompt's work done once instead of once per completion; gradients reach the prompt through the shared states.

Per completion token t with tempered, vision-token-suppressed distribution
``pi_t = softmax(logits_t / temperature)`` this returns:

* ``logprobs``: ``log pi_t(y_t)`` (differentiable);
* ``entropy``: the full-vocabulary entropy ``H_t = -sum_v pi_t(v) log pi_t(v)`` (detached), the default
  ``H_t`` of entropy-shaped advantages (Cheng et al., arXiv 2506.14758);
* ``sampled_entropy``: the sampled-token term ``-pi_t(y_t) log pi_t(y_t)`` (detached), the variant the MSSR code
  uses.

With the same ``temperature`` and ``suppressed_token_ids`` as the rollout and ``top_p = 1``, ``logprobs`` equals
the transformers backend's behaviour log-probs (to ~1e-5 in fp32).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch.utils.checkpoint import checkpoint

from pipelines.lora import unwrap_peft
from pipelines.vlm.families import DEFAULT_FAMILY, VLMFamily, family_for_model_type, get_vlm_family


@dataclass
class ScoringBatch:
    """Prompt + completion rows ready for one scoring forward.

    Layout: each row is ``[left-padded prompt | right-padded completion]`` (width ``P + T``), the layout
    ``generate`` produces, so completion token ``j`` of every row sits in column ``P + j``.

    Attributes:
        model_inputs: ``input_ids`` / ``attention_mask`` / the family's token types ``[B, P + T]`` plus the vision
            tensors (Qwen-VL: ``pixel_values``, ``image_grid_thw``) of all rows' images in order.
        completion_ids: ``[B, T]`` completion token ids (pad where the completion is shorter).
        completion_mask: ``[B, T]`` bool, True on real completion tokens.
        prompt_width: ``P``, the padded prompt width.
        prompt_rows: ``[U]`` one row per distinct prompt (the first holding it; the same token ids and the same
            image objects), or ``None`` when no two rows share a prompt.
        prompt_of_row: ``[B]`` the index into ``prompt_rows`` of each row's prompt (with ``prompt_rows``).
        prompt_vision: the vision tensors of the ``prompt_rows``' images alone, in order (with ``prompt_rows``).
    """

    model_inputs: dict[str, torch.Tensor]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    prompt_width: int
    prompt_rows: torch.Tensor | None = None
    prompt_of_row: torch.Tensor | None = None
    prompt_vision: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TokenStats:
    """Per-completion-token statistics, ``[B, T]`` float32, zero where ``mask`` is False."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    sampled_entropy: torch.Tensor
    mask: torch.Tensor

    def detach(self) -> TokenStats:
        """The same statistics without gradients (the old policy's, taken from a gradient forward)."""
        return TokenStats(
            self.logprobs.detach(), self.entropy.detach(), self.sampled_entropy.detach(), self.mask
        )


def build_scoring_batch(
    processor: Any,
    prompt_token_ids: Sequence[Sequence[int]],
    completion_token_ids: Sequence[Sequence[int]],
    images: Sequence[Sequence[Image.Image]],
    *,
    pad_token_id: int | None = None,
    family: VLMFamily | None = None,
) -> ScoringBatch:
    """Assemble a :class:`ScoringBatch` from token ids (as a backend returned them) and the prompts' images.

    The images go through ``processor.image_processor`` again (deterministic), so a result from any backend
    can be scored without shipping pixel tensors around. The family's token types (Qwen-VL: ``mm_token_type_ids``)
    are rebuilt from the ids and are 0 over the completion, which the Qwen-VL models need to place the 3-D rotary
    positions as ``generate`` did.

    Args:
        processor: the processor the prompts were built with.
        prompt_token_ids: per row, the prompt ids with image tokens expanded.
        completion_token_ids: per row, the completion ids.
        images: per row, the prompt's images in order.
        pad_token_id: filler id for padding (masked out); defaults to the tokenizer's pad (or eos) id.
        family: the model's :class:`~pipelines.vlm.families.VLMFamily` (default: Qwen2.5-VL).

    Returns:
        The batch.

    Raises:
        ValueError: lengths differ, a completion is empty, or a row's image-token count does not match its
            images (e.g. a completion sampled ``<|image_pad|>``: suppress vision tokens during generation).
    """
    B = len(prompt_token_ids)
    if not B or len(completion_token_ids) != B or len(images) != B:
        raise ValueError(
            f"need as many prompts ({B}), completions ({len(completion_token_ids)}) and image lists "
            f"({len(images)}), at least one"
        )
    tokenizer = processor.tokenizer
    if pad_token_id is None:
        pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    P = max(len(ids) for ids in prompt_token_ids)
    T = max(len(ids) for ids in completion_token_ids)
    if min(len(ids) for ids in completion_token_ids) == 0:
        raise ValueError("every completion needs at least one token to score")
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompt_token_ids, completion_token_ids, strict=True)):
        input_ids[row, P - len(prompt) : P] = torch.tensor(prompt, dtype=torch.long)
        input_ids[row, P : P + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, P - len(prompt) : P + len(completion)] = 1
    family = family if family is not None else get_vlm_family(DEFAULT_FAMILY)
    image_token_id = family.image_token_id(processor)
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    token_types = family.token_type_ids(input_ids, processor)
    if token_types is not None:
        model_inputs[family.token_type_key] = token_types * attention_mask
    flat_images = [image for row_images in images for image in row_images]
    tokens_per_image: list[int] = []
    if flat_images:
        vision, tokens_per_image = family.image_inputs(processor, flat_images)
        model_inputs.update(vision)
    # Each row must hold exactly as many image tokens as its images produce features, or the forward fails
    # deep inside the model; say which row and why here instead.
    start = 0
    for row, row_images in enumerate(images):
        expected = sum(tokens_per_image[start : start + len(row_images)])
        start += len(row_images)
        found = int(((input_ids[row] == image_token_id) & attention_mask[row].bool()).sum())
        if found != expected:
            raise ValueError(
                f"row {row}: {found} image tokens in prompt+completion but its {len(row_images)} image(s) give "
                f"{expected}; pass each prompt's images in order, and suppress vision tokens when generating"
            )
    completion_mask = attention_mask[:, P:].bool()
    distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    prompt_of_row = [
        distinct.setdefault((tuple(ids), tuple(map(id, row_images))), len(distinct))
        for ids, row_images in zip(prompt_token_ids, images, strict=True)
    ]
    shared: dict[str, Any] = {}
    if len(distinct) < B:
        rows = [prompt_of_row.index(k) for k in range(len(distinct))]
        shared_images = [image for row in rows for image in images[row]]
        shared = {
            "prompt_rows": torch.tensor(rows),
            "prompt_of_row": torch.tensor(prompt_of_row),
            "prompt_vision": family.image_inputs(processor, shared_images)[0] if shared_images else {},
        }
    return ScoringBatch(
        model_inputs=model_inputs,
        completion_ids=input_ids[:, P:].clone(),
        completion_mask=completion_mask,
        prompt_width=P,
        **shared,
    )


def _chunk_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    suppressed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log-prob of ``targets`` and full entropy for one chunk: ``hidden [B, c, H]`` -> two ``[B, c]``."""
    # fp32 softmax: bf16 log-probs are too coarse for importance ratios near 1.
    logits = head(hidden).float() / temperature  # [B, c, V]
    if suppressed is not None:
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        # Suppressed tokens have p = 0 and log p = -inf; their term p log p is 0, not NaN.
        p_logp = torch.special.xlogy(logp_all.exp(), logp_all.exp())
        entropy = -p_logp.sum(-1)
    return logp, entropy


def chunked_token_stats(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    suppressed_token_ids: Sequence[int] = (),
    min_chunks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply ``head`` + ``log_softmax`` to ``chunk_size`` positions at a time (the math of this module).

    Args:
        hidden: ``[B, T, H]`` hidden states; position t predicts ``targets[:, t]``.
        head: the language-model head (``[.., H] -> [.., V]``).
        targets: ``[B, T]`` token ids.
        temperature: logits are divided by it (use the rollout's; 1.0 for greedy rollouts).
        chunk_size: sequence positions per chunk; memory is ``B x chunk_size x V`` floats.
        suppressed_token_ids: token ids whose logits are set to ``-inf`` (those the rollout suppressed).
        min_chunks: call ``head`` at least this many times, on empty chunks past the sequence's end (results
            unchanged). Under FSDP every call of a sharded head is a collective, so ranks whose completions span
            different numbers of chunks pass the largest count (``ceil(T / chunk_size)``) any of them needs.

    Returns:
        ``(logprobs, entropy, sampled_entropy)``, each ``[B, T]`` float32; only ``logprobs`` carries gradients.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score (use 1.0 for greedy rollouts), got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    suppressed = (
        torch.tensor(sorted(set(suppressed_token_ids)), dtype=torch.long, device=hidden.device)
        if suppressed_token_ids
        else None
    )
    # Checkpoint chunks only when a backward will follow; otherwise it would only cost time.
    use_checkpoint = torch.is_grad_enabled() and hidden.requires_grad
    logps, entropies = [], []
    T = hidden.shape[1]
    # chunks past T are empty ([B, 0, H]): the head is still called (and back-propagated through) on them
    for start in range(0, max(T, min_chunks * chunk_size), chunk_size):
        h = hidden[:, start : start + chunk_size]
        t = targets[:, start : start + chunk_size]
        if use_checkpoint:
            logp, entropy = checkpoint(_chunk_stats, h, t, head, temperature, suppressed, use_reentrant=False)
        else:
            logp, entropy = _chunk_stats(h, t, head, temperature, suppressed)
        logps.append(logp)
        entropies.append(entropy)
    logprobs = torch.cat(logps, dim=1)
    p = logprobs.detach().exp()
    sampled_entropy = -torch.special.xlogy(p, p)
    return logprobs, torch.cat(entropies, dim=1), sampled_entropy


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The module producing hidden states (vision tower + language model) and the LM head.

    Scoring calls these two directly, not the model's ``forward``: an FSDP-sharded model needs each of them to be
    its own FSDP unit, or their parameters are still shards when called. Unwraps a peft model to the transformers
    model with LoRA layers injected (so LoRA, and ``disable_adapter()`` for the reference policy, still apply).
    """
    model, _ = unwrap_peft(model)
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to score with")
    return backbone, head


@functools.cache
def _cache_keyword(backbone_class: type) -> str:
    """The name under which ``backbone_class.forward`` takes a key/value cache: transformers renamed
    ``past_key_values`` to ``cache``. Read once per class, not on every scoring call."""
    return "cache" if "cache" in inspect.signature(backbone_class.forward).parameters else "past_key_values"


def prompt_shared_hidden(
    backbone: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    position_ids: torch.Tensor,
    batch: ScoringBatch,
    family: VLMFamily,
) -> torch.Tensor:
    """The hidden states ``[B, T, H]`` that predict the completion tokens, each distinct prompt run once.

    Two forwards: the ``U`` distinct prompts ``[U, P]`` (their images through the vision tower once), keeping their
    key/value states, which are then gathered to the ``B`` rows (``prompt_of_row``: gradients of a prompt's states
    sum over its completions); then the completions ``[B, T]`` attend to them under the full attention mask
    ``[B, P + T]``. Both take their columns of ``position_ids`` (``[..., B, P + T]``, the positions of the whole
    rows), so every token sits where the whole-row forward puts it. Position ``P - 1`` (the prompt's last token)
    predicts completion token 0, completion position ``j`` predicts token ``j + 1``.

    Args:
        backbone: the model's backbone (:func:`backbone_and_head`).
        inputs: ``batch.model_inputs`` on the backbone's device.
        position_ids: the positions of the whole rows (``family.position_ids``, or the attention-mask positions
            of text-only rows).
        batch: a batch with ``prompt_rows`` set.
        family: the model's family (which input carries the token types).
    """
    from transformers import DynamicCache

    device = inputs["input_ids"].device
    P = batch.prompt_width
    T = batch.completion_ids.shape[1]
    rows = batch.prompt_rows.to(device)
    of_row = batch.prompt_of_row.to(device)
    sequence_keys = [k for k in ("input_ids", "attention_mask", family.token_type_key) if k in inputs]
    prompts = {k: inputs[k][rows, :P] for k in sequence_keys}
    vision = {k: v.to(device) for k, v in batch.prompt_vision.items()}
    cache = DynamicCache(config=backbone.config)
    cache_kwarg = _cache_keyword(type(backbone))
    prompt_hidden = backbone(
        **prompts, **vision, position_ids=position_ids[..., rows, :P], use_cache=True, **{cache_kwarg: cache}
    ).last_hidden_state  # [U, P, H]
    if cache.get_seq_length() != P:
        raise RuntimeError(
            f"the prompt forward kept {cache.get_seq_length()} of {P} positions in its key/value cache; "
            "score every row whole (share_prompts=False) with this model"
        )
    last_prompt = prompt_hidden[of_row, P - 1 : P]  # [B, 1, H]
    if T == 1:  # the only completion token is predicted from the prompt
        return last_prompt
    cache.batch_select_indices(of_row)
    completion_hidden = backbone(
        input_ids=inputs["input_ids"][:, P:],
        attention_mask=inputs["attention_mask"],
        position_ids=position_ids[..., P:],
        use_cache=True,
        **{cache_kwarg: cache},
    ).last_hidden_state  # [B, T, H]
    return torch.cat([last_prompt, completion_hidden[:, : T - 1]], dim=1)


def completion_token_stats(
    model: torch.nn.Module,
    batch: ScoringBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    suppressed_token_ids: Sequence[int] = (),
    min_chunks: int = 0,
    share_prompts: bool = True,
    family: VLMFamily | None = None,
) -> TokenStats:
    """Log-probs and entropies of the completion tokens of ``batch`` under ``model``.

    Args:
        model: the policy (a transformers image-text-to-text model or a peft model around one).
        batch: from :func:`build_scoring_batch`.
        temperature: the rollout temperature (1.0 for greedy rollouts).
        chunk_size: sequence positions per head/softmax chunk.
        suppressed_token_ids: the ids the rollout suppressed (``backend.suppressed_token_ids``), so both score
            the same distribution.
        min_chunks: call the head at least this many times (see :func:`chunked_token_stats`; FSDP ranks).
        share_prompts: run each distinct prompt once for all its rows (:func:`prompt_shared_hidden`) when rows
            share prompts, the family gives the positions and gradient checkpointing is off (it drops the
            key/value cache); off: every row whole. Off under FSDP, where each forward is a collective that every
            rank must make alike.
        family: the model's :class:`~pipelines.vlm.families.VLMFamily`; ``None`` detects it from
            ``model.config.model_type``.

    Returns:
        :class:`TokenStats` with ``[B, T]`` tensors on the model's device.
    """
    backbone, head = backbone_and_head(model)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.model_inputs.items()}
    if "pixel_values" not in inputs:
        # Text-only rows: the model would number positions 0..L-1 ignoring left padding, while generate()
        # numbers them from the attention mask; give it generate()'s positions.
        mask = inputs["attention_mask"]
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    P = batch.prompt_width
    T = batch.completion_ids.shape[1]
    family = family if family is not None else family_for_model_type(model.config.model_type)
    hidden = None
    if (
        share_prompts
        and batch.prompt_rows is not None
        and not any(getattr(module, "gradient_checkpointing", False) for module in backbone.modules())
    ):
        positions = inputs.get("position_ids")
        if positions is None:
            positions = family.position_ids(backbone, inputs)
        if positions is not None:
            hidden = prompt_shared_hidden(backbone, inputs, positions, batch, family)
    if hidden is None:
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [B, P + T, H]
        hidden = hidden[:, P - 1 : P - 1 + T]  # [B, T, H]: the state before token j predicts token j
    targets = batch.completion_ids.to(device)
    logprobs, entropy, sampled_entropy = chunked_token_stats(
        hidden,
        head,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        suppressed_token_ids=suppressed_token_ids,
        min_chunks=min_chunks,
    )
    mask = batch.completion_mask.to(device)
    zero = torch.zeros((), device=device)
    return TokenStats(
        # where(), not a product: a padded position may hold -inf, and -inf * 0 is NaN.
        logprobs=torch.where(mask, logprobs, zero),
        entropy=torch.where(mask, entropy, zero),
        sampled_entropy=torch.where(mask, sampled_entropy, zero),
        mask=mask,
    )
