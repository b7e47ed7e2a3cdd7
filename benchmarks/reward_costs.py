"""What each reward costs per image on this machine's CPU (one thread), for docs/rewards.md.

    python -m benchmarks.reward_costs                       # every case, 8 images each
    python -m benchmarks.reward_costs --only ocr_detect ocr_recognize --n 16

For each case the reward is built through ``rewards.build`` (the learned ones with random weights of the real
architecture: no download, and the same arithmetic as the released weights), warmed up on one image, then
``score`` is timed on ``n`` images in one call; the best of ``repeats`` runs is kept (the least disturbed by
other processes on a shared machine). Reported: build seconds and milliseconds per image.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

import rewards
from rewards.ocr import render_text

VLM = Path(__file__).resolve().parents[1] / "checkpoints" / "shapes_vlm"


def photos(n: int, size: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def cases(n: int) -> dict[str, tuple[Callable[[], rewards.Reward], dict[str, Any], str]]:
    """name -> (build, batch of n images, what the images are)."""
    from mmrl.data.shapes import render_prompt, sample_prompts

    prompts512 = ["a photo of a cat"] * n
    shapes_prompts = sample_prompts(n, 0, split="all")
    digits = [str(100 + 37 * i) for i in range(n)]
    words = ["hello", "river", "reward", "flow", "GRPO", "night", "cat", "sign"]
    words = [words[i % len(words)] for i in range(n)]
    scenes = [render_prompt(p, seed=i, size=64) for i, p in enumerate(shapes_prompts)]

    def clip(name: str) -> Callable[[], rewards.Reward]:
        return lambda: rewards.build("clip_score", model_name=name, pretrained=None, batch_size=n)

    judge = {"backend": "transformers", "model_path": str(VLM), "max_tokens": 8}
    image_batch = {"images": photos(n, 512), "prompts": prompts512}
    return {
        "jpeg_incompressibility": (
            lambda: rewards.build("jpeg_incompressibility"),
            image_batch,
            "512x512 noise",
        ),
        "shapes": (
            lambda: rewards.build("shapes"),
            {"images": scenes, "prompts": shapes_prompts},
            "64x64 scenes",
        ),
        "ocr_detect": (
            lambda: rewards.build("ocr", threads=1),
            {"images": [render_text(w, 256, 96, 40) for w in words], "prompts": [f'"{w}"' for w in words]},
            "256x96 word renders",
        ),
        "ocr_detect_512": (
            lambda: rewards.build("ocr", threads=1),
            {
                "images": [render_text(w, 512, 512, 64) for w in words],
                "prompts": [f'a sign "{w}"' for w in words],
            },
            "512x512 word renders",
        ),
        "ocr_recognize": (
            lambda: rewards.build("ocr", mode="recognize", threads=1),
            {
                "images": [render_text(d, 64, 32, 22) for d in digits],
                "metadata": [{"target": d} for d in digits],
            },
            "64x32 digit renders",
        ),
        "clip_score_ViT-B-32": (clip("ViT-B-32"), image_batch, "512x512"),
        "clip_score_ViT-L-14": (clip("ViT-L-14"), image_batch, "512x512"),
        "clip_score_ViT-H-14": (
            clip("ViT-H-14"),
            image_batch,
            "512x512 (HPSv2's and PickScore's architecture)",
        ),
        "vlm_judge_tiny": (
            lambda: rewards.build("vlm_judge", mode="yes_prob", **judge),
            {"images": scenes, "prompts": shapes_prompts},
            "64x64 scenes, 0.55 M-parameter judge",
        ),
        "vlm_judge_pairwise_tiny_g4": (
            lambda: rewards.build("vlm_judge_pairwise", **judge),
            {"images": scenes, "prompts": [shapes_prompts[i // 4] for i in range(n)]},
            "64x64 scenes in groups of 4 (3 judge calls per image), 0.55 M-parameter judge",
        ),
    }


def measure(build: Callable[[], rewards.Reward], batch: dict[str, Any], repeats: int) -> dict[str, float]:
    start = time.perf_counter()
    reward = build()
    built = time.perf_counter() - start
    reward.score(**{k: v[:1] for k, v in batch.items()})  # warm-up (first-call allocations, lazy imports)
    n = len(next(iter(batch.values())))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reward.score(**batch)
        best = min(best, time.perf_counter() - start)
    return {"build_s": round(built, 2), "ms_per_image": round(1000 * best / n, 2)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=8, help="images per timed call")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per case; the best is kept")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    every_case = cases(args.n)
    unknown = sorted(set(args.only or ()) - set(every_case))
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: no such case; the cases are {', '.join(every_case)}")
    results = {}
    for name, (build, batch, what) in every_case.items():
        if args.only and name not in args.only:
            continue
        results[name] = {**measure(build, batch, args.repeats), "images": what}
        print(json.dumps({name: results[name]}), flush=True)
    return results


if __name__ == "__main__":
    main()
