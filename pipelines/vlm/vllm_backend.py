"""vLLM generation backend (CUDA GPU only): a colocated engine, sleep mode, weight sync, optional FP8 rollout.

The engine lives in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weight sync is an in-memory
``model.load_weights`` on the engine's model, no serialization. Between rollouts the engine sleeps (sleep mode
level 1 offloads its weights to CPU memory and frees the KV cache), so the trainer has the GPU to itself.
A step runs ``wake_up() -> sync_weights(policy) -> generate() -> sleep()``.

Weight sync merges the policy's LoRA out of place (``W + scaling * B @ A``, see
:mod:`pipelines.vlm.weight_sync`) and streams ``(hf_name, tensor)`` pairs to ``load_weights``, which maps the
Hugging Face names to vLLM's layout.

Log-probs: the engine is built with ``logprobs_mode="processed_logprobs"``, i.e. log-probs of the distribution
tokens are sampled from (after temperature, logit bias and top-p), the same semantics as the transformers
backend. Vision special tokens get a logit bias of -100 (probability ~e-44), vLLM's way to suppress a token.

FP8 rollout (``quantization="fp8"``): vLLM quantizes the bf16 checkpoint to FP8 when it loads it, and
``load_weights`` must re-quantize the bf16 weights pushed at each sync; that needs a vLLM whose
``load_weights`` supports online-quantized models (vllm-project/vllm#26327; older versions fail with a shape
assertion, vllm-project/vllm#17272). The rollout then differs from the bf16 policy: train with truncated
importance sampling on the behaviour log-probs this backend returns.

Install with ``pip install mmrl[vllm]``; vLLM is imported only when a :class:`VLLMBackend` is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch

from pipelines.vlm.backend import GenerationBackend, GenerationResult, GenerationSample, SamplingParams
from pipelines.vlm.families import VLMFamily, family_for_model_type
from pipelines.vlm.inputs import PreparedPrompt, VLMPrompt, prepare_prompts
from pipelines.vlm.weight_sync import merged_state_dict

#: Logit bias that removes a token in practice; vLLM (and the OpenAI API it mirrors) caps biases at +-100.
SUPPRESS_BIAS = -100.0


def import_vllm() -> Any:
    """Import vLLM, or raise an error saying how to get it and that it needs a CUDA GPU."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "the vLLM generation backend needs vLLM and a CUDA GPU: install it with `pip install mmrl[vllm]`, "
            "or use pipelines.vlm.hf_backend.HFBackend (transformers, CPU or GPU)"
        ) from error
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the vLLM generation backend needs a CUDA GPU and none is visible; "
            "use pipelines.vlm.hf_backend.HFBackend on this machine"
        )
    return vllm


def check_in_process(engine_kwargs: dict[str, Any]) -> None:
    """Refuse an engine whose model would live in other processes, where weight sync cannot reach it.

    ``sync_weights`` hands ``load_weights`` a stream of the policy's tensors through ``LLM.apply_model``, which
    runs in the engine's own process only with vLLM's uniprocess executor and engine core. Tensor or pipeline
    parallelism, another executor backend, or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` put the model in worker
    processes, and vLLM would have to pickle the stream (a generator, which cannot be). One engine per GPU, as
    many as the pool has members, is the supported layout.

    Raises:
        ValueError: naming the argument or the environment variable.
    """
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if engine_kwargs.get(key, 1) != 1:
            raise ValueError(
                f"engine_kwargs {key}={engine_kwargs[key]!r}: weight sync writes into the engine's model in this "
                "process, which an engine spread over several GPUs does not have; run one engine per GPU "
                "(a rollout pool's members, pool.num_workers) instead"
            )
    backend = engine_kwargs.get("distributed_executor_backend")
    if backend not in (None, "uni"):
        raise ValueError(
            f"engine_kwargs distributed_executor_backend={backend!r}: weight sync needs vLLM's uniprocess "
            "executor ('uni'), the one that keeps the model in this process"
        )
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise ValueError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r} is set: it runs the "
            "engine core, and the model that weight sync writes into, in another process; unset it (the backend "
            "runs the engine in this process)"
        )


def build_requests(prepared: Sequence[PreparedPrompt]) -> list[dict[str, Any]]:
    """vLLM prompt dicts (``TextPrompt``): the chat-templated text and its images as multimodal data.

    The text keeps the chat template's one image placeholder per image (Qwen-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``; Gemma 3: ``<start_of_image>``); vLLM's input processor of
    the family expands each to the image's token count, as the HF processor did when measuring the prompt.
    """
    requests = []
    for prompt in prepared:
        request: dict[str, Any] = {"prompt": prompt.text}
        if prompt.images:
            request["multi_modal_data"] = {"image": list(prompt.images)}
        requests.append(request)
    return requests


def sampling_kwargs(params: SamplingParams, suppressed_token_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to ``params``.

    Every knob is explicit (``top_k=-1``: off, ``repetition_penalty=1``, ``min_p=0``) so that a model's
    ``generation_config.json`` defaults, which vLLM applies otherwise, cannot change the sampled distribution.
    ``logprobs=0`` asks for the sampled token's log-prob only.
    """
    kwargs: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "seed": params.seed,
        "skip_special_tokens": True,
    }
    if suppressed_token_ids:
        kwargs["logit_bias"] = {int(i): SUPPRESS_BIAS for i in suppressed_token_ids}
    return kwargs


def parse_outputs(
    request_outputs: Sequence[Any],
    prepared: Sequence[PreparedPrompt],
    weight_version: int,
) -> list[GenerationSample]:
    """Turn vLLM ``RequestOutput`` objects into :class:`GenerationSample` s.

    Reads ``request_output.prompt_token_ids`` (image tokens expanded by vLLM) and, per ``CompletionOutput``,
    ``token_ids`` (the stop token included, as in the transformers backend), ``text``, ``finish_reason`` and
    ``logprobs`` (one ``{token_id: Logprob}`` mapping per generated token).

    Raises:
        RuntimeError: a request was aborted or returned no log-probs.
    """
    if len(request_outputs) != len(prepared):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prepared)} prompts")
    samples = []
    for prompt, output in zip(prepared, request_outputs, strict=True):
        for sample_index, completion in enumerate(output.outputs):
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"prompt {prompt.index} (id {prompt.prompt_id!r}): vLLM finished a sample with "
                    f"{completion.finish_reason!r}"
                )
            token_ids = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
                raise RuntimeError(
                    f"prompt {prompt.index}: vLLM returned no per-token log-probs (the request needs logprobs=0)"
                )
            logprobs = torch.tensor(
                [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)],
                dtype=torch.float32,
            )
            samples.append(
                GenerationSample(
                    prompt_index=prompt.index,
                    prompt_id=prompt.prompt_id,
                    sample_index=sample_index,
                    prompt_token_ids=[int(t) for t in output.prompt_token_ids],
                    completion_token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    text=completion.text,
                    weight_version=weight_version,
                )
            )
    return samples


class VLLMBackend(GenerationBackend):
    """Colocated vLLM engine behind the :class:`~pipelines.vlm.backend.GenerationBackend` interface.

    Args:
        model_path: local directory or hub id of the policy's base model (what ``from_pretrained`` takes).
        processor: the model's processor, used to apply the chat template and measure prompts; loaded from
            ``model_path`` with ``AutoProcessor`` when ``None``.
        max_model_len: engine context length (prompt + completion); completions that reach it finish with
            ``"length"``, prompts that leave no room are skipped.
        max_prompt_length: longest processed prompt (image tokens included) to generate from; longer prompts
            are skipped with a logged reason, never truncated. ``None``: no limit beyond ``max_model_len``.
        gpu_memory_utilization: fraction of GPU memory the engine may take while awake (weights + KV cache);
            colocated with training, 0.3-0.5 leaves room for the trainer.
        quantization: ``"fp8"`` for FP8 rollouts (see the module docstring), ``None`` for the model's dtype.
        dtype: engine dtype for unquantized weights.
        sleep_level: 1 offloads weights to CPU while asleep (cheap wake-up), 2 discards them (a sync must
            follow every wake-up, which the trainer does anyway).
        enable_sleep_mode: turn off to keep the engine resident (e.g. a dedicated rollout GPU).
        max_images_per_prompt: vLLM's ``limit_mm_per_prompt`` for images.
        suppress_vision_tokens: bias the family's vision special tokens away (default).
        family: the model's :class:`~pipelines.vlm.families.VLMFamily`; ``None`` detects it from the
            checkpoint's ``model_type``.
        seed: engine seed.
        engine_kwargs: extra ``vllm.LLM`` arguments (``enforce_eager``, ``max_num_seqs``, ...); an engine spread
            over several GPUs is refused (:func:`check_in_process`).
    """

    def __init__(
        self,
        model_path: str,
        processor: Any | None = None,
        *,
        max_model_len: int = 4096,
        max_prompt_length: int | None = None,
        gpu_memory_utilization: float = 0.4,
        quantization: Literal["fp8"] | None = None,
        dtype: str = "bfloat16",
        sleep_level: Literal[1, 2] = 1,
        enable_sleep_mode: bool = True,
        max_images_per_prompt: int = 1,
        suppress_vision_tokens: bool = True,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
        family: VLMFamily | None = None,
    ) -> None:
        super().__init__()
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        self._vllm = import_vllm()
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(model_path)
        self.processor = processor
        self.max_model_len = max_model_len
        self.max_prompt_length = max_prompt_length
        self.sleep_level = sleep_level
        self.enable_sleep_mode = enable_sleep_mode
        if family is None:
            from transformers import AutoConfig

            family = family_for_model_type(AutoConfig.from_pretrained(model_path).model_type)
        self.family = family
        self.suppressed_token_ids: list[int] = (
            family.suppressed_token_ids(processor.tokenizer) if suppress_vision_tokens else []
        )
        check_in_process(engine_kwargs or {})
        # Colocation: run the engine core in this process so load_weights reaches the model in memory.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = self._vllm.LLM(
            model=model_path,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            limit_mm_per_prompt={"image": max_images_per_prompt},
            logprobs_mode="processed_logprobs",
            seed=seed,
            **(engine_kwargs or {}),
        )
        self._asleep = False
        # False after a level-2 sleep discarded the weights, until the next sync writes them again.
        self._weights_valid = True

    def generate(self, prompts: Sequence[VLMPrompt], params: SamplingParams) -> GenerationResult:
        """Sample ``params.n`` completions per prompt with the engine (waking it if asleep).

        Raises:
            RuntimeError: the engine slept at level 2 (weights discarded) and no ``sync_weights`` followed.
        """
        if not self._weights_valid:
            raise RuntimeError(
                "the engine slept with sleep_level=2, which discards its weights; sync_weights first"
            )
        if self._asleep:
            self.wake_up()
        prepared, skipped = prepare_prompts(
            self.processor,
            prompts,
            max_prompt_length=self.max_prompt_length,
            max_model_len=self.max_model_len,
        )
        if not prepared:
            return GenerationResult(samples=[], skipped=skipped, weight_version=self.weight_version)
        sampling = self._vllm.SamplingParams(**sampling_kwargs(params, self.suppressed_token_ids))
        outputs = self.llm.generate(build_requests(prepared), sampling_params=sampling, use_tqdm=False)
        samples = parse_outputs(outputs, prepared, self.weight_version)
        return GenerationResult(samples=samples, skipped=skipped, weight_version=self.weight_version)

    def _load_weights(self, model: torch.nn.Module) -> None:
        if self._asleep:
            # Level 2 discarded the weights: restore their memory before writing into it.
            self.llm.wake_up(tags=["weights"])
        weights = merged_state_dict(model)
        # apply_model runs the function on the engine's nn.Module (in-process, see __init__).
        self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        # prefix-cached key/value states (prompt and image tokens) were computed with the old weights
        self.llm.reset_prefix_cache()
        self._weights_valid = True
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def sleep(self) -> None:
        """Offload (level 1) or discard (level 2) the engine's weights and free its KV cache."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self._weights_valid = self.sleep_level == 1

    def wake_up(self) -> None:
        """Bring back weights and KV cache after :meth:`sleep`."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
