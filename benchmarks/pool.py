"""Rollout pool: overhead vs direct calls, throughput vs workers, synchronous vs asynchronous training, staleness.

    python -m benchmarks.pool [--requests 40] [--samples-per-request 8] [--steps 8] [--repeats 3] [--no-ray]

Everything runs on the tiny shapes flow model (a random 2-layer pixel-space SD3, 32x32, 8 steps; one request =
2 prompts x 4 samples, or ``--samples-per-request`` split over 2 prompts for parts 1 and 2: the pooled flow
trainer sends one request of a whole step's images per worker), one torch thread per process, Ray actors of
1 CPU:

1. **Overhead at equal work**: the same requests (same seeds, so bit-identical samples) run by direct
   ``rollout()`` calls in this process, by an in-process pool and by a 1-actor Ray pool; overhead =
   ``pool time / direct time - 1``, best of ``--repeats`` interleaved runs (goal < 5%). Also reported: the wall
   time per request not spent generating on the worker (dispatch, and for Ray moving the ~1 MB trajectory).
2. **Throughput vs workers**: samples/s of a Ray pool with 1 and 2 rollout actors on the same requests.
3. **Synchronous vs asynchronous training** (1 rollout actor, the trainer in this process): ``--steps`` steps of
   4 requests; each step re-scores the batch's transitions under a LoRA policy, takes an AdamW step and broadcasts
   the LoRA. ``max_staleness=0`` alternates generation and training; 1 and 2 let the actor generate the next
   steps' samples while the trainer trains. Reported: samples/s, the ratio to synchronous, and the distribution
   of per-sample version lags (the staleness the trainer's importance correction sees).

4. **The flow trainer on a pool** (``--trainer``): ``configs/demo/flow_shapes_async.yaml`` (the committed shapes
   checkpoint, in-process pool of 1 worker) for ``--trainer-steps`` steps at ``max_staleness`` 0 and 1, no
   evaluation: steps/s and the ratio, with the trainer's own lag metrics.

Actor start-up (importing torch/diffusers, loading the model) is excluded: pools are warmed up first.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import Counter
from dataclasses import replace

import torch

from pipelines.flow.adapters import load_adapter
from pipelines.flow.rollout import SamplingConfig, rescore, rollout
from pipelines.flow.tiny import build_shapes_pipeline
from pipelines.pool.executors import RayOptions
from pipelines.pool.flow_worker import FlowRolloutWorker
from pipelines.pool.pool import RolloutPool
from pipelines.pool.protocol import PoolBatch, RolloutRequest
from pipelines.pool.weights import make_update

PROMPTS = [
    "a photo of a red circle",
    "a photo of two blue squares",
    "a photo of a green triangle",
    "a photo of a yellow circle",
]
SAMPLING = SamplingConfig(num_steps=8, height=32, width=32)
COUNTS = (4, 4)


def make_requests(
    prefix: str, n: int, seed0: int = 0, counts: tuple[int, ...] = COUNTS
) -> list[RolloutRequest]:
    """``n`` requests of ``len(counts)`` prompts x ``counts`` samples (default 2 x 4)."""
    return [
        RolloutRequest(
            request_id=f"{prefix}-{i}",
            prompt_ids=[f"p{(i + j) % len(PROMPTS)}" for j in range(len(counts))],
            prompts=[PROMPTS[(i + j) % len(PROMPTS)] for j in range(len(counts))],
            counts=list(counts),
            seed=seed0 + i,
        )
        for i in range(n)
    ]


def renamed(requests: list[RolloutRequest], tag: str) -> list[RolloutRequest]:
    """The same work under fresh ids (a pool delivers each id once)."""
    return [replace(r, request_id=f"{tag}/{r.request_id}") for r in requests]


def wait_ready(pool: RolloutPool, n: int) -> None:
    while pool.num_workers < n:
        time.sleep(0.05)
    pool.run(make_requests(f"warmup{time.monotonic()}", n))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def overhead(model_dir: str, factory, requests: list[RolloutRequest], repeats: int, use_ray: bool) -> dict:
    """Best-of-``repeats`` wall times of the same requests: direct calls, in-process pool, Ray pool (1 actor)."""
    adapter = load_adapter("shapes", model_dir)

    def direct() -> None:
        for r in requests:
            rollout(adapter, r.prompts, r.counts, SAMPLING, torch.Generator().manual_seed(r.seed))

    pools = {"inprocess": RolloutPool(factory)}
    if use_ray:
        pools["ray"] = RolloutPool(factory, executor="ray", ray=RayOptions(num_cpus=1))
    try:
        for pool in pools.values():
            wait_ready(pool, 1)
        direct()  # warm-up
        times: dict[str, list[float]] = {"direct": [], **{name: [] for name in pools}}
        # per pool: wall time not spent generating on the worker (dispatch, transfer, (de)serialisation)
        outside: dict[str, list[float]] = {name: [] for name in pools}
        for rep in range(repeats):
            times["direct"].append(timed(direct))
            for name, pool in pools.items():
                start = time.perf_counter()
                batch = pool.run(renamed(requests, f"{name}{rep}"))
                times[name].append(time.perf_counter() - start)
                outside[name].append(times[name][-1] - sum(r.seconds for r in batch.results))
    finally:
        for pool in pools.values():
            pool.close()
    best = {name: min(values) for name, values in times.items()}
    return {
        "seconds": best,
        "overhead_pct": {name: 100 * (best[name] / best["direct"] - 1) for name in pools},
        "outside_worker_ms_per_request": {
            name: 1000 * min(values) / len(requests) for name, values in outside.items()
        },
    }


def throughput(factory, requests: list[RolloutRequest], workers: int) -> float:
    """Samples/s of a Ray pool with ``workers`` actors on ``requests`` (after warm-up)."""
    with RolloutPool(factory, workers, executor="ray", ray=RayOptions(num_cpus=1)) as pool:
        wait_ready(pool, workers)
        seconds = timed(lambda: pool.run(renamed(requests, f"tp{workers}")))
    return sum(r.num_samples for r in requests) / seconds


def train_step(adapter, optimizer: torch.optim.Optimizer, batch: PoolBatch) -> None:
    """One policy-gradient step on the batch: re-score every transition under the LoRA policy, AdamW step.

    The advantage is a stand-in reward (image brightness, normalised over the batch); the cost is what a real
    step costs: a forward and backward through the transformer for every transition.
    """
    optimizer.zero_grad()
    brightness = torch.cat([r.output.images.mean(dim=(1, 2, 3)) for r in batch.results])  # [B]
    advantages = (brightness - brightness.mean()) / (brightness.std() + 1e-6)
    offset = 0
    for result in batch.results:
        transitions = result.output.transitions()
        log_probs, _, _ = rescore(adapter, transitions)
        ratio = torch.exp(log_probs - transitions.log_probs)
        adv = advantages[offset + transitions.sample_index]
        (-(ratio * adv).mean() / len(batch.results)).backward()
        offset += result.num_samples
    optimizer.step()


def sync_vs_async(model_dir: str, factory, steps: int, per_step: int) -> dict:
    """Samples/s and lag histogram of the same training loop at ``max_staleness`` 0, 1, 2 (1 Ray actor)."""
    from peft import LoraConfig

    out = {}
    with RolloutPool(factory, executor="ray", ray=RayOptions(num_cpus=1)) as pool:
        wait_ready(pool, 1)
        for staleness in (0, 1, 2):
            adapter = load_adapter("shapes", model_dir)
            adapter.transformer.requires_grad_(False)
            adapter.transformer.add_adapter(
                LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
            )
            params = [p for p in adapter.transformer.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            pool.max_staleness = staleness
            lags: list[int] = []
            samples = 0
            start = time.perf_counter()
            stream = pool.stream(
                lambda s, k=staleness: make_requests(f"s{k}-{s}", per_step, seed0=100 * s), steps
            )
            for batch in stream:
                lags.extend(batch.sample_lags().tolist())
                samples += batch.num_samples
                train_step(adapter, optimizer, batch)
                pool.broadcast(make_update(adapter.transformer, version=pool.version + 1))
            seconds = time.perf_counter() - start
            out[staleness] = {
                "samples_per_s": samples / seconds,
                "lag_histogram": dict(sorted(Counter(lags).items())),
                "max_lag": max(lags),
            }
    for staleness in out:
        out[staleness]["ratio_to_sync"] = out[staleness]["samples_per_s"] / out[0]["samples_per_s"]
    return out


def trainer_sync_vs_async(steps: int) -> dict:
    """Steps/s of ``FlowGRPOTrainer`` on its in-process pool at ``max_staleness`` 0 and 1 (the demo config)."""
    from mmrl.config import load_config
    from mmrl.flow.config import FlowGRPOConfig
    from mmrl.flow.trainer import FlowGRPOTrainer

    out = {}
    for staleness in (0, 1):
        cfg = load_config(
            FlowGRPOConfig,
            "configs/demo/flow_shapes_async.yaml",
            [
                f"pool.max_staleness={staleness}",
                f"trainer.steps={steps}",
                "run.progress=false",
            ],
        )
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        trainer.train_step()  # warm-up: the worker's first request and the first backward
        trainer.step += 1
        lags = []
        start = time.perf_counter()
        for _ in range(steps):
            metrics = trainer.train_step()
            trainer.step += 1
            lags.append(metrics.get("pool/lag_mean", 0.0))
        seconds = time.perf_counter() - start
        trainer.cleanup()
        out[staleness] = {"steps_per_s": steps / seconds, "lag_mean": sum(lags) / len(lags)}
    out[1]["ratio_to_sync"] = out[1]["steps_per_s"] / out[0]["steps_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests of the overhead/throughput runs")
    parser.add_argument(
        "--samples-per-request",
        type=int,
        default=sum(COUNTS),
        help="samples per request of the overhead/throughput runs (2 prompts, half each)",
    )
    parser.add_argument("--steps", type=int, default=8, help="training steps of the sync/async runs")
    parser.add_argument("--per-step", type=int, default=4, help="requests per training step")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of the overhead runs (best kept)")
    parser.add_argument("--no-ray", action="store_true", help="only the in-process overhead")
    parser.add_argument("--trainer", action="store_true", help="only part 4: the flow trainer on a pool")
    parser.add_argument(
        "--trainer-steps", type=int, default=8, help="timed steps of part 4 (after one warm-up)"
    )
    args = parser.parse_args()
    if args.trainer:
        print(json.dumps(trainer_sync_vs_async(args.trainer_steps), indent=2))
        return
    torch.set_num_threads(
        1
    )  # every process one thread: the comparison is per core, and the CPU may be shared

    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        build_shapes_pipeline(
            PROMPTS, num_layers=2, num_attention_heads=2, attention_head_dim=16
        ).save_pretrained(model_dir)
        factory = functools.partial(
            FlowRolloutWorker.from_pretrained, "shapes", model_dir, SAMPLING, num_threads=1
        )
        half = args.samples_per_request // 2
        counts = (half, args.samples_per_request - half)
        requests = make_requests("r", args.requests, counts=counts)
        report: dict = {"samples_per_request": sum(counts), "requests": args.requests}
        ray = None
        if not args.no_ray:
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            report["overhead"] = overhead(model_dir, factory, requests, args.repeats, use_ray=ray is not None)
            if ray is not None:
                report["throughput_samples_per_s"] = {n: throughput(factory, requests, n) for n in (1, 2)}
                report["sync_vs_async"] = sync_vs_async(model_dir, factory, args.steps, args.per_step)
        finally:
            if ray is not None:
                ray.shutdown()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
