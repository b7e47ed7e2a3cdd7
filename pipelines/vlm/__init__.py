"""VLM generation with behaviour log-probs, log-prob/entropy recomputation, weight sync, the tiny shapes VLM.

Modules (imported directly, so that ``import pipelines.vlm`` stays cheap):

- :mod:`pipelines.vlm.inputs`: prompts with images -> processor outputs, length checks that skip, never truncate
- :mod:`pipelines.vlm.backend`: the :class:`GenerationBackend` interface and its result dataclasses
- :mod:`pipelines.vlm.hf_backend`: transformers ``generate`` (CPU and GPU)
- :mod:`pipelines.vlm.vllm_backend`: colocated vLLM engine (CUDA GPU, ``pip install mmrl[vllm]``)
- :mod:`pipelines.vlm.weight_sync`: policy weights with LoRA merged, under Hugging Face names
- :mod:`pipelines.vlm.logprobs`: chunked completion log-probs and entropies for the trainer
- :mod:`pipelines.vlm.tiny`: the tiny Qwen2.5-VL of the shapes world

Never imports ``mmrl``. See docs/vlm_pipelines.md.
"""
