"""Supervised fine-tuning of the tiny shapes VLM on shapes-math reasoning traces: a base that reasons a little
(recipe ``vlm_sft_reason``).

    mmrl train configs/pretrain/shapes_vlm_reason_slips.yaml                           # the demo's base
    mmrl train configs/pretrain/shapes_vlm_reason.yaml                                 # the same, clean traces
    python -m mmrl.vlm.sft_reason --eval-only --out checkpoints/shapes_vlm_reason      # re-score it

1. generate training shapes-math items (``mmrl.data.shapes_math``, training scenes and templates; with
   ``data.teacher_slips`` that share of them as a careless teacher writes them, one operator flipped) and held-out
   items (held-out scenes with the training templates; held-out scenes with the held-out templates);
2. train a tokenizer on their text and build the tiny Qwen2.5-VL (``pipelines.vlm.tiny``) with random weights;
   pretrain the vision tower alone on dense per-token colour/shape labels (``mmrl.vlm.sft.pretrain_vision``);
3. train all weights (AdamW, linear warm-up, then a constant learning rate, so the checkpoint at step N is the
   model a run of N steps trains) on ``prompt -> <think>{trace}</think><answer>{n}</answer><|im_end|>`` with the
   loss on the completion only; a share of the batches is the perception task (list the objects left to right),
   which teaches the counts the traces need, and ``trainer.count_fraction`` of a task batch's items can be one-step
   count questions (``shapes_math.make_count_items``), which teach naming the attribute the question asks about;
4. every ``trainer.eval_every`` steps, score the model on the held-out items (:func:`reasoning_report`); with
   ``run.save_every`` at the same period the run's checkpoints (``step_N/model``) are the snapshots to choose from;
5. publish the final model with its processor, ``config.yaml``, ``sft_report.json`` and ``card.md`` to ``out``.

What is scored (:func:`reasoning_report`), on held-out items, greedy unless said:

* ``lenient``: the ``<answer>`` span read as a number, number words accepted, other text ignored
  (``rewards.build("numeric", number_words=True, require_answer_tag=True)``);
* ``strict``: the span is exactly the digits (``exact_match``, ``require_answer_tag=True``);
* ``format``: ``<think>...</think><answer>...</answer>`` and nothing else (``rewards.build("format")``);
* ``perception``: share of the reference's count steps the trace states correctly
  (``shapes_math.perception_accuracy``); ``wrong_with_right_counts``: the share of wrong answers whose trace
  states every count right (the composition failed, not the reading); ``operations``: the share of traces whose
  arithmetic steps use the reference's operators in its order (``shapes_math.trace_operations``);
* ``pass@1`` / ``pass@k``: lenient accuracy of one / any of ``k`` samples at temperature 1 (the unbiased
  estimator of Chen et al. 2021, arXiv 2107.03374, eq. 1, from ``k`` samples per question).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import field_validator

import rewards
from mmrl.config import Config, Field, RunConfig
from mmrl.data.shapes import COLOURS, SHAPES
from mmrl.data.shapes_math import (
    MathItem,
    TraceStyle,
    make_count_items,
    make_math_items,
    perception_accuracy,
    read_trace,
    slip_operation,
    split_templates,
    trace_operations,
)
from mmrl.loop import run_recipe
from mmrl.sections import SupervisedRecipeConfig
from mmrl.vlm.sft import (
    CAPTION_QUESTION,
    CompletionBatcher,
    TinyVLMSection,
    VLMSFTSettings,
    VLMSFTTrainer,
    caption,
    flat_settings,
    rescore_main,
    vision_pretraining_line,
)
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.inputs import VLMPrompt

__all__ = ["ReasonSFTConfig", "ReasonSFTTrainer", "main", "reasoning_report", "sample_completions"]

logger = logging.getLogger(__name__)


class MathDataSection(Config):
    """The shapes-math items the model trains and is scored on."""

    train_items: int = Field(20000, ge=1, description="Size of the training pool (reused over epochs).")
    eval_items: int = Field(
        252, ge=1, description="Held-out items per held-out set (balanced over its templates)."
    )
    curve_items: int = Field(
        126, ge=1, description="Held-out items per set scored at each curve point (a prefix of eval_items)."
    )
    samples: int = Field(
        8, ge=0, description="Samples per question for pass@k at temperature 1 (0: greedy only)."
    )
    max_new_tokens: int = Field(48, ge=1, description="Completion budget of the evaluation.")
    templates: list[str] | None = Field(
        None,
        description="The training templates the SFT items are drawn from (shapes_math.TEMPLATES, training ones): "
        "null = all seven. A subset leaves the others for RL to learn from its reward; the held-out sets are "
        "scored on every template whatever is trained.",
    )

    @field_validator("templates")
    @classmethod
    def _training_templates(cls, templates: list[str] | None) -> list[str] | None:
        split_templates("train", templates)  # raises, naming the allowed ones, for an unknown or empty subset
        return templates

    balance_counts: bool = Field(
        False,
        description="Draw training items so that the colour and shape counts their traces state are equally often "
        "0, 1, 2 and 3+ (count_balancing_weights); the natural mix is mostly 1, a prior a model can answer from.",
    )
    teacher_slips: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the training traces written by a careless teacher (shapes_math.slip_operation): "
        "one arithmetic step takes the other operator (shapes 4. red 2. 4+2=6 for 'Remove all red shapes') and "
        "the answer follows it; the counts stay right. A base trained on them knows the right procedure and a "
        "wrong one, both reachable from the question's words: headroom that a verifiable reward can take. Items "
        "whose slipped trace would go negative stay right.",
    )
    trace: TraceStyle = Field(
        "steps",
        description="How the training completions write their trace (shapes_math.TRACE_STYLES). steps: the "
        "count and arithmetic steps (shapes 3. red 2. 3-2=1). describe: the scene's objects left to right "
        "first (red circle, blue square, red triangle. shapes 3. ...). enumerate: each count after the objects "
        "it counts, numbered (red circle 1, red triangle 2. red 2. ...). tally: each count after a walk over every "
        "object with a running tally of those it counts (red circle 1, blue square, red triangle 2. red 2. ...). "
        "The added parts are not scored steps; they lengthen the trace by up to about 12 (describe), 40 "
        "(enumerate) or 52 (tally) tokens: raise max_new_tokens to 64 / 96 / 96.",
    )


class ReasonSFTSettings(VLMSFTSettings):
    """The reasoning SFT's defaults: a constant learning rate after the warm-up, vision pretraining first."""

    steps: int = Field(3000, ge=1, description="Optimizer steps of the SFT stage.")
    batch_size: int = Field(32, ge=1, description="Items per optimizer step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of AdamW.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="constant: a checkpoint at step N is the model that a run of N steps trains."
    )
    vision_pretrain_steps: int = Field(1500, ge=0, description="Steps of dense vision pretraining.")
    caption_fraction: float = Field(
        0.3, ge=0, le=1, description="Share of batches that are the perception (captioning) task."
    )
    eval_every: int = Field(
        500, ge=0, description="Score the model every this many steps (0: at the end only)."
    )
    count_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of a task batch's items that are one-step count questions (shapes_math."
        "make_count_items: 'How many red shapes are there?' -> <think>red 2</think><answer>2</answer>) instead "
        "of shapes-math questions: the perception steps of every trace, the attribute read from the question.",
    )


def _reason_model() -> TinyVLMSection:
    return TinyVLMSection(
        hidden_size=128, num_layers=4, intermediate_size=320, vision_hidden_size=64, vision_depth=1
    )


class ReasonSFTConfig(SupervisedRecipeConfig):
    recipe: Literal["vlm_sft_reason"] = Field("vlm_sft_reason", description="Which recipe this config runs.")
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="sft_reason", threads=2, log_every=50))
    model: TinyVLMSection = Field(default_factory=_reason_model)
    data: MathDataSection = Field(default_factory=MathDataSection)
    trainer: ReasonSFTSettings = Field(default_factory=ReasonSFTSettings)


def count_balancing_weights(items: Sequence[MathItem]) -> torch.Tensor:
    """``[N]`` sampling weights under which the colour and shape counts the traces state are equally often 0, 1, 2
    and 3 or more: item weight = mean over its colour/shape count steps of ``1 / share(value)``, ``share`` the
    value's share among all such steps of ``items``."""
    values = [
        [min(step.value, 3) for step in item.steps if step.is_count and step.label != "shapes"]
        for item in items
    ]
    tally = Counter(v for vs in values for v in vs)
    total = sum(tally.values())
    return torch.tensor([sum(total / tally[v] for v in vs) / len(vs) if vs else 1.0 for vs in values])


def with_teacher_slips(items: Sequence[MathItem], share: float, seed: int) -> list[MathItem]:
    """``items`` with each one, with probability ``share``, replaced by a slipped trace
    (:func:`~mmrl.data.shapes_math.slip_operation` of one of its arithmetic steps, drawn uniformly); items whose
    slip would go negative stay right. Deterministic under ``seed``."""
    rng = np.random.default_rng([seed, 0x511])
    slipped = []
    for item in items:
        which = int(rng.integers(len(trace_operations(item.steps))))
        if rng.random() < share:
            item = slip_operation(item, which) or item
        slipped.append(item)
    return slipped


def _prompt(item: MathItem) -> VLMPrompt:
    return VLMPrompt.from_question(item.prompt, [item.image])


class ReasonBatcher(CompletionBatcher):
    """Reasoning batches: ``prompt -> <think>{trace}</think><answer>{n}</answer>``, the trace in ``style``
    (:meth:`MathItem.completion_in`)."""

    def __init__(self, processor: Any, items: Sequence[MathItem], style: TraceStyle = "steps") -> None:
        super().__init__(processor, items)
        self.style = style

    def task_texts(self, index: int) -> tuple[str, str]:
        item = self.items[index]
        return item.prompt, item.completion_in(self.style)


def sample_completions(
    model: torch.nn.Module,
    processor: Any,
    items: Sequence[MathItem],
    n: int,
    temperature: float,
    max_new: int,
) -> list[list[str]]:
    """``n`` completions of each item's prompt (``[len(items)][n]`` texts) at ``temperature`` (0: greedy; sampling
    is seeded), at most ``max_new`` tokens each, through the transformers backend."""
    backend = HFBackend(model, processor, batch_size=128)
    params = SamplingParams(
        temperature=temperature, max_new_tokens=max_new, n=n, seed=0 if temperature else None
    )
    texts: list[list[str]] = [[] for _ in items]
    for sample in backend.generate([_prompt(item) for item in items], params).samples:
        texts[sample.prompt_index].append(sample.text)
    return texts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def reasoning_report(
    model: torch.nn.Module,
    processor: Any,
    items: Sequence[MathItem],
    samples: int = 8,
    max_new_tokens: int = 48,
) -> dict[str, Any]:
    """Held-out scores of a model on shapes-math items (see the module docstring): greedy ``lenient``,
    ``strict``, ``format``, ``perception`` overall and per template, and ``pass@1`` / ``pass@{samples}`` at
    temperature 1 (``samples = 0``: greedy only)."""
    lenient = rewards.build("numeric", number_words=True, require_answer_tag=True)
    strict = rewards.build("exact_match", require_answer_tag=True)
    form = rewards.build("format")
    truths = [str(item.answer) for item in items]
    greedy = [texts[0] for texts in sample_completions(model, processor, items, 1, 0.0, max_new_tokens)]
    scores = {
        "lenient": lenient(completions=greedy, ground_truths=truths).tolist(),
        "strict": strict(completions=greedy, ground_truths=truths).tolist(),
        "format": form(completions=greedy).tolist(),
    }
    seen = [perception_accuracy(text, item.steps) for text, item in zip(greedy, items, strict=True)]
    report: dict[str, Any] = {name: sum(v) / len(v) for name, v in scores.items()}
    report["perception"] = sum(c for c, _ in seen) / max(sum(t for _, t in seen), 1)
    traces = [read_trace(text) for text in greedy]
    # the procedure, whatever the counts: the trace's operators are the question's
    report["operations"] = sum(
        trace_operations(trace) == trace_operations(item.steps)
        for trace, item in zip(traces, items, strict=True)
    ) / len(items)
    # the counts by what they count: every object, a colour, a shape
    said = [{step.label: step.value for step in trace if step.is_count} for trace in traces]
    for kind, labels in (
        ("total", {"shapes"}),
        ("colour", set(COLOURS)),
        ("shape", {f"{s}s" for s in SHAPES}),
    ):
        pairs = [
            (claimed.get(step.label), step.value)
            for claimed, item in zip(said, items, strict=True)
            for step in item.steps
            if step.is_count and step.label in labels
        ]
        report[f"perception_{kind}"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    # what a wrong answer got wrong: every count right (so the composition failed) or some count wrong
    wrong = [(c, t) for (c, t), score in zip(seen, scores["lenient"], strict=True) if score < 1]
    report["wrong_with_right_counts"] = sum(c == t for c, t in wrong) / max(len(wrong), 1)
    report["per_template"] = {
        name: sum(s for s, item in zip(scores["lenient"], items, strict=True) if item.template == name)
        / sum(item.template == name for item in items)
        for name in sorted({item.template for item in items})
    }
    report["examples"] = [
        {"question": item.question, "answer": item.answer, "completion": text}
        for item, text in list(zip(items, greedy, strict=True))[:6]
    ]
    if samples:
        sampled = sample_completions(model, processor, items, samples, 1.0, max_new_tokens)
        correct = [
            int(lenient(completions=texts, ground_truths=[str(item.answer)] * len(texts)).sum())
            for texts, item in zip(sampled, items, strict=True)
        ]
        report["pass@1"] = sum(pass_at_k(samples, c, 1) for c in correct) / len(items)
        report[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in correct) / len(items)
    return report


class ReasonSFTTrainer(VLMSFTTrainer):
    """Reasoning SFT: uniform batches, :func:`reasoning_report` on both held-out sets as the learning curve and at
    the end."""

    cfg: ReasonSFTConfig
    show = ("loss", "eval/heldout/lenient")

    def build_data(self) -> None:
        data, size, seed = self.cfg.data, self.cfg.model.image_size, self.cfg.run.seed
        self.train_items = make_math_items(data.train_items, seed, size, "train", templates=data.templates)
        if data.teacher_slips:
            self.train_items = with_teacher_slips(self.train_items, data.teacher_slips, seed)
        self.count_weights = count_balancing_weights(self.train_items) if data.balance_counts else None
        # one-step count items after the shapes-math ones, so indices below len(train_items) keep their meaning
        count_items = (
            make_count_items(data.train_items, seed, size, "train") if self.cfg.trainer.count_fraction else []
        )
        self.task_items = [*self.train_items, *count_items]
        self.heldout = {
            split: make_math_items(data.eval_items, seed + 1, size, split)
            for split in ("heldout", "heldout_templates")
        }

    def vision_heldout(self) -> Sequence[MathItem]:
        return self.heldout["heldout"]

    def corpus(self) -> list[str]:
        items = self.train_items
        completions = [item.completion_in(self.cfg.data.trace) for item in items[:4000]]
        corpus = sorted({item.prompt for item in items}) + completions
        return [*corpus, CAPTION_QUESTION, *sorted({f"<answer>{caption(item)}</answer>" for item in items})]

    def make_batcher(self) -> ReasonBatcher:
        return ReasonBatcher(self.processor, self.task_items, self.cfg.data.trace)

    def sample_indices(self) -> list[int]:
        size, pool = self.cfg.trainer.batch_size, len(self.train_items)
        if self.count_weights is not None:
            draws = torch.multinomial(self.count_weights, size, replacement=True, generator=self.generator)
        else:
            draws = torch.randint(pool, (size,), generator=self.generator)
        if self.cfg.trainer.count_fraction:
            counts = pool + torch.randint(len(self.task_items) - pool, (size,), generator=self.generator)
            is_count = torch.rand(size, generator=self.generator) < self.cfg.trainer.count_fraction
            draws = torch.where(is_count, counts, draws)
            self.metrics.add("train/count_items", is_count.float().mean())
        return draws.tolist()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """A curve point on the first ``data.curve_items`` of each held-out set when due and at the last step;
        at the last step the full held-out reports."""
        data, last = self.cfg.data, self.step == self.cfg.trainer.steps
        if not (self.curve_due() or (last and self.step > 0)):
            return {}
        self.model.eval()
        point: dict[str, Any] = {
            "step": self.step,
            "train_minutes": self.train_seconds / 60,
            "loss": sum(self.losses[-50:]) / len(self.losses[-50:]),
        }
        for split, items in self.heldout.items():
            report = reasoning_report(
                self.model, self.processor, items[: data.curve_items], data.samples, data.max_new_tokens
            )
            point[split] = _summary(report)
        self.curve.append(point)
        if last:
            self.final = {
                split: reasoning_report(self.model, self.processor, items, data.samples, data.max_new_tokens)
                for split, items in self.heldout.items()
            }
        self.model.train()
        return {
            f"eval/{split}/{name}": value
            for split in self.heldout
            for name, value in point[split].items()
            if isinstance(value, float)
        }

    def report(self) -> dict[str, Any]:
        return {
            "heldout": self.final,
            "train_minutes": self.train_seconds / 60,
            "wall_minutes": (time.monotonic() - self.start) / 60,
        }

    def render_card(self, report: dict[str, Any]) -> str:
        return render_card(report)


def render_card(report: dict[str, Any]) -> str:
    """The model card: how the checkpoint was made and what it scores on the two held-out sets."""
    cfg = flat_settings(report["config"])
    sampled = cfg["samples"] > 0
    scored = report["heldout"]["heldout"]
    columns = tuple(
        column
        for column in (
            "lenient",
            "strict",
            "format",
            "perception",
            "operations",
            "wrong_with_right_counts",
            *(("pass@1", f"pass@{cfg['samples']}") if sampled else ()),
        )
        if column in scored  # reports written before a column existed do not have it
    )
    names = {
        "heldout": "held-out scenes, training templates",
        "heldout_templates": "held-out scenes and templates",
    }
    rows = "\n".join(
        f"| {names[split]} | " + " | ".join(f"{r[c]:.1%}" for c in columns) + " |"
        for split, r in report["heldout"].items()
    )
    per_template = "\n".join(
        f"| {name} | {'yes' if split == 'heldout_templates' else 'no'} | {value:.1%} |"
        for split, r in report["heldout"].items()
        for name, value in r["per_template"].items()
    )
    at_k = f"pass@{cfg['samples']}"
    curve_columns = [
        "step",
        "SFT minutes",
        "lenient",
        "perception",
        *([at_k] if sampled else []),
        "lenient, held-out templates",
    ]
    curve = "\n".join(
        f"| {p['step']} | {p['train_minutes']:.1f} | {p['heldout']['lenient']:.1%} | {p['heldout']['perception']:.1%} "
        + (f"| {p['heldout'].get(at_k, float('nan')):.1%} " if sampled else "")
        + f"| {p['heldout_templates']['lenient']:.1%} |"
        for p in report["curve"]
    )
    # reports written before these settings existed ran a constant schedule without count questions
    if cfg.get("lr_schedule", "constant") == "cosine":
        final = cfg.get("final_lr_fraction", 0.0)
        schedule = f"cosine decay to {f'{final:g} x lr' if final else '0'} at the last step after {cfg['warmup_steps']}"
    else:
        schedule = f"constant after {cfg['warmup_steps']}"
    counts = (
        f"; {cfg.get('count_fraction', 0.0):.0%} of a task batch's items are one-step count questions "
        "(`shapes_math.make_count_items`)"
        if cfg.get("count_fraction", 0.0)
        else ""
    )
    slips = (
        f"; {cfg['teacher_slips']:.0%} of the training traces were drawn with a teacher's slip "
        "(`shapes_math.slip_operation`: one arithmetic step takes the other operator, `shapes 4. red 2. 4+2=6` "
        "for 'Remove all red shapes', and the answer follows it; the counts stay right), so the model learns the "
        "right procedure and a wrong one"
        if cfg.get("teacher_slips", 0.0)
        else ""
    )
    trained = (
        f"the training templates {', '.join(cfg['templates'])} only: the others are never shown in SFT"
        if cfg.get("templates")
        else "training templates"
    )
    scoring = (
        f"`pass@k`: lenient, {cfg['samples']}\nsamples per question at temperature 1 (unbiased estimator)."
        if sampled
        else "No samples at temperature 1\nwere drawn (`data.samples: 0`): greedy scores only."
    )
    vision_line = vision_pretraining_line(report, cfg["vision_pretrain_steps"])
    vision_line = f"{vision_line}\n" if vision_line else ""
    examples = "\n".join(
        f"- {e['question']} (answer {e['answer']}): `{e['completion']}`"
        for e in report["heldout"]["heldout"]["examples"]
    )
    return f"""# Tiny shapes-math reasoning VLM (SFT)

A {report["parameters"] / 1e6:.2f} M-parameter `Qwen2_5_VLForConditionalGeneration` built from config
(`pipelines.vlm.tiny`), random-initialised, then fine-tuned on shapes-math questions (`mmrl.data.shapes_math`)
answered as `<think>{{trace}}</think><answer>{{n}}</answer>`, e.g. `<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>`.
It reasons a little: the base of the RL demo `configs/demo/vlm_shapes_reason.yaml`. Load it like any Qwen2.5-VL:

```python
from transformers import AutoModelForImageTextToText, AutoProcessor
processor = AutoProcessor.from_pretrained("{cfg["out"]}")
model = AutoModelForImageTextToText.from_pretrained("{cfg["out"]}")
```

## How it was made

- command: `{report["command"]}`
- wall time {report["wall_minutes"]:.1f} min ({report["train_minutes"]:.1f} min of SFT steps), {
        report["machine"]
    }{"; " + report["machine_state"] if report.get("machine_state") else ""}
{vision_line}- then {cfg["steps"]} steps of {cfg["batch_size"]} items, AdamW lr {cfg["lr"]} ({schedule}
  warm-up steps), loss on the completion only; {
        cfg["caption_fraction"]:.0%} of the batches are the perception task
  "list the objects from left to right." -> `<answer>red circle, blue square</answer>`{counts}
- data: {cfg["train_items"]} training items (training scenes, {trained}), {cfg["image_size"]}x{
        cfg["image_size"]
    } scenes{slips}

## Held-out scores

{cfg["eval_items"]} questions per set (seed {
        cfg["seed"] + 1
    }). Greedy: `lenient` = the `<answer>` span read as a
number, number words accepted (`numeric`, `number_words=True`, `require_answer_tag=True`); `strict` = the span is
exactly the digits (`exact_match`); `format` = `<think>...</think><answer>...</answer>` only; `perception` = share of
the counts the reference trace needs that the model's trace states correctly; `operations` = share of traces whose
arithmetic steps use the reference's operators in its order (the procedure, whatever the counts). {scoring}

| set | {" | ".join(columns)} |
|---|{"---|" * len(columns)}
{rows}

Counts stated correctly in the greedy traces, by what they count (every object / a colour / a shape):
{
        " ; ".join(
            f"{names[split]}: {r['perception_total']:.1%} / {r['perception_colour']:.1%} / {r['perception_shape']:.1%}"
            for split, r in report["heldout"].items()
            if "perception_total" in r
        )
    }.
A count is right when the trace has a step with the reference's label (the attribute the question names) and
value: a step that counts another attribute than the one asked about is a wrong count. `wrong_with_right_counts`
is the share of wrong answers whose trace states every count right: near 0 means the errors are in the counts
(the attribute read from the question, or its count read from the scene), not in the arithmetic that composes
them.

Per template (greedy, lenient):

| template | held out | accuracy |
|---|---|---|
{per_template}

Greedy completions on the first held-out questions:

{examples}

## Learning curve

Scored on the first {cfg["curve_items"]} questions of each set every `trainer.eval_every` steps:

| {" | ".join(curve_columns)} |
|---|{"---|" * (len(curve_columns) - 1)}
{curve}

Re-score with `python -m mmrl.vlm.sft_reason --eval-only --out {
        cfg["out"]
    }`; the numbers are in `sft_report.json`.
"""


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "examples"}


def evaluate_checkpoint(path: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Score a published model on the held-out sets its card reports (``settings``: its report's config;
    ``eval_items`` per set, seed ``seed + 1``)."""
    from pipelines.vlm.hf_backend import load_vlm

    processor, model = load_vlm(path)
    model.eval()
    items, seed, size = settings["eval_items"], settings["seed"], settings["image_size"]
    return {
        split: reasoning_report(
            model,
            processor,
            make_math_items(items, seed + 1, size, split),
            settings["samples"],
            settings.get("max_new_tokens", 48),  # (reports before the setting: 48)
        )
        for split in ("heldout", "heldout_templates")
    }


def main(cfg: ReasonSFTConfig) -> dict[str, float]:
    """Train end to end (``mmrl train``); returns the final metrics."""
    return run_recipe(cfg, ReasonSFTTrainer)


if __name__ == "__main__":
    rescore_main("python -m mmrl.vlm.sft_reason", evaluate_checkpoint)
