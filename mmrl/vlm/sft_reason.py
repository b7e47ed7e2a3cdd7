"""Supervised fine-tuning of the tiny shapes VLM on shapes-math reasoning traces: a base that reasons a little.

    python -m mmrl.vlm.sft_reason --out checkpoints/shapes_vlm_reason --steps 500 --seed 0

(the committed checkpoint's exact command is in its card)

1. generate training shapes-math items (``mmrl.data.shapes_math``, training scenes and templates) and held-out
   items (held-out scenes with the training templates; held-out scenes with the held-out templates);
2. train a tokenizer on their text and build the tiny Qwen2.5-VL (``pipelines.vlm.tiny``) with random weights;
   pretrain the vision tower alone on dense per-token colour/shape labels (``sft_shapes.pretrain_vision``);
3. train all weights (AdamW, linear warm-up, then a constant learning rate) on ``prompt -> <think>{trace}</think><answer>{n}</answer><|im_end|>`` with the loss on the
   completion only; a share of the batches is the perception task of ``sft_shapes`` (list the objects left to
   right), which teaches the counts the traces need;
4. every ``--eval-every`` steps, save a snapshot (``{out}/snapshots/step_N``) and score it on the held-out
   items (:func:`reasoning_report`), so the snapshot where the model "reasons a little" can be chosen;
5. save the final model with its processor, ``sft_report.json`` and ``card.md``.

What is scored (:func:`reasoning_report`), on held-out items, greedy unless said:

* ``lenient``: the ``<answer>`` span read as a number, number words accepted, other text ignored
  (``rewards.build("numeric", number_words=True, require_answer_tag=True)``);
* ``strict``: the span is exactly the digits (``exact_match``, ``require_answer_tag=True``);
* ``format``: ``<think>...</think><answer>...</answer>`` and nothing else (``rewards.build("format")``);
* ``perception``: share of the reference's count steps the trace states correctly
  (``shapes_math.perception_accuracy``); ``wrong_with_right_counts``: the share of wrong answers whose trace
  states every count right (the composition failed, not the reading);
* ``pass@1`` / ``pass@k``: lenient accuracy of one / any of ``k`` samples at temperature 1 (the unbiased
  estimator of Chen et al. 2021, arXiv 2107.03374, eq. 1, from ``k`` samples per question).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rewards
from mmrl.data.shapes import COLOURS, SHAPES
from mmrl.data.shapes_math import MathItem, make_math_items, perception_accuracy, read_trace
from mmrl.vlm.sft_shapes import CAPTION_QUESTION, caption, pretrain_vision, sft_batch
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.inputs import VLMPrompt, prepare_prompts
from pipelines.vlm.tiny import TinyVLMConfig, build_model, build_processor, train_tokenizer

__all__ = ["ReasonSFTConfig", "reasoning_report", "train"]

logger = logging.getLogger(__name__)


@dataclass
class ReasonSFTConfig:
    """Options of the reasoning SFT run (each is also a command-line flag)."""

    out: str = field(
        default="checkpoints/shapes_vlm_reason",
        metadata={"help": "Directory of the model, processor, card.md and sft_report.json (replaced)."},
    )
    steps: int = field(default=3000, metadata={"help": "Optimizer steps of the SFT stage."})
    seed: int = field(
        default=0, metadata={"help": "Seed of the data, the initialisation and the batch order."}
    )
    train_items: int = field(
        default=20000, metadata={"help": "Size of the training pool (reused over epochs)."}
    )
    eval_items: int = field(
        default=252, metadata={"help": "Held-out items per held-out set (balanced over its templates)."}
    )
    curve_items: int = field(
        default=126,
        metadata={"help": "Held-out items per set scored at each snapshot (a prefix of eval_items)."},
    )
    samples: int = field(default=8, metadata={"help": "Samples per question for pass@k at temperature 1."})
    image_size: int = field(default=64, metadata={"help": "Scene side in pixels (64: 16 image tokens)."})
    hidden_size: int = field(
        default=128, metadata={"help": "Language-model width (TinyVLMConfig.hidden_size)."}
    )
    num_layers: int = field(default=4, metadata={"help": "Language-model decoder layers."})
    intermediate_size: int = field(default=320, metadata={"help": "Language-model MLP width."})
    vision_hidden_size: int = field(default=64, metadata={"help": "Vision-tower width."})
    vision_depth: int = field(default=1, metadata={"help": "Vision-tower blocks."})
    vision_pretrain_steps: int = field(
        default=1500, metadata={"help": "Steps of dense vision pretraining (sft_shapes.pretrain_vision)."}
    )
    vision_pretrain_lr: float = field(default=3e-3, metadata={"help": "Learning rate of vision pretraining."})
    caption_fraction: float = field(
        default=0.3, metadata={"help": "Share of batches that are the perception (captioning) task."}
    )
    batch_size: int = field(default=32, metadata={"help": "Items per optimizer step."})
    lr: float = field(default=3e-3, metadata={"help": "Peak learning rate of AdamW."})
    warmup_steps: int = field(
        default=50, metadata={"help": "Linear warm-up steps; the learning rate is constant after them."}
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    eval_every: int = field(
        default=500,
        metadata={"help": "Save a snapshot and score it every this many steps (0: only at the end)."},
    )
    max_new_tokens: int = field(default=48, metadata={"help": "Completion budget of the evaluation."})
    threads: int = field(default=2, metadata={"help": "CPU threads for torch."})


def _prompt(item: MathItem) -> VLMPrompt:
    return VLMPrompt.from_question(item.prompt, [item.image])


class ReasonBatcher:
    """Right-padded training batches of ``(prompt, completion)`` pairs with labels on the completion only;
    prompt ids are cached per prompt text (every scene has the same size, hence the same image-token count)."""

    def __init__(self, processor: Any, items: Sequence[MathItem]) -> None:
        self.processor = processor
        self.items = items
        self.pad_id = processor.tokenizer.pad_token_id
        self.end_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._prompt_ids: dict[str, list[int]] = {}

    def _ids(self, item: MathItem, as_caption: bool) -> tuple[list[int], list[int]]:
        question = CAPTION_QUESTION if as_caption else item.prompt
        completion = f"<answer>{caption(item)}</answer>" if as_caption else item.completion
        if question not in self._prompt_ids:
            prompt = VLMPrompt.from_question(question, [item.image])
            self._prompt_ids[question] = prepare_prompts(self.processor, [prompt])[0][0].input_ids
        answer = self.processor.tokenizer(completion, add_special_tokens=False)["input_ids"]
        return self._prompt_ids[question], [*answer, self.end_id]

    def batch(self, indices: Sequence[int], as_caption: bool) -> dict[str, torch.Tensor]:
        rows = [self._ids(self.items[i], as_caption) for i in indices]
        return sft_batch(self.processor, rows, [self.items[i].image for i in indices], self.pad_id)


def _completions(
    model: torch.nn.Module,
    processor: Any,
    items: Sequence[MathItem],
    n: int,
    temperature: float,
    max_new: int,
) -> list[list[str]]:
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
    greedy = [texts[0] for texts in _completions(model, processor, items, 1, 0.0, max_new_tokens)]
    scores = {
        "lenient": lenient(completions=greedy, ground_truths=truths).tolist(),
        "strict": strict(completions=greedy, ground_truths=truths).tolist(),
        "format": form(completions=greedy).tolist(),
    }
    seen = [perception_accuracy(text, item.steps) for text, item in zip(greedy, items, strict=True)]
    report: dict[str, Any] = {name: sum(v) / len(v) for name, v in scores.items()}
    report["perception"] = sum(c for c, _ in seen) / max(sum(t for _, t in seen), 1)
    # the counts by what they count: every object, a colour, a shape
    said = [{step.label: step.value for step in read_trace(text) if step.is_count} for text in greedy]
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
        sampled = _completions(model, processor, items, samples, 1.0, max_new_tokens)
        correct = [
            int(lenient(completions=texts, ground_truths=[str(item.answer)] * len(texts)).sum())
            for texts, item in zip(sampled, items, strict=True)
        ]
        report["pass@1"] = sum(pass_at_k(samples, c, 1) for c in correct) / len(items)
        report[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in correct) / len(items)
    return report


def train(cfg: ReasonSFTConfig) -> dict[str, Any]:
    """Run the whole SFT procedure (see the module docstring); returns the report written beside the model."""
    start = time.monotonic()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    # 1. data
    train_items = make_math_items(cfg.train_items, cfg.seed, cfg.image_size, "train")
    heldout = {
        split: make_math_items(cfg.eval_items, cfg.seed + 1, cfg.image_size, split)
        for split in ("heldout", "heldout_templates")
    }
    # 2. tokenizer, processor, random model, vision pretraining
    model_config = TinyVLMConfig(
        image_size=cfg.image_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
        vision_hidden_size=cfg.vision_hidden_size,
        vision_depth=cfg.vision_depth,
        vision_intermediate_size=2 * cfg.vision_hidden_size,
        seed=cfg.seed,
    )
    corpus = sorted({item.prompt for item in train_items}) + [item.completion for item in train_items[:4000]]
    corpus += [CAPTION_QUESTION, *sorted({f"<answer>{caption(item)}</answer>" for item in train_items})]
    tokenizer = train_tokenizer(corpus, vocab_size=model_config.vocab_size)
    processor = build_processor(tokenizer, model_config)
    model = build_model(tokenizer, model_config).train()
    generator = torch.Generator().manual_seed(cfg.seed)
    vision = pretrain_vision(model, processor, train_items, heldout["heldout"], cfg, generator)  # type: ignore[arg-type]
    logger.info(
        "vision pretraining: colour %.3f shape %.3f (%.0fs)",
        vision["colour"],
        vision["shape"],
        time.monotonic() - start,
    )
    # 3. SFT with snapshots
    batcher = ReasonBatcher(processor, train_items)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    out = Path(cfg.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    curve: list[dict[str, Any]] = []
    losses: list[float] = []
    train_start = time.monotonic()
    train_seconds = 0.0
    for step in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            # warm-up, then constant: a snapshot at step N is then the model that `--steps N` trains
            group["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps)
        indices = torch.randint(len(train_items), (cfg.batch_size,), generator=generator).tolist()
        as_caption = bool(torch.rand((), generator=generator) < cfg.caption_fraction)
        loss = model(**batcher.batch(indices, as_caption)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0:
            logger.info("step %d loss %.4f %.0fs", step, sum(losses[-50:]) / 50, time.monotonic() - start)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            train_seconds += time.monotonic() - train_start
            model.eval()
            snapshot = tmp / "snapshots" / f"step_{step}"
            model.save_pretrained(snapshot)
            processor.save_pretrained(snapshot)
            point = {
                "step": step,
                "train_minutes": train_seconds / 60,
                "loss": sum(losses[-50:]) / len(losses[-50:]),
                **{
                    split: _summary(
                        reasoning_report(
                            model, processor, items[: cfg.curve_items], cfg.samples, cfg.max_new_tokens
                        )
                    )
                    for split, items in heldout.items()
                },
            }
            (snapshot / "report.json").write_text(json.dumps(point, indent=2) + "\n")
            curve.append(point)
            logger.info("step %d: %s", step, json.dumps(point))
            model.train()
            train_start = time.monotonic()
    # 4. the final model, its report and card
    model.eval()
    final = {
        split: reasoning_report(model, processor, items, cfg.samples, cfg.max_new_tokens)
        for split, items in heldout.items()
    }
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    report = {
        "config": dataclasses.asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_minutes": train_seconds / 60,
        "wall_minutes": (time.monotonic() - start) / 60,
        "vision_pretraining": vision,
        "heldout": final,
        "curve": curve,
        "command": command_line(cfg),
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}, torch.set_num_threads({cfg.threads})",
    }
    (tmp / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (tmp / "card.md").write_text(render_card(report))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return report


def render_card(report: dict[str, Any]) -> str:
    """The model card: how the checkpoint was made and what it scores on the two held-out sets."""
    cfg = report["config"]
    columns = (
        "lenient",
        "strict",
        "format",
        "perception",
        "wrong_with_right_counts",
        "pass@1",
        f"pass@{cfg['samples']}",
    )
    names = {
        "heldout": "held-out scenes, training templates",
        "heldout_templates": "held-out scenes and templates",
    }
    rows = "\n".join(
        f"| {names[split]} | " + " | ".join(f"{r[c]:.1%}" for c in columns if c in r) + " |"
        for split, r in report["heldout"].items()
    )
    per_template = "\n".join(
        f"| {name} | {'yes' if split == 'heldout_templates' else 'no'} | {value:.1%} |"
        for split, r in report["heldout"].items()
        for name, value in r["per_template"].items()
    )
    at_k = f"pass@{cfg['samples']}"
    curve = "\n".join(
        f"| {p['step']} | {p['train_minutes']:.1f} | {p['heldout']['lenient']:.1%} | {p['heldout']['perception']:.1%} "
        f"| {p['heldout'].get(at_k, float('nan')):.1%} | {p['heldout_templates']['lenient']:.1%} |"
        for p in report["curve"]
    )
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
- vision pretraining first: {
        cfg["vision_pretrain_steps"]
    } steps of per-image-token colour and shape classification
  (`sft_shapes.pretrain_vision`), held-out token accuracy colour {
        report["vision_pretraining"]["colour"]:.1%}, shape
  {report["vision_pretraining"]["shape"]:.1%}
- then {cfg["steps"]} steps of {cfg["batch_size"]} items, AdamW lr {cfg["lr"]} (constant after {
        cfg["warmup_steps"]
    }
  warm-up steps), loss on the completion only; {
        cfg["caption_fraction"]:.0%} of the batches are the perception task
  "list the objects from left to right." -> `<answer>red circle, blue square</answer>`
- data: {cfg["train_items"]} training items (training scenes, training templates), {cfg["image_size"]}x{
        cfg["image_size"]
    } scenes

## Held-out scores

{cfg["eval_items"]} questions per set (seed {
        cfg["seed"] + 1
    }). Greedy: `lenient` = the `<answer>` span read as a
number, number words accepted (`numeric`, `number_words=True`, `require_answer_tag=True`); `strict` = the span is
exactly the digits (`exact_match`); `format` = `<think>...</think><answer>...</answer>` only; `perception` = share of
the counts the reference trace needs that the model's trace states correctly. `pass@k`: lenient, {
        cfg["samples"]
    }
samples per question at temperature 1 (unbiased estimator).

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

Scored on the first {cfg["curve_items"]} questions of each set at every snapshot:

| step | SFT minutes | lenient | perception | pass@{cfg["samples"]} | lenient, held-out templates |
|---|---|---|---|---|---|
{curve}

Re-score with `python -m mmrl.vlm.sft_reason --eval-only --out {
        cfg["out"]
    }`; the numbers are in `sft_report.json`.
"""


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "examples"}


def command_line(cfg: ReasonSFTConfig) -> str:
    """The command that reproduces ``cfg``: ``--out``, ``--steps``, ``--seed`` and every non-default option."""
    defaults = ReasonSFTConfig()
    parts = ["python -m mmrl.vlm.sft_reason"]
    for option in dataclasses.fields(ReasonSFTConfig):
        value = getattr(cfg, option.name)
        if option.name in ("out", "steps", "seed") or value != getattr(defaults, option.name):
            parts.append(f"--{option.name.replace('_', '-')} {value}")
    return " ".join(parts)


def evaluate_checkpoint(path: str, eval_items: int, samples: int, seed: int = 0) -> dict[str, Any]:
    """Score a saved checkpoint on the held-out sets its card reports (``seed + 1``, ``eval_items`` each)."""
    from pipelines.vlm.hf_backend import load_vlm

    processor, model = load_vlm(path)
    model.eval()
    return {
        split: reasoning_report(model, processor, make_math_items(eval_items, seed + 1, 64, split), samples)
        for split in ("heldout", "heldout_templates")
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m mmrl.vlm.sft_reason --help``)."""
    defaults = ReasonSFTConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for option in dataclasses.fields(ReasonSFTConfig):
        default = getattr(defaults, option.name)
        parser.add_argument(
            "--" + option.name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{option.metadata['help']} (default: {default})",
        )
    parser.add_argument(
        "--eval-only", action="store_true", help="score the checkpoint in --out on the held-out sets and exit"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = ReasonSFTConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ReasonSFTConfig)})
    if args.eval_only:
        torch.set_num_threads(cfg.threads)
        print(json.dumps(evaluate_checkpoint(cfg.out, cfg.eval_items, cfg.samples, cfg.seed), indent=2))
        return
    report = train(cfg)
    print(json.dumps({split: _summary(r) for split, r in report["heldout"].items()}, indent=2))


if __name__ == "__main__":
    main()
