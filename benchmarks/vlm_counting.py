"""Does a shapes-math VLM count? Its traces' counts by the true count, and a linear probe of its image tokens.

    python -m benchmarks.vlm_counting checkpoints/shapes_vlm_reason [MORE_CHECKPOINTS ...]
    python -m benchmarks.vlm_counting runs/NAME/checkpoints/step_00000100/model --max-new-tokens 64

For each checkpoint (a ``save_pretrained`` folder of a tiny Qwen2.5-VL):

* **the trace's counts** (greedy, the ``heldout`` shapes-math questions of ``--seed``, the reasoning SFT's
  evaluation set): among the colour and shape count steps whose label is the attribute the question asks about,
  the share stated right and the share stated as 1, by the true count (0, 1, 2, 3+). A model that counts is
  right at every count; one that writes the most common count is right at 1 and says 1 at 0 and 2;
* **a probe of the image tokens**: ridge regression (``--ridge``) from the mean of the merged image tokens (what
  attention spread evenly over them hands the language model) to each colour's count, fitted on
  ``--probe-train`` random scenes and scored on ``--probe-test`` others (the rounded prediction equals the count).
  A high probe score with wrong counts in the traces means the count is in the image tokens and the language
  model does not read it;
* **readers that write 1** (no model; also with no checkpoint given): the held-out accuracy of a reader that
  follows every question's procedure and states the total right but writes 1 for every colour count (and for
  every shape count): what the count-1 prior is worth on ``--seed``'s set (:func:`prior_readers`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from mmrl.data.shapes import COLOURS, random_scene, render
from mmrl.data.shapes_math import MathItem, answer_from_counts, make_math_items, stated_counts
from mmrl.vlm.sft import merged_image_tokens
from mmrl.vlm.sft_reason import sample_completions

#: true counts are bucketed as 0, 1, 2 and 3 (= 3 or more)
BUCKETS = (0, 1, 2, 3)


def trace_counts(
    model: Any, processor: Any, items: Sequence[MathItem], max_new_tokens: int
) -> dict[int, dict[str, float]]:
    """``{bucket: {"steps": n, "right": share, "says_1": share}}`` over the colour and shape count steps of the
    greedy traces that carry the reference step's label (see the module docstring)."""
    greedy = sample_completions(model, processor, items, 1, 0.0, max_new_tokens)
    tally = {bucket: [0, 0, 0] for bucket in BUCKETS}  # steps, right, says 1
    for (text,), item in zip(greedy, items, strict=True):
        stated = stated_counts(text)
        for step in item.steps:
            if step.is_count and step.label != "shapes" and step.label in stated:
                row = tally[min(step.value, 3)]
                row[0] += 1
                row[1] += stated[step.label] == step.value
                row[2] += stated[step.label] == 1
    return {
        bucket: {"steps": n, "right": right / max(n, 1), "says_1": ones / max(n, 1)}
        for bucket, (n, right, ones) in tally.items()
    }


def mean_token_features(
    model: Any, processor: Any, seeds: Sequence[int], size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, hidden] mean merged image token, [N, len(COLOURS)] count of each colour)`` of random scenes."""
    scenes = [random_scene(seed, size) for seed in seeds]
    features = []
    for start in range(0, len(scenes), 128):
        chunk = scenes[start : start + 128]
        images = [render(scene) for scene in chunk]
        features.append(merged_image_tokens(model.model.visual, processor, images).mean(1))
    counts = torch.tensor([[sum(o.colour == c for o in s.objects) for c in COLOURS] for s in scenes])
    return torch.cat(features), counts.float()


def probe_accuracy(
    train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], ridge: float
) -> torch.Tensor:
    """``[len(COLOURS)]`` share of test scenes whose rounded ridge prediction ``W = (X^T X + ridge I)^-1 X^T Y``
    (``X`` with a bias column) equals the colour's count."""

    def with_bias(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones(len(x), 1)], 1)

    x, y = with_bias(train[0]), train[1]
    weights = torch.linalg.solve(x.T @ x + ridge * torch.eye(x.shape[1]), x.T @ y)
    predicted = (with_bias(test[0]) @ weights).round().clamp(min=0)
    return (predicted == test[1]).float().mean(0)


@torch.no_grad()
def measure(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both measurements of one checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    items = make_math_items(args.questions, args.seed, args.size, "heldout")
    result: dict[str, Any] = {"trace": trace_counts(model, processor, items, args.max_new_tokens)}
    if args.probe_train:
        train = mean_token_features(model, processor, range(args.probe_train), args.size)
        test = mean_token_features(model, processor, range(10**6, 10**6 + args.probe_test), args.size)
        result["probe"] = probe_accuracy(train, test, args.ridge).tolist()
    return result


#: The readers of :func:`prior_readers`: which count steps they write as 1 (the rest stated right).
PRIOR_READERS: dict[str, tuple[str, ...]] = {
    "colour counts 1": ("colour",),
    "colour and shape counts 1": ("colour", "shape"),
}


def prior_readers(items: Sequence[MathItem]) -> dict[str, float]:
    """Accuracy on ``items`` of each reader of :data:`PRIOR_READERS`: the reference procedure, the total count
    right, and 1 for every count of the kinds it names (``answer_from_counts``)."""

    def kind(label: str) -> str:
        return "total" if label == "shapes" else "colour" if label in COLOURS else "shape"

    scores = {}
    for name, ones in PRIOR_READERS.items():
        right = 0
        for item in items:
            counts = [1 if kind(s.label) in ones else s.value for s in item.steps if s.is_count]
            right += answer_from_counts(item.steps, counts) == item.answer
        scores[name] = right / len(items)
    return scores


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="*", help="save_pretrained folders of tiny shapes-math VLMs")
    parser.add_argument("--questions", type=int, default=252, help="held-out questions (the SFT's 252)")
    parser.add_argument("--seed", type=int, default=1, help="held-out set (the SFT run's seed + 1)")
    parser.add_argument("--size", type=int, default=64, help="scene side in pixels")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--probe-train", type=int, default=3000, help="scenes the probe is fitted on (0: no probe)"
    )
    parser.add_argument("--probe-test", type=int, default=1000)
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.probe_train < 0 or (args.probe_train and args.probe_test < 1):
        parser.error("--probe-train must be >= 0 (0: no probe) and --probe-test >= 1 when there is a probe")
    torch.set_num_threads(args.threads)
    for split in ("heldout", "heldout_templates"):
        readers = prior_readers(make_math_items(args.questions, args.seed, args.size, split))
        print(
            f"{split} (seed {args.seed}), readers that write 1: "
            + ", ".join(f"{n} {a:.1%}" for n, a in readers.items())
        )
    results = {}
    for path in args.checkpoints:
        result = results[path] = measure(path, args)
        print(path)
        for bucket, row in result["trace"].items():
            label = f"{bucket}+" if bucket == BUCKETS[-1] else str(bucket)
            print(
                f"  true count {label:2s}: {row['steps']:4d} steps, right {row['right']:6.1%}, "
                f"says 1 {row['says_1']:6.1%}"
            )
        if "probe" in result:
            probe = result["probe"]
            print(
                "  probe of the mean image token, count right per colour: "
                + " ".join(f"{c} {a:.1%}" for c, a in zip(COLOURS, probe, strict=True))
                + f" (mean {sum(probe) / len(probe):.1%})"
            )
    return results


if __name__ == "__main__":
    main()
