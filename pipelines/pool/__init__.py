"""Rollout pools: rollout and reward workers feeding one trainer, in-process or on a Ray cluster.

Modules (imported directly, so that ``import pipelines.pool`` stays cheap and a Ray actor imports only what its
worker needs: a reward actor never loads diffusers):

- :mod:`pipelines.pool.pool`: :class:`RolloutPool` (dispatch, staleness control, partial rollouts, faults)
- :mod:`pipelines.pool.protocol`: requests, results, batches, weight updates, errors
- :mod:`pipelines.pool.executors`: in-process threads or Ray actors (``pip install mmrl[ray]``)
- :mod:`pipelines.pool.workers`: the rollout-worker base class and :class:`RewardWorker`
- :mod:`pipelines.pool.flow_worker`: flow-model rollouts, optionally through a quantized copy
- :mod:`pipelines.pool.vlm_worker`: VLM rollouts through a generation backend
- :mod:`pipelines.pool.weights`: LoRA-only or full weight payloads

Never imports ``mmrl``. See docs/pools.md.
"""
