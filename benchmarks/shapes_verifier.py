"""Accuracy and speed of the shapes verifier (``rewards.shapes.ShapesReward``).

    python -m benchmarks.shapes_verifier            # 1,000 scenes per size
    python -m benchmarks.shapes_verifier --n 5000 --sizes 32 64 --seed 1

For each size: prompts are drawn from the whole grammar, balanced over the four templates, and each is
rendered with its own seed. Measured:

* ``positive``: a clean render of the prompt scores 1;
* ``negative``: for each scene, one near-miss prompt (one colour, shape, count or relation changed,
  ``mmrl.data.shapes.near_miss_prompts``) is scored; the expected score is the scene's ground truth scored by
  the same criteria (``score_objects`` on the placed objects), which is 0 unless the edit happens to describe
  the scene too;
* ``perturbed/<kind>``: a degraded drawing of the scene (``mmrl.data.shapes.perturb``) scores 1;
* ``ms/image``: wall time of ``ShapesReward.score`` over the clean batch, per image, the best of 3 runs
  (the least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mmrl.data.shapes import (
    PERTURBATIONS,
    near_miss_prompts,
    perturb,
    render,
    sample_prompts,
    scene_for_prompt,
)
from rewards.shapes import ShapesReward, parse_prompt, score_objects


def measure(n: int, size: int, seed: int = 0) -> dict[str, float]:
    """Accuracy of the verifier on ``n`` scenes of side ``size`` (see the module docstring); keys as printed."""
    reward = ShapesReward()
    prompts = sample_prompts(n, seed, split="all")
    scenes = [scene_for_prompt(p, seed * 100_003 + i, size) for i, p in enumerate(prompts)]
    images = [render(s) for s in scenes]

    timings = []
    for _ in range(3):
        start = time.perf_counter()
        positive = reward(images=images, prompts=prompts)
        timings.append(time.perf_counter() - start)

    rng = np.random.default_rng(seed)
    negatives = [near_miss_prompts(p) for p in prompts]
    negatives = [options[rng.integers(len(options))] for options in negatives]
    expected = [
        np.prod(list(score_objects(parse_prompt(q), [o.as_detected() for o in s.objects]).values()))
        for q, s in zip(negatives, scenes, strict=True)
    ]
    negative = reward(images=images, prompts=negatives).numpy()
    result = {
        "positive": float(positive.mean()),
        "negative": float(np.mean(negative == np.asarray(expected))),
        "negative/expected_0": float(np.mean(np.asarray(expected) == 0)),
    }
    for kind in PERTURBATIONS:
        perturbed = [perturb(s, kind, seed * 100_003 + i) for i, s in enumerate(scenes)]
        result[f"perturbed/{kind}"] = float(reward(images=perturbed, prompts=prompts).mean())
    result["ms/image"] = 1e3 * min(timings) / n
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="scenes per size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="canvas sides in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for size in args.sizes:
        result = measure(args.n, size, args.seed)
        print(f"size {size}, {args.n} scenes")
        for key, value in result.items():
            print(f"  {key:24s} {value:.4f}")


if __name__ == "__main__":
    main()
