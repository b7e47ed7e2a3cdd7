"""Training steps on a shared CPU: step time alone and beside a competing 2-thread torch process.

    python -m benchmarks.shared_cpu [--models flow vlm] [--policies default passive spin=2000 adaptive]
                                    [--steps 3] [--repeats 1] [--competitor-from-step K]

For each model (the flow demo's NFT step, ``configs/demo/flow_shapes.yaml``; the VLM demo's single-rollout step,
``configs/demo/vlm_shapes_single.yaml``) and each policy, a fresh process (the wait policy is read when torch
loads) builds the trainer, takes one warm-up step and times ``--steps`` steps, once on the quiet machine and once
while a competitor runs: another process multiplying 1024x1024 matrices with 2 torch threads in a loop, as a
second job on the machine would. The competitor starts 2 s before the trainer's process, or, with
``--competitor-from-step K``, just before timed step K (1-based) of a running process, to see how soon a policy
notices it. Each step goes through :func:`pipelines.threads.adapt_cpu_threads`, as in the training loop. Runs are
interleaved (quiet, loaded, next policy, ...) so drifts of the machine hit every policy alike. Policies:

* ``default``: libgomp's own (waiting threads spin 300,000 times before they sleep), named as
  ``GOMP_SPINCOUNT=300000`` so that mmrl does not choose its own, ``run.threads_policy=fixed``;
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep at once), ``run.threads_policy=fixed``;
* ``spin=N``: ``GOMP_SPINCOUNT=N``, ``run.threads_policy=fixed`` (``spin=2000``: mmrl's default before the
  adaptive one);
* ``adaptive``: mmrl's default: the wait policy chosen from the machine's state when the process starts, and
  ``run.threads_policy=adaptive`` (pipelines/threads.py);
* ``threads1``: one torch thread (``run.threads=1``), nothing to wait for.

Reported per model and policy: the median quiet and loaded step time, the slowdown (loaded / quiet), the
slowdown of each round on its own (that round's loaded median over its quiet median: the spread a single run of
the benchmark shows), the quiet time relative to the default policy's, the wait policy the process ran with and,
per step, whether the adaptive short spin was on.
Goal: loaded <= 2.2x quiet, with no loss at quiet.
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
    "spin=2000": {"GOMP_SPINCOUNT": "2000"},
    "adaptive": {},
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


def worker(model: str, steps: int, threads: int | None, threads_policy: str) -> dict[str, object]:
    """Build the demo trainer, take one warm-up step, time ``steps`` steps (runs in the child process); prints one
    JSON line per timed step (the parent may start the competitor on it) and returns the summary."""
    # mmrl first: it chooses the OpenMP wait policy, which torch's runtime reads when it loads
    from mmrl.config import load_config
    from pipelines.threads import adapt_cpu_threads

    overrides = [
        "run.progress=false",
        "run.tensorboard=false",
        f"run.threads={threads or 'null'}",
        f"run.threads_policy={threads_policy}",
    ]
    if model == "flow":
        from mmrl.flow.config import FlowGRPOConfig as config_cls
        from mmrl.flow.trainer import FlowGRPOTrainer as trainer_cls
    else:
        from mmrl.vlm.config import VLMRLVRConfig as config_cls
        from mmrl.vlm.trainer import VLMRLVRTrainer as trainer_cls
    trainer = trainer_cls(load_config(config_cls, CONFIGS[model], overrides), None)
    trainer.setup()
    adapt_cpu_threads()
    trainer.train_step()
    print(json.dumps({"step": 0}), flush=True)  # warmed up
    times, short = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        # the training loop's call, timed as part of the step it decides for
        short.append(bool(adapt_cpu_threads()))
        trainer.train_step()
        times.append(time.perf_counter() - start)
        print(json.dumps({"step": step, "seconds": times[-1], "short_spin": short[-1]}), flush=True)
    wait = {key: os.environ[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in os.environ}
    import torch  # loaded long ago by the trainer, after mmrl

    return {"times": times, "short_spin": short, "wait": wait, "threads": torch.get_num_threads()}


def _start_competitor() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_policy_env("default"))


def _run_worker(model: str, policy: str, steps: int, loaded: bool, competitor_from: int) -> dict[str, object]:
    """One worker process; ``loaded``: beside the competitor, started 2 s before the worker
    (``competitor_from`` 0) or just before its timed step ``competitor_from`` (after the warm-up step for 1)."""
    competitor = None
    if loaded and competitor_from == 0:
        competitor = _start_competitor()
        time.sleep(2.0)  # let it start its loop
    threads = "1" if policy == "threads1" else "0"
    threads_policy = "adaptive" if policy == "adaptive" else "fixed"
    command = [sys.executable, "-m", "benchmarks.shared_cpu", "--worker", model, "--steps", str(steps)]
    command += ["--threads", threads, "--threads-policy", threads_policy]
    try:
        with subprocess.Popen(command, env=_policy_env(policy), stdout=subprocess.PIPE, text=True) as process:
            lines = []
            for line in process.stdout:
                lines.append(line)
                done = json.loads(line).get("step") if line.startswith('{"step"') else None
                if loaded and competitor is None and done == competitor_from - 1:
                    competitor = _start_competitor()
        if process.returncode:
            raise RuntimeError(f"{model}/{policy} worker exited with {process.returncode}")
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["flow", "vlm"], choices=sorted(CONFIGS))
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["default", "passive", "spin=2000", "adaptive"],
        type=policy_name,
        help="names or spin=N",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the interleaved runs")
    parser.add_argument(
        "--competitor-from-step",
        type=int,
        default=0,
        help="start the competitor just before this timed step of a running process (0: before the process)",
    )
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads-policy", default="fixed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.steps, args.threads or None, args.threads_policy)
        print(json.dumps(result))
        return result
    if not 0 <= args.competitor_from_step <= args.steps:
        parser.error(f"--competitor-from-step must be within 0..--steps ({args.steps})")
    samples: dict[tuple[str, str, bool], list[float]] = {}
    round_medians: dict[tuple[str, str, bool], list[float]] = {}
    seen: dict[tuple[str, str, bool], set[str]] = {}
    for _ in range(args.repeats):
        for model in args.models:
            for policy in args.policies:
                for loaded in (False, True):
                    result = _run_worker(model, policy, args.steps, loaded, args.competitor_from_step)
                    times = result["times"]
                    if loaded and args.competitor_from_step:  # only the steps beside the competitor
                        times = times[args.competitor_from_step - 1 :]
                    samples.setdefault((model, policy, loaded), []).extend(times)
                    round_medians.setdefault((model, policy, loaded), []).append(statistics.median(times))
                    wait = " ".join(f"{k}={v}" for k, v in result["wait"].items()) or "libgomp default"
                    seen.setdefault((model, policy, loaded), set()).add(wait)
                    print(
                        f"{model:5s} {policy:9s} {'loaded' if loaded else 'quiet':7s} "
                        + " ".join(f"{t:.2f}" for t in result["times"])
                        + f"  {result['threads']} threads, short spin "
                        + "".join("y" if short else "n" for short in result["short_spin"])
                        + f"  ({wait})",
                        flush=True,
                    )
    report: dict[str, object] = {}
    print(
        f"\n{'model':5s} {'policy':9s} {'quiet s':>8s} {'loaded s':>14s} {'slowdown':>9s} {'per round':>16s}"
        f" {'quiet vs default':>17s}"
    )
    for model in args.models:
        base = statistics.median(samples[(model, "default", False)]) if "default" in args.policies else None
        for policy in args.policies:
            quiet_times, loaded_times = samples[(model, policy, False)], samples[(model, policy, True)]
            quiet, loaded = statistics.median(quiet_times), statistics.median(loaded_times)
            rel = quiet / base if base else float("nan")
            per_round = [
                loaded_median / quiet_median
                for quiet_median, loaded_median in zip(
                    round_medians[(model, policy, False)], round_medians[(model, policy, True)], strict=True
                )
            ]
            report[f"{model}/{policy}"] = {
                "quiet_s": quiet,
                "loaded_s": loaded,
                "quiet_range": [min(quiet_times), max(quiet_times)],
                "loaded_range": [min(loaded_times), max(loaded_times)],
                "slowdown": loaded / quiet,
                "slowdown_per_round": per_round,
                "quiet_vs_default": rel,
                "wait_quiet": sorted(seen[(model, policy, False)]),
                "wait_loaded": sorted(seen[(model, policy, True)]),
            }
            spread = f"{loaded:.2f} ({min(loaded_times):.2f}-{max(loaded_times):.2f})"
            rounds = f"{min(per_round):.2f}-{max(per_round):.2f}x"
            # without the default policy in the run there is nothing to compare the quiet time with
            versus_default = f"{rel:.2f}x" if base else "-"
            slowdown = f"{loaded / quiet:8.2f}x"
            print(
                f"{model:5s} {policy:9s} {quiet:8.2f} {spread:>14s} {slowdown} {rounds:>16s} {versus_default:>17s}"
            )
    return report


if __name__ == "__main__":
    main()
