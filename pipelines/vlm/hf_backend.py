"""transformers generation backend: batched ``generate`` with images, behaviour log-probs from the scores.

Runs on CPU and GPU with any ``AutoModelForImageTextToText`` model and its ``AutoProcessor``. It generates with
the module it is given, usually the training policy itself (LoRA active), so nothing needs copying between
steps; ``sync_weights`` with another module copies that module's merged weights into this one (a separate,
e.g. lower-precision, rollout copy).

Behaviour log-probs come from ``generate``'s ``output_scores``: the scores after every logits processor that
shaped the sampling distribution, i.e. ``logits / temperature`` with the vision special tokens set to ``-inf``
and, when ``top_p < 1``, everything outside the nucleus set to ``-inf``. Their ``log_softmax`` at the sampled
token is the log-prob of the distribution the token was actually drawn from (after temperature, after top-p).
Every sampling knob is passed explicitly (``top_k=0``, ``repetition_penalty=1``, ...), because a checkpoint's
``generation_config.json`` (Qwen2.5-VL-Instruct ships ``top_k=1, top_p=0.001, repetition_penalty=1.05``) would
otherwise silently change the distribution the log-probs describe.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipelines.hub import model_not_found, model_not_loadable
from pipelines.vlm.backend import GenerationBackend, GenerationResult, GenerationSample, SamplingParams
from pipelines.vlm.families import VLMFamily, family_for_model_type
from pipelines.vlm.inputs import PreparedPrompt, VLMPrompt, collate_left_padded, prepare_prompts
from pipelines.vlm.weight_sync import merged_state_dict

#: Seeded generations in one process take turns. ``generate`` samples from the process-global torch RNG, which
#: the seeded call forks and seeds: two on concurrent threads (in-process pool workers) would draw from one
#: stream in whatever order the threads interleave, and their samples would depend on that timing.
_SEEDED_GENERATION = threading.Lock()


def load_vlm(model_id_or_path: str, **kwargs: Any) -> tuple[Any, torch.nn.Module]:
    """``(AutoProcessor, AutoModelForImageTextToText)`` from a local folder or a Hub id; ``kwargs`` go to the
    model's ``from_pretrained`` (``dtype``, ``quantization_config``...).

    Raises:
        OSError: neither a local folder nor a reachable Hub repository (both places named).
        ValueError: a local path that exists but holds no VLM that loads (the loader's reason named).
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_id_or_path)
        return processor, AutoModelForImageTextToText.from_pretrained(model_id_or_path, **kwargs)
    except (torch.OutOfMemoryError, MemoryError):
        raise  # (the folder is fine; the device is full)
    except Exception as error:  # (safetensors' errors are no OSError; a broken config.json is a ValueError)
        if Path(model_id_or_path).exists():
            raise model_not_loadable("VLM", model_id_or_path, error) from error
        if isinstance(error, OSError | ValueError):  # (a path that is no repo id fails the Hub's id check)
            raise model_not_found("VLM", model_id_or_path, error) from error
        raise


def _stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Stop ids: the model's generation-config eos ids plus the tokenizer's eos (Qwen chat models stop on
    ``<|im_end|>``, and their generation config also lists ``<|endoftext|>``)."""
    ids: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos is not None:
        ids.update(int(i) for i in config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an eos token")
    return sorted(ids)


class HFBackend(GenerationBackend):
    """Generation through transformers ``generate``.

    Args:
        model: a transformers image-text-to-text model, or a peft model around one.
        processor: its processor (chat template, tokenizer, image processor).
        max_model_len: context length for prompt + completion; a completion is cut (``"length"``) where it
            would exceed it, and a prompt that leaves no room is skipped. ``None``: no limit beyond
            ``max_new_tokens``.
        max_prompt_length: longest processed prompt (image tokens included) to generate from; longer prompts
            are skipped with a logged reason, never truncated. ``None``: no limit.
        batch_size: prompts per ``generate`` call (each expands to ``n`` rows); bounds the memory of the scores
            kept for log-probs (``max_new_tokens x batch_size x n x vocab`` floats). ``None``: all at once.
        suppress_vision_tokens: forbid the family's vision special tokens during generation (default). Turn off
            only for a model whose vocabulary has none.
        synced_gpus: pass ``synced_gpus=True`` to ``generate``: every rank of the process group keeps stepping
            (dummy forwards) until all ranks' sequences are done. Needed when ``model`` is FSDP-sharded, where each
            forward is a collective; the caller must then also make the same number of ``generate`` calls, with
            the same number of batches, on every rank. Off: transformers' default.
        family: the model's :class:`~pipelines.vlm.families.VLMFamily`; ``None`` detects it from
            ``model.config.model_type``.
        autocast_dtype: generate under ``torch.autocast`` in this dtype (a policy whose trained weights are
            float32 master weights of a bfloat16 model computes in bfloat16, as it does when it is scored);
            ``None``: in the weights' own dtypes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        *,
        max_model_len: int | None = None,
        max_prompt_length: int | None = None,
        batch_size: int | None = None,
        suppress_vision_tokens: bool = True,
        synced_gpus: bool = False,
        family: VLMFamily | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_length = max_prompt_length
        self.batch_size = batch_size
        self.synced_gpus = synced_gpus
        self.autocast_dtype = autocast_dtype
        self.family = family if family is not None else family_for_model_type(model.config.model_type)
        self.suppressed_token_ids: list[int] = (
            self.family.suppressed_token_ids(self.tokenizer) if suppress_vision_tokens else []
        )
        self.stop_token_ids = _stop_token_ids(model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.stop_token_ids[0]

    def _load_weights(self, model: torch.nn.Module) -> None:
        if model is self.model:
            # generate() runs on this very module, so it already sees the latest weights.
            return
        if hasattr(self.model, "peft_config"):
            raise ValueError(
                "sync_weights(other_model) copies merged weights into this backend's model, which must then be a "
                "plain transformers model, not a peft model"
            )
        target = dict(merged_state_dict(self.model))
        incoming = dict(merged_state_dict(model))
        if target.keys() != incoming.keys():
            missing = sorted(target.keys() - incoming.keys())[:5]
            extra = sorted(incoming.keys() - target.keys())[:5]
            raise ValueError(f"cannot sync weights: names differ (missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(incoming[name])

    def generate(self, prompts: Sequence[VLMPrompt], params: SamplingParams) -> GenerationResult:
        """Sample ``params.n`` completions per prompt; see the module docstring for the log-prob semantics.

        Seeded calls (``params.seed``) of this process run one at a time, so that concurrent ones (in-process
        pool workers) do not draw from each other's random stream; other code drawing from the global torch RNG
        in another thread meanwhile (dropout while training) still changes the samples.

        Args:
            prompts: chat prompts with images.
            params: sampling parameters.

        Returns:
            A :class:`GenerationResult`; prompts that cannot fit are listed in ``skipped``.
        """
        prepared, skipped = prepare_prompts(
            self.processor,
            prompts,
            max_prompt_length=self.max_prompt_length,
            max_model_len=self.max_model_len,
        )
        samples: list[GenerationSample] = []
        step = self.batch_size or max(len(prepared), 1)
        was_training = self.model.training
        # eval(): no dropout in rollouts, and gradient checkpointing (train-mode only) would disable the KV cache.
        self.model.eval()
        try:
            # A seeded call must not disturb the caller's random stream: fork the RNG of the device in use.
            device = next(self.model.parameters()).device
            devices = [device.index or 0] if device.type == "cuda" else []
            seeded = params.seed is not None
            with (
                _SEEDED_GENERATION if seeded else contextlib.nullcontext(),  # taken before the RNG is forked
                torch.random.fork_rng(devices=devices) if seeded else contextlib.nullcontext(),
                torch.autocast(device.type, dtype=self.autocast_dtype)
                if self.autocast_dtype is not None
                else contextlib.nullcontext(),
            ):
                if seeded:
                    torch.manual_seed(params.seed)
                for start in range(0, len(prepared), step):
                    samples.extend(self._generate_batch(prepared[start : start + step], params))
        finally:
            self.model.train(was_training)
        return GenerationResult(samples=samples, skipped=skipped, weight_version=self.weight_version)

    @torch.no_grad()
    def _generate_batch(
        self, prepared: list[PreparedPrompt], params: SamplingParams
    ) -> list[GenerationSample]:
        # 1. left-padded batch of processed prompts
        device = next(self.model.parameters()).device
        batch = {k: v.to(device) for k, v in collate_left_padded(prepared, self.pad_token_id).items()}
        P = batch["input_ids"].shape[1]
        greedy = params.temperature == 0
        # 2. generate; every knob explicit so the checkpoint's generation_config cannot alter the distribution
        out = self.model.generate(
            **batch,
            do_sample=not greedy,
            # None unsets a warper (greedy decoding has none, and unset flags avoid transformers' warnings)
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else 0,
            min_p=None,
            typical_p=None,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            suppress_tokens=self.suppressed_token_ids or None,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            synced_gpus=True if self.synced_gpus else None,  # None: transformers' own detection, as before
        )
        completions = out.sequences[:, P:]  # [B*n, T]
        # 3. behaviour log-probs: log_softmax of the processed scores, one step at a time to bound memory
        logprobs = torch.stack(
            [
                torch.log_softmax(score.float(), dim=-1).gather(-1, completions[:, t : t + 1]).squeeze(-1)
                for t, score in enumerate(out.scores)
            ],
            dim=1,
        ).cpu()  # [B*n, T]
        completions = completions.cpu()
        stop = torch.tensor(self.stop_token_ids)
        # 4. per sample: cut at the first stop token (kept) or at the context limit
        samples = []
        for row in range(completions.shape[0]):
            prompt = prepared[row // params.n]
            ids = completions[row]
            stops = torch.isin(ids, stop).nonzero()
            length = int(stops[0]) + 1 if len(stops) else ids.shape[0]
            finish = "stop" if len(stops) else "length"
            if self.max_model_len is not None and len(prompt.input_ids) + length > self.max_model_len:
                length = self.max_model_len - len(prompt.input_ids)
                finish = "length"
            token_ids = ids[:length].tolist()
            samples.append(
                GenerationSample(
                    prompt_index=prompt.index,
                    prompt_id=prompt.prompt_id,
                    sample_index=row % params.n,
                    prompt_token_ids=list(prompt.input_ids),
                    completion_token_ids=token_ids,
                    logprobs=logprobs[row, :length].clone(),
                    finish_reason=finish,
                    text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                    weight_version=self.weight_version,
                )
            )
        return samples
