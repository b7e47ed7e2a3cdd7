"""VLM rollout worker: a :class:`pipelines.vlm.backend.GenerationBackend` per request, samples seeded."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pipelines.pool.protocol import RolloutRequest, WeightUpdate
from pipelines.pool.weights import apply_update
from pipelines.pool.workers import RolloutWorker
from pipelines.vlm.backend import GenerationBackend, GenerationResult, SamplingParams


class VLMRolloutWorker(RolloutWorker):
    """VLM rollouts through a :class:`pipelines.vlm.backend.GenerationBackend` (transformers or vLLM).

    Prompts with equal counts are generated in one ``generate`` call with ``n = count``, each call seeded from
    ``request.seed``; samples come back in request order, ``prompt_index`` relative to the request, each stamped
    with the pool's weight version.

    Args:
        backend: the generation engine.
        model: the torch module weight updates are loaded into; ``backend.sync_weights(model)`` then pushes it
            to the engine (for :class:`pipelines.vlm.hf_backend.HFBackend` built on ``model`` that is free; an
            engine that holds its own weights, vLLM, gets ``model``'s weights with its LoRA merged,
            :func:`pipelines.vlm.weight_sync.merged_state_dict`).
        params: sampling parameters; ``n`` and ``seed`` come from each request.
        num_threads: see :class:`RolloutWorker`.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        model: torch.nn.Module,
        params: SamplingParams,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(num_threads=num_threads)
        self.backend = backend
        self.model = model
        self.params = params

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str,
        params: SamplingParams,
        *,
        device: str = "cpu",
        torch_dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        **backend_kwargs: Any,
    ) -> VLMRolloutWorker:
        """A transformers model + processor in an :class:`HFBackend` (a worker factory)."""
        from pipelines.vlm.hf_backend import HFBackend

        model, processor = _load(model_id_or_path, device, torch_dtype, num_threads)
        return cls(HFBackend(model, processor, **backend_kwargs), model, params)

    @classmethod
    def from_vllm(
        cls,
        model_id_or_path: str,
        params: SamplingParams,
        *,
        torch_dtype: torch.dtype = torch.bfloat16,
        num_threads: int | None = None,
        **vllm_kwargs: Any,
    ) -> VLMRolloutWorker:
        """A :class:`~pipelines.vlm.vllm_backend.VLLMBackend` engine on ``model_id_or_path`` (a worker factory).

        The engine loads the checkpoint itself, on the process's first visible CUDA GPU. Weight updates go into
        a transformers copy of the model on CPU (the holder: a LoRA payload is injected into it with
        ``add_adapter`` exactly as in the transformers worker, so it needs the same module structure), and
        :meth:`apply_weights` then pushes the holder's weights, LoRA merged (``W + scaling * B @ A``), into the
        engine. Until the first update the engine runs the checkpoint, which is what the holder holds.

        Args:
            model_id_or_path: local directory or hub id (the engine and the holder load the same checkpoint).
            params: sampling parameters; ``n`` and ``seed`` come from each request.
            torch_dtype: the holder's dtype, in which the merged weights are pushed (the LoRA merge itself is
                computed in fp32); the engine's is ``vllm_kwargs["dtype"]``.
            num_threads: see :class:`RolloutWorker`.
            vllm_kwargs: :class:`~pipelines.vlm.vllm_backend.VLLMBackend` arguments (``max_model_len``,
                ``gpu_memory_utilization``, ``quantization``, ``dtype``, ``seed``, ...).

        Raises:
            ImportError: vLLM is not installed (``pip install mmrl[vllm]``).
            RuntimeError: no CUDA GPU is visible.
        """
        from pipelines.vlm.vllm_backend import VLLMBackend, import_vllm

        import_vllm()  # fail before loading the holder: vLLM and a CUDA GPU are needed
        model, processor = _load(model_id_or_path, "cpu", torch_dtype, num_threads)
        return cls(VLLMBackend(model_id_or_path, processor, **vllm_kwargs), model, params)

    def generate(self, request: RolloutRequest) -> GenerationResult:
        # one seed per distinct count, drawn from the request seed: reproducible and distinct across calls
        groups: dict[int, list[int]] = {}
        for index, count in enumerate(request.counts):
            groups.setdefault(int(count), []).append(index)
        seeds = torch.randint(
            0, 2**31 - 1, (len(groups),), generator=torch.Generator().manual_seed(request.seed)
        )
        by_prompt: dict[int, list] = {}
        skipped = []
        for (count, indices), seed in zip(groups.items(), seeds.tolist(), strict=True):
            params = replace(self.params, n=count, seed=int(seed))
            result = self.backend.generate([request.prompts[i] for i in indices], params)
            for sample in result.samples:
                index = indices[sample.prompt_index]
                by_prompt.setdefault(index, []).append(
                    replace(sample, prompt_index=index, weight_version=self.version)
                )
            skipped.extend(replace(s, index=indices[s.index]) for s in result.skipped)
        samples = [s for index in sorted(by_prompt) for s in by_prompt[index]]
        return GenerationResult(
            samples=samples, skipped=sorted(skipped, key=lambda s: s.index), weight_version=self.version
        )

    def apply_weights(self, update: WeightUpdate) -> None:
        apply_update(self.model, update)
        self.backend.sync_weights(self.model)

    def reward_inputs(self, request: RolloutRequest, output: GenerationResult) -> dict[str, Any]:
        batch: dict[str, Any] = {"completions": [s.text for s in output.samples]}
        if request.metadata is not None:
            meta = [request.metadata[s.prompt_index] for s in output.samples]
            batch["metadata"] = meta
            batch["ground_truths"] = [m.get("ground_truth") for m in meta]
        return batch

    def sample_count(self, request: RolloutRequest, output: GenerationResult) -> int:
        return len(output.samples)


def _load(
    model_id_or_path: str, device: str, torch_dtype: torch.dtype, num_threads: int | None
) -> tuple[Any, Any]:
    """The frozen transformers model on ``device`` and its processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    model = AutoModelForImageTextToText.from_pretrained(model_id_or_path, dtype=torch_dtype).to(device)
    model.requires_grad_(False)
    return model, AutoProcessor.from_pretrained(model_id_or_path)
