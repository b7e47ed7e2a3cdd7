"""Training steps on a shared CPU: step time alone and beside a competing 2-thread torch process.

    python -m benchmarks.shared_cpu [--models flow vlm] [--policies default passive mmrl threads1] [--steps 3]
                                    [--repeats 1]

For each model (the flow demo's NFT step, ``configs/demo/flow_shapes.yaml``; the VLM demo's single-rollout step,
``configs/demo/vlm_shapes_single.yaml``) and each OpenMP policy, a fresh process (the wait policy is read when
torch loads) builds the trainer, takes one warm-up step and times ``--steps`` steps, once on the quiet machine and
once while a competitor runs: another process multiplying 1024x1024 matrices with 2 torch threads in a loop, as
a second job on the machine would. Runs are interleaved (quiet, loaded, next policy, ...) so drifts of the machine
hit every policy alike. Policies:

* ``default``: libgomp's own (waiting threads spin 300,000 times before they sleep), named as
  ``GOMP_SPINCOUNT=300000`` so that mmrl does not apply its own default;
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep at once);
* ``mmrl``: mmrl's default, ``GOMP_SPINCOUNT=2000`` (spin briefly, then sleep);
* ``spin=N``: ``GOMP_SPINCOUNT=N``, to try other counts;
* ``threads1``: one torch thread (``run.threads=1``, mmrl's wait default), nothing to wait for.

Reported per model and policy: the median quiet and loaded step time, the slowdown (loaded / quiet) and the
quiet time relative to the default policy's. Goal: loaded <= 2.2x quiet, with no loss at quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES: dict[str, dict[str, str]] = {
    # libgomp's documented default spin count, named so that mmrl does not put its own default in place
    "default": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "mmrl": {"GOMP_SPINCOUNT": "2000"},
    "threads1": {},
}
CONFIGS = {"flow": "configs/demo/flow_shapes.yaml", "vlm": "configs/demo/vlm_shapes_single.yaml"}
COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.randn(1024, 1024)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)


def _policy_env(policy: str) -> dict[str, str]:
    """The environment of a worker: the parent's without OpenMP wait settings, plus the policy's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    }
    env.update(policy_settings(policy))
    return env


def policy_settings(policy: str) -> dict[str, str]:
    """The variables of a named policy, or of ``spin=N`` (``GOMP_SPINCOUNT=N``, any count)."""
    if policy in POLICIES:
        return POLICIES[policy]
    name, _, count = policy.partition("=")
    if name != "spin" or not count.isdigit():
        raise argparse.ArgumentTypeError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)} or spin=N")
    return {"GOMP_SPINCOUNT": count}


def policy_name(policy: str) -> str:
    """argparse type of ``--policies``: a known policy name or ``spin=N``."""
    policy_settings(policy)
    return policy


def worker(model: str, steps: int, threads: int | None) -> dict[str, object]:
    """Build the demo trainer, take one warm-up step, time ``steps`` steps (runs in the child process)."""
    import torch

    from mmrl.config import load_config

    overrides = ["run.progress=false", "run.tensorboard=false", f"run.threads={threads or 'null'}"]
    if model == "flow":
        from mmrl.flow.config import FlowGRPOConfig as config_cls
        from mmrl.flow.trainer import FlowGRPOTrainer as trainer_cls
    else:
        from mmrl.vlm.config import VLMRLVRConfig as config_cls
        from mmrl.vlm.trainer import VLMRLVRTrainer as trainer_cls
    trainer = trainer_cls(load_config(config_cls, CONFIGS[model], overrides), None)
    trainer.setup()
    trainer.train_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return {"times": times, "threads": torch.get_num_threads()}


def _run_worker(model: str, policy: str, steps: int, loaded: bool) -> list[float]:
    competitor = None
    if loaded:
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_policy_env("default"))
        time.sleep(2.0)  # let it start its loop
    try:
        threads = "1" if policy == "threads1" else "0"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.shared_cpu",
                "--worker",
                model,
                "--steps",
                str(steps),
                "--threads",
                threads,
            ],
            env=_policy_env(policy),
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])["times"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["flow", "vlm"], choices=sorted(CONFIGS))
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), type=policy_name, help="names or spin=N"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the interleaved runs")
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.steps, args.threads or None)
        print(json.dumps(result))
        return result
    samples: dict[tuple[str, str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for model in args.models:
            for policy in args.policies:
                for loaded in (False, True):
                    times = _run_worker(model, policy, args.steps, loaded)
                    samples.setdefault((model, policy, loaded), []).extend(times)
                    print(
                        f"{model:5s} {policy:9s} {'loaded' if loaded else 'quiet':7s} "
                        + " ".join(f"{t:.2f}" for t in times),
                        flush=True,
                    )
    report: dict[str, object] = {}
    print(
        f"\n{'model':5s} {'policy':9s} {'quiet s':>8s} {'loaded s':>9s} {'slowdown':>9s} {'quiet vs default':>17s}"
    )
    for model in args.models:
        base = statistics.median(samples[(model, "default", False)]) if "default" in args.policies else None
        for policy in args.policies:
            quiet = statistics.median(samples[(model, policy, False)])
            loaded = statistics.median(samples[(model, policy, True)])
            rel = quiet / base if base else float("nan")
            report[f"{model}/{policy}"] = {
                "quiet_s": quiet,
                "loaded_s": loaded,
                "slowdown": loaded / quiet,
                "quiet_vs_default": rel,
            }
            print(f"{model:5s} {policy:9s} {quiet:8.2f} {loaded:9.2f} {loaded / quiet:8.2f}x {rel:16.2f}x")
    return report


if __name__ == "__main__":
    main()
