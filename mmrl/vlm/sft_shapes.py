"""Supervised fine-tuning of the tiny shapes VLM, from random weights to weak-but-meaningful VQA accuracy (recipe
``vlm_sft_shapes``).

    mmrl train configs/pretrain/shapes_vlm.yaml                          # the committed checkpoint's settings
    python -m mmrl.vlm.sft_shapes --eval-only --out checkpoints/shapes_vlm   # re-score a published model

1. generate a pool of training VQA items (``mmrl.data.shapes_vqa``, train split of scenes);
2. train a tokenizer on their text and build the tiny Qwen2.5-VL (``pipelines.vlm.tiny``) with random weights;
   with ``trainer.vision_pretrain_steps``, pretrain the vision tower alone on dense per-token labels first;
3. train all weights on ``prompt -> <answer>X</answer><|im_end|>`` with the loss on the completion only
   (AdamW, linear warm-up then cosine decay over ``trainer.steps``); a share of the batches is the auxiliary
   captioning task on the same scenes (:data:`mmrl.vlm.sft.CAPTION_QUESTION`);
4. evaluate on held-out scenes by greedy generation through the transformers backend, scored by
   ``rewards.build("exact_match")``, next to two blind baselines (the most common training answer overall and
   per question kind), and with ``data.number_words`` also with number words read as digits;
5. publish model + processor (``save_pretrained``), ``config.yaml``, ``sft_report.json`` and ``card.md`` to
   ``out``, atomically. The loop, schedule, checkpoints and resume are :class:`mmrl.vlm.sft.VLMSFTTrainer`'s.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch

import rewards
from mmrl.config import Config, Field, RunConfig
from mmrl.data.shapes import COLOURS, SHAPES
from mmrl.data.shapes_vqa import VQA_KINDS, VQAItem, format_prompt, make_vqa_items
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
from pipelines.vlm.tiny import TinyVLMConfig
from rewards.text import NUMBER_WORDS

__all__ = ["SFTShapesConfig", "SFTShapesTrainer", "main"]

logger = logging.getLogger(__name__)


class VQADataSection(Config):
    """The shapes-world VQA items the model trains and is scored on."""

    train_items: int = Field(
        12000,
        ge=1,
        description="Size of the training pool (items cost ~2 ms each to render; the pool is reused over epochs).",
    )
    eval_items: int = Field(
        700, ge=1, description="Held-out items evaluated at the end (balanced over the 7 question kinds)."
    )
    curve_items: int = Field(
        140,
        ge=1,
        description="Held-out items of each learning-curve evaluation (a prefix of the final ones).",
    )
    curriculum: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the run over which scenes grow from one object to four (one more object per third "
        "of it); 0: scenes of 1-4 objects from the start.",
    )
    number_words: float = Field(
        0.0,
        ge=0,
        le=1,
        description='Share of the training items whose count answer is written as an English word ("two") '
        "instead of the digits the question asks for, as in corpora that mix both conventions; the verifier of "
        "the RL task (exact match) wants digits. Drawn once per item. 0: digits everywhere.",
    )


class SFTShapesSettings(VLMSFTSettings):
    """The VQA SFT's defaults: cosine decay to 0."""

    batch_size: int = Field(16, ge=1, description="Items per optimizer step.")
    lr: float = Field(5e-3, gt=0, description="Peak learning rate of AdamW.")


class SFTShapesConfig(SupervisedRecipeConfig):
    recipe: Literal["vlm_sft_shapes"] = Field("vlm_sft_shapes", description="Which recipe this config runs.")
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="sft_shapes", threads=1, log_every=25))
    model: TinyVLMSection = Field(default_factory=TinyVLMSection)
    data: VQADataSection = Field(default_factory=VQADataSection)
    trainer: SFTShapesSettings = Field(default_factory=SFTShapesSettings)


#: Count answers written as words (``data.number_words``).
COUNT_WORDS = {int(digit): word for word, digit in NUMBER_WORDS.items()}


def build_corpus(items: Sequence[VQAItem]) -> list[str]:
    """Tokenizer training text: every distinct prompt, every possible answer in its answer tags, the captions."""
    counts = range(5)  # a scene has 1-4 objects; a count of a colour or shape can be 0
    answers = [*(str(i) for i in counts), *(COUNT_WORDS[i] for i in counts), *COLOURS, *SHAPES, "yes", "no"]
    prompts = sorted({item.prompt for item in items})
    captions = sorted({caption(item) for item in items})
    return [*prompts, CAPTION_QUESTION, *(_completion(a) for a in [*answers, *captions])]


def _prompt(item: VQAItem) -> VLMPrompt:
    return VLMPrompt.from_question(format_prompt(item.question), [item.image])


def _completion(answer: str) -> str:
    return f"<answer>{answer}</answer>"


class SFTBatcher(CompletionBatcher):
    """VQA batches: ``format_prompt(question) -> <answer>X</answer>``.

    ``number_words``: the share of count questions whose answer is written as a word, drawn once per item from
    ``seed`` (see ``data.number_words``)."""

    def __init__(
        self, processor: Any, items: Sequence[VQAItem], number_words: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__(processor, items)
        draws = torch.rand(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
        self.answers = [
            COUNT_WORDS[int(item.answer)]
            if item.kind.startswith("count") and draw < number_words
            else item.answer
            for item, draw in zip(items, draws, strict=True)
        ]

    def task_texts(self, index: int) -> tuple[str, str]:
        return format_prompt(self.items[index].question), _completion(self.answers[index])


def greedy_answers(
    model: torch.nn.Module, processor: Any, items: Sequence[VQAItem], batch_size: int = 64
) -> list[str]:
    """The model's greedy completion of each item's VQA prompt."""
    backend = HFBackend(model, processor, batch_size=batch_size)
    result = backend.generate(
        [_prompt(item) for item in items], SamplingParams(temperature=0.0, max_new_tokens=10)
    )
    texts = [""] * len(items)
    for sample in result.samples:
        texts[sample.prompt_index] = sample.text
    return texts


def score_answers(
    items: Sequence[VQAItem], texts: Sequence[str], number_words: bool = False
) -> dict[str, float]:
    """Accuracy per kind and ``"overall"``: exact match on the answer span (``number_words``: "two" == "2")."""
    verifier = rewards.build("exact_match", number_words=number_words)
    scores = verifier(completions=list(texts), ground_truths=[item.answer for item in items])
    return _accuracy_by_kind(items, scores.tolist())


def score_vqa(
    model: torch.nn.Module, processor: Any, items: Sequence[VQAItem], batch_size: int = 64
) -> dict[str, float]:
    """Held-out accuracy per kind and ``"overall"``: greedy generation, exact match on the answer span."""
    return score_answers(items, greedy_answers(model, processor, items, batch_size))


def _accuracy_by_kind(items: Sequence[VQAItem], scores: Sequence[float]) -> dict[str, float]:
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for item, score in zip(items, scores, strict=True):
        totals[item.kind].append(score)
    accuracy = {kind: sum(v) / len(v) for kind, v in sorted(totals.items())}
    accuracy["overall"] = sum(scores) / len(scores)
    return accuracy


def blind_baselines(train: Sequence[VQAItem], heldout: Sequence[VQAItem]) -> dict[str, dict[str, float]]:
    """Held-out accuracy of answering without looking: the most common training answer overall
    (``majority``), and the most common training answer of the question's kind (``majority_per_kind``)."""
    overall = collections.Counter(item.answer for item in train).most_common(1)[0][0]
    per_kind = {
        kind: collections.Counter(item.answer for item in train if item.kind == kind).most_common(1)[0][0]
        for kind in {item.kind for item in train}
    }
    return {
        "majority": _accuracy_by_kind(heldout, [float(item.answer == overall) for item in heldout]),
        "majority_per_kind": _accuracy_by_kind(
            heldout, [float(item.answer == per_kind.get(item.kind)) for item in heldout]
        ),
    }


def max_objects(progress: float, curriculum: float) -> int:
    """Most objects a training scene may hold at ``progress`` (0 -> 1) of the run: 1 at the start, one more per
    third of the ``curriculum`` share, 4 (every scene) from ``progress >= curriculum`` on."""
    if curriculum <= 0:
        return 4
    return min(4, 1 + int(3 * progress / curriculum))


class SFTShapesTrainer(VLMSFTTrainer):
    """VQA SFT: batches from scenes allowed by the curriculum, a learning curve on a held-out prefix every
    ``trainer.eval_every`` steps, the full held-out evaluation and blind baselines at the end."""

    cfg: SFTShapesConfig
    show = ("loss", "eval/accuracy")

    def build_data(self) -> None:
        data, size, seed = self.cfg.data, self.cfg.model.image_size, self.cfg.run.seed
        self.train_items = make_vqa_items(data.train_items, seed=seed, size=size, split="train")
        self.heldout = make_vqa_items(data.eval_items, seed=seed + 1, size=size, split="heldout")
        self.n_objects = torch.tensor([len(item.scene.objects) for item in self.train_items])

    def corpus(self) -> list[str]:
        return build_corpus(self.train_items)

    def make_batcher(self) -> SFTBatcher:
        return SFTBatcher(
            self.processor, self.train_items, self.cfg.data.number_words, seed=self.cfg.run.seed
        )

    def sample_indices(self) -> list[int]:
        progress = self.step / self.cfg.trainer.steps
        eligible = torch.nonzero(self.n_objects <= max_objects(progress, self.cfg.data.curriculum)).flatten()
        draws = torch.randint(len(eligible), (self.cfg.trainer.batch_size,), generator=self.generator)
        return eligible[draws].tolist()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Learning-curve accuracy on the first ``data.curve_items`` held-out items when due; at the last step the
        full held-out accuracy (also with number words read as digits)."""
        scores: dict[str, float] = {}
        self.model.eval()
        if self.curve_due():
            point = score_vqa(self.model, self.processor, self.heldout[: self.cfg.data.curve_items])
            self.curve.append({"step": self.step, "seconds": self.train_seconds, **point})
            scores["eval/curve_accuracy"] = point["overall"]
        if self.step == self.cfg.trainer.steps:
            texts = greedy_answers(self.model, self.processor, self.heldout)
            self.final = {
                "heldout_accuracy": score_answers(self.heldout, texts),
                "heldout_accuracy_number_words": score_answers(self.heldout, texts, number_words=True),
            }
            scores["eval/accuracy"] = self.final["heldout_accuracy"]["overall"]
            scores["eval/accuracy_number_words"] = self.final["heldout_accuracy_number_words"]["overall"]
        self.model.train()
        return scores

    def report(self) -> dict[str, Any]:
        return {**self.final, "baselines": blind_baselines(self.train_items, self.heldout)}

    def render_card(self, report: dict[str, Any]) -> str:
        return render_card(report)


def render_card(report: dict) -> str:
    """The model card: how the checkpoint was made and what it scores."""
    accuracy = report["heldout_accuracy"]
    majority = report["baselines"]["majority"]
    per_kind = report["baselines"]["majority_per_kind"]
    cfg = flat_settings(report["config"])
    read = report.get("heldout_accuracy_number_words") if cfg.get("number_words") else None
    rows = "\n".join(
        f"| {kind} | {accuracy[kind]:.1%} |{f' {read[kind]:.1%} |' if read else ''} {majority[kind]:.1%} | "
        f"{per_kind[kind]:.1%} |"
        for kind in [*VQA_KINDS, "overall"]
        if kind in accuracy
    )
    read_column = " model, number words accepted |" if read else ""
    header = f"| kind | model |{read_column} majority answer | majority per kind |"
    words = (
        f"\n- count answers: {cfg['number_words']:.0%} of the training items write theirs as a word "
        "(`<answer>two</answer>`), the rest in digits as the question asks; the exact-match verifier wants digits, "
        'the column "number words accepted" reads a word as its digits '
        '(`rewards.build("exact_match", number_words=True)`)'
        if read
        else ""
    )
    curriculum = (
        f"; scenes grow from one object to four over the first {cfg['curriculum']:.0%} of the steps"
        if cfg.get("curriculum")
        else ""
    )
    merge = TinyVLMConfig.merge_size  # (not a setting of the recipe)
    image_tokens = (cfg["image_size"] // (cfg.get("patch_size", TinyVLMConfig.patch_size) * merge)) ** 2
    vision_line = vision_pretraining_line(report, cfg.get("vision_pretrain_steps", 0))
    vision_line = f"\n{vision_line}" if vision_line else ""
    curve = ""
    if report.get("curve"):
        points = "\n".join(
            f"| {p['step']} | {p['seconds'] / 60:.1f} | {p['overall']:.1%} |" for p in report["curve"]
        )
        curve = f"""
## Learning curve

Held-out accuracy on the first {cfg["curve_items"]} of those items during training (minutes of training steps):

| step | minutes | accuracy |
|---|---|---|
{points}
"""
    return f"""# Tiny shapes VLM (SFT)

A {report["parameters"] / 1e6:.2f} M-parameter `Qwen2_5_VLForConditionalGeneration` built from config
(`pipelines.vlm.tiny`), random-initialised, then fine-tuned on shapes-world VQA (`mmrl.data.shapes_vqa`).
Load it like any Qwen2.5-VL checkpoint:

```python
from transformers import AutoModelForImageTextToText, AutoProcessor
processor = AutoProcessor.from_pretrained("{cfg["out"]}")
model = AutoModelForImageTextToText.from_pretrained("{cfg["out"]}")
```

## How it was made

- command: `{report["command"]}`
- seed: {cfg["seed"]}
- wall time: {report["wall_seconds"] / 60:.1f} min ({report["train_seconds"] / 60:.1f} min of training,
  {report["steps"]} steps of {cfg["batch_size"]} items, final training loss {report["final_loss"]:.3f})
- machine: {report["machine"]}{vision_line}
- data: {cfg["train_items"]} training items (train split of scenes), {cfg["image_size"]}x{cfg["image_size"]}
  scenes ({image_tokens} image tokens), completion `<answer>X</answer><|im_end|>`; {cfg["caption_fraction"]:.0%} of the
  batches are the auxiliary captioning task ("{CAPTION_QUESTION}" -> `<answer>red circle, blue square</answer>`){curriculum}
- scenes of another size are resized to {cfg["image_size"]}x{cfg["image_size"]} by the processor; for RL and
  evaluation, render scenes at this size (`make_vqa_items(..., size={cfg["image_size"]})`){words}

## Held-out accuracy

{cfg["eval_items"]} items on held-out scenes (no held-out scene shares its set of objects with a training scene),
greedy decoding, exact match on the `<answer>` span (`rewards.build("exact_match")`). Blind baselines answer
without the image: the most common training answer overall, and the most common training answer of the
question's kind.

{header}
|---|---|---|---|{"---|" if read else ""}
{rows}

Reproduce the evaluation with `python -m mmrl.vlm.sft_shapes --eval-only --out {cfg["out"]}`; the numbers
above are in `sft_report.json`.
{curve}"""


def evaluate_checkpoint(path: str, settings: dict[str, Any]) -> dict[str, float]:
    """Re-evaluate a published model on the held-out items its card reports (``settings``: its report's config:
    same seed, count and size)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    heldout = make_vqa_items(
        settings["eval_items"], seed=settings["seed"] + 1, size=settings["image_size"], split="heldout"
    )
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return score_vqa(model, processor, heldout)


def main(cfg: SFTShapesConfig) -> dict[str, float]:
    """Train end to end (``mmrl train``); returns the final metrics."""
    return run_recipe(cfg, SFTShapesTrainer)


if __name__ == "__main__":
    rescore_main("python -m mmrl.vlm.sft_shapes", evaluate_checkpoint)
