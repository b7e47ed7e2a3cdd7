"""Flow-model rollout worker: :func:`pipelines.flow.rollout.rollout` per request, optionally quantized."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.flow.adapters import FlowAdapter, load_adapter
from pipelines.flow.explore import explorer_weights
from pipelines.flow.rollout import Rollout, SamplingConfig, rollout
from pipelines.pool.protocol import FULL_PRECISION, RolloutRequest, WeightUpdate
from pipelines.pool.weights import apply_update
from pipelines.pool.workers import RolloutWorker
from pipelines.quant import QuantizedCopy, Scheme, quantize_copy, sync_lora


class FlowRolloutWorker(RolloutWorker):
    """Flow-model rollouts (:func:`pipelines.flow.rollout.rollout`), optionally through a quantized copy.

    A request's samples are ``rollout(adapter, prompts, counts, sampling, Generator().manual_seed(seed))``:
    the same request gives bit-identical samples on every worker with the same weights and device.
    ``precision = explorer_scheme`` runs the quantized copy instead (the cheap "explore" stage); the copy is
    re-merged from the full-precision LoRA model on every weight update (:func:`pipelines.quant.sync_lora`),
    never from its own quantized weights, so quantization error does not accumulate.

    Args:
        adapter: the model.
        sampling: how every request is sampled (steps, noise level, SDE window, size).
        explorer_scheme: build a quantized copy with this :data:`pipelines.quant.SCHEMES` entry.
        num_threads: see :class:`RolloutWorker`.
    """

    def __init__(
        self,
        adapter: FlowAdapter,
        sampling: SamplingConfig,
        explorer_scheme: Scheme | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(num_threads=num_threads)
        self.adapter = adapter
        self.sampling = sampling
        self.explorer: QuantizedCopy | None = (
            quantize_copy(adapter.transformer, explorer_scheme) if explorer_scheme is not None else None
        )

    @classmethod
    def from_pretrained(
        cls,
        family: str,
        model_id_or_path: str,
        sampling: SamplingConfig,
        *,
        device: str = "cpu",
        torch_dtype: torch.dtype = torch.float32,
        explorer_scheme: Scheme | None = None,
        num_threads: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        **load_kwargs: Any,
    ) -> FlowRolloutWorker:
        """Load the adapter with :func:`pipelines.flow.adapters.load_adapter` and wrap it (a worker factory);
        ``autocast_dtype`` is the adapter's mixed-precision compute dtype (``FlowAdapter.autocast_dtype``)."""
        if num_threads is not None:
            # before loading: model construction itself runs torch ops
            torch.set_num_threads(num_threads)
        adapter = load_adapter(
            family, model_id_or_path, torch_dtype=torch_dtype, device=device, **load_kwargs
        )
        adapter.autocast_dtype = autocast_dtype
        adapter.transformer.requires_grad_(False)
        return cls(adapter, sampling, explorer_scheme=explorer_scheme)

    def generate(self, request: RolloutRequest) -> Rollout:
        generator = torch.Generator().manual_seed(request.seed)
        if request.precision == FULL_PRECISION:
            return rollout(self.adapter, request.prompts, request.counts, self.sampling, generator)
        if self.explorer is None or request.precision != self.explorer.scheme:
            held = [FULL_PRECISION] + ([self.explorer.scheme] if self.explorer is not None else [])
            raise ValueError(
                f"request {request.request_id!r} asks for precision {request.precision!r}; "
                f"this worker holds {held}"
            )
        with explorer_weights(self.adapter, self.explorer.module):
            return rollout(self.adapter, request.prompts, request.counts, self.sampling, generator)

    def apply_weights(self, update: WeightUpdate) -> None:
        apply_update(self.adapter.transformer, update)
        if self.explorer is not None:
            if update.kind == "lora":
                sync_lora(self.explorer, self.adapter.transformer)
            else:
                # full fine-tuning changed every weight: re-quantize the whole copy from the new weights
                self.explorer = quantize_copy(self.adapter.transformer, self.explorer.scheme)

    def reward_inputs(self, request: RolloutRequest, output: Rollout) -> dict[str, Any]:
        batch: dict[str, Any] = {"images": output.images, "prompts": output.prompts}
        if request.metadata is not None:
            batch["metadata"] = [request.metadata[g] for g in output.group_index.tolist()]
        return batch
