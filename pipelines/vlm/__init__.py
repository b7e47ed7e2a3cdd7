"""VLM generation with behaviour log-probs, log-prob/entropy recomputation, weight sync, the tiny shapes VLM.

Modules (imported directly, so that ``import pipelines.vlm`` stays cheap):

- :mod:`pipelines.vlm.inputs`: prompts with images -> processor outputs, length checks that skip, never truncate
- :mod:`pipelines.vlm.backend`: the :class:`GenerationBackend` interface and its result dataclasses
- :mod:`pipelines.vlm.hf_backend`: transformers ``generate`` (CPU and GPU)
- :mod:`pipelines.vlm.vllm_backend`: colocated vLLM engine (CUDA GPU, ``pip install mmrl[vllm]``)
- :mod:`pipelines.vlm.weight_sync`: policy weights with LoRA merged, under Hugging Face names
- :mod:`pipelines.vlm.logprobs`: chunked completion log-probs and entropies for the trainer
- :mod:`pipelines.vlm.families`: one file per model family (Qwen2.5-VL, Qwen3-VL, Gemma 3): its model
  classes, vision tokens and how its processor is called, registered by ``model_type``
- :mod:`pipelines.vlm.published`: the published architectures built on the ``meta`` device, for memory
  estimates and real-size smoke tests without downloads
- :mod:`pipelines.vlm.tiny`: the tiny Qwen2.5-VL of the shapes world; ``tiny_qwen3_vl`` and ``tiny_gemma3``:
  tiny random builds of the other families, for tests

Never imports ``mmrl``. See docs/vlm_pipelines.md.
"""
