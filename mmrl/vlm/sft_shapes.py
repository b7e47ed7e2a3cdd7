"""Supervised fine-tuning of the tiny shapes VLM, from random weights to weak-but-meaningful VQA accuracy.

    python -m mmrl.vlm.sft_shapes --out checkpoints/shapes_vlm --minutes 15 --seed 0 --train-items 40000 \
        --vision-pretrain-steps 2000 --number-words 0.9 --batch-size 32 --lr 0.003 --eval-every 500

(the committed checkpoint's command, from its card)

1. generate a pool of training VQA items (``mmrl.data.shapes_vqa``, train split of scenes);
2. train a tokenizer on their text and build the tiny Qwen2.5-VL (``pipelines.vlm.tiny``) with random weights;
   with ``--vision-pretrain-steps``, pretrain the vision tower alone on dense per-token labels first;
3. train all weights on ``prompt -> <answer>X</answer><|im_end|>`` with the loss on the completion only
   (AdamW, linear warm-up then cosine decay over the time budget), for ``--minutes`` or ``--steps``; a share of
   the batches is an auxiliary captioning task on the same scenes (:data:`CAPTION_QUESTION`);
4. evaluate on held-out scenes by greedy generation through the transformers backend, scored by
   ``rewards.build("exact_match")``, next to two blind baselines (the most common training answer overall and
   per question kind), and with ``--number-words`` also with number words read as digits;
5. save model + processor with ``save_pretrained`` (atomically: temp directory, then rename) and a ``card.md``.

The schedule follows the wall clock when ``--steps`` is not given, so the run fits its budget on any machine;
the card records the steps that ran. For a run that repeats step for step, pass ``--steps``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import math
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rewards
from mmrl.data.shapes import COLOURS, SHAPES, Scene
from mmrl.data.shapes_vqa import VQA_KINDS, VQAItem, format_prompt, make_vqa_items
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.families.qwen2_5_vl import mm_token_type_ids
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.inputs import VLMPrompt, prepare_prompts
from pipelines.vlm.tiny import TinyVLMConfig, build_model, build_processor, train_tokenizer
from rewards.text import NUMBER_WORDS

logger = logging.getLogger(__name__)


@dataclass
class SFTConfig:
    """Options of the SFT run (each is also a command-line flag)."""

    out: str = field(
        default="checkpoints/shapes_vlm",
        metadata={
            "help": "Directory the model, processor and card.md are written to (replaced if it exists)."
        },
    )
    minutes: float = field(
        default=15.0,
        metadata={
            "help": "Wall-clock budget of the whole run (data, training, evaluation); training gets what the rest leaves."
        },
    )
    steps: int | None = field(
        default=None,
        metadata={
            "help": "Fixed number of optimizer steps (reproducible step for step); ``None`` trains until the time budget."
        },
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the data, the initialisation and the batch order."},
    )
    train_items: int = field(
        default=12000,
        metadata={
            "help": "Size of the training pool (items cost ~2 ms each to render; the pool is reused over epochs)."
        },
    )
    eval_items: int = field(
        default=700,
        metadata={"help": "Held-out items evaluated at the end (balanced over the 7 question kinds)."},
    )
    image_size: int = field(
        default=TinyVLMConfig.image_size,
        metadata={
            "help": "Scene side in pixels the model is trained on (64: 16 image tokens at the default patch and merge sizes)."
        },
    )
    hidden_size: int = field(
        default=TinyVLMConfig.hidden_size,
        metadata={"help": "Language-model width of the tiny VLM (TinyVLMConfig.hidden_size)."},
    )
    num_layers: int = field(
        default=TinyVLMConfig.num_layers,
        metadata={"help": "Language-model decoder layers (TinyVLMConfig.num_layers)."},
    )
    intermediate_size: int = field(
        default=TinyVLMConfig.intermediate_size,
        metadata={"help": "Language-model MLP width (TinyVLMConfig.intermediate_size)."},
    )
    vision_depth: int = field(
        default=TinyVLMConfig.vision_depth,
        metadata={"help": "Vision-tower blocks (TinyVLMConfig.vision_depth)."},
    )
    vision_hidden_size: int = field(
        default=TinyVLMConfig.vision_hidden_size,
        metadata={"help": "Vision-tower width (TinyVLMConfig.vision_hidden_size)."},
    )
    vision_heads: int = field(
        default=TinyVLMConfig.vision_heads,
        metadata={"help": "Vision-tower attention heads (TinyVLMConfig.vision_heads)."},
    )
    patch_size: int = field(
        default=TinyVLMConfig.patch_size,
        metadata={
            "help": "Vision patch side in pixels (TinyVLMConfig.patch_size; image tokens = (image_size / patch / 2)^2)."
        },
    )
    curriculum: float = field(
        default=0.0,
        metadata={
            "help": "Share of the run over which scenes grow from one object to four (one more object per third "
            "of it); 0: scenes of 1-4 objects from the start. Shapes are learned first on scenes where "
            "nothing else competes for the image tokens."
        },
    )
    vision_pretrain_steps: int = field(
        default=0,
        metadata={
            "help": "Steps of dense vision pretraining before SFT: the vision tower and merger learn, through a "
            "linear head on each image token, the colour and shape of the object covering it (or background), "
            "as real VLMs start from a pretrained vision encoder. 0: none."
        },
    )
    vision_pretrain_lr: float = field(
        default=3e-3,
        metadata={"help": "Learning rate (AdamW, constant) of the dense vision pretraining."},
    )
    number_words: float = field(
        default=0.0,
        metadata={
            "help": 'Share of the training items whose count answer is written as an English word ("two") '
            "instead of the digits the question asks for, as in corpora that mix both conventions; the verifier "
            "of the RL task (exact match) wants digits. Drawn once per item. 0: digits everywhere."
        },
    )
    caption_fraction: float = field(
        default=0.6,
        metadata={"help": "Share of training batches that are the auxiliary captioning task instead of VQA."},
    )
    batch_size: int = field(
        default=16,
        metadata={"help": "Items per optimizer step."},
    )
    lr: float = field(
        default=5e-3,
        metadata={"help": "Peak learning rate of AdamW."},
    )
    warmup_steps: int = field(
        default=50,
        metadata={"help": "Linear warm-up steps before the cosine decay."},
    )
    weight_decay: float = field(
        default=0.01,
        metadata={"help": "AdamW weight decay."},
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Also evaluate on the first ``curve_items`` held-out items every this many steps, for the "
            "card's learning curve (0: only at the end)."
        },
    )
    curve_items: int = field(
        default=140,
        metadata={"help": "Held-out items of each learning-curve evaluation (a prefix of the final ones)."},
    )
    eval_reserve_s: float = field(
        default=60.0,
        metadata={"help": "Seconds of the budget kept for the final evaluation and saving."},
    )
    threads: int = field(
        default=1,
        metadata={
            "help": "CPU threads for torch. On a shared, oversubscribed CPU one thread is several times faster "
            "than two: each parallel region waits for its slowest thread."
        },
    )


#: The auxiliary captioning task: a scene's objects left to right. A caption carries one colour and one shape
#: token per object, several times the visual signal of a one-word VQA answer, on a shorter prompt, so it
#: teaches the vision tower colours, shapes, counts and order faster than VQA alone.
CAPTION_QUESTION = "list the objects from left to right."


#: Count answers written as words (``SFTConfig.number_words``).
COUNT_WORDS = {int(digit): word for word, digit in NUMBER_WORDS.items()}


def caption(item: VQAItem) -> str:
    """``"red triangle, green circle"``: the scene's objects sorted by their centre's x."""
    return ", ".join(f"{o.colour} {o.shape}" for o in sorted(item.scene.objects, key=lambda o: o.x))


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


class SFTBatcher:
    """Builds training batches: prompt ids cached per question (every scene has the same size, hence the same
    image-token count), completion ids per answer, pixels through the image processor.

    ``number_words``: the share of count questions whose answer is written as a word, drawn once per item from
    ``seed`` (see ``SFTConfig.number_words``)."""

    def __init__(
        self, processor: Any, items: Sequence[VQAItem], number_words: float = 0.0, seed: int = 0
    ) -> None:
        self.processor = processor
        self.items = items
        draws = torch.rand(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
        self.answers = [
            COUNT_WORDS[int(item.answer)]
            if item.kind.startswith("count") and draw < number_words
            else item.answer
            for item, draw in zip(items, draws, strict=True)
        ]
        self.pad_id = processor.tokenizer.pad_token_id
        self.end_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._prompt_ids: dict[str, list[int]] = {}
        self._answer_ids: dict[str, list[int]] = {}

    def _ids(self, index: int, as_caption: bool) -> tuple[list[int], list[int]]:
        item = self.items[index]
        question = CAPTION_QUESTION if as_caption else format_prompt(item.question)
        answer = caption(item) if as_caption else self.answers[index]
        if question not in self._prompt_ids:
            prompt = VLMPrompt.from_question(question, [item.image])
            self._prompt_ids[question] = prepare_prompts(self.processor, [prompt])[0][0].input_ids
        if answer not in self._answer_ids:
            ids = self.processor.tokenizer(_completion(answer), add_special_tokens=False)["input_ids"]
            self._answer_ids[answer] = [*ids, self.end_id]
        return self._prompt_ids[question], self._answer_ids[answer]

    def batch(self, indices: Sequence[int], as_caption: bool) -> dict[str, torch.Tensor]:
        """Right-padded ``[B, L]`` inputs with ``labels`` = -100 everywhere but the completion: the items'
        captions when ``as_caption``, else their VQA questions (one task per batch: caption prompts are ~40%
        shorter, which padding to a mixed batch would waste)."""
        rows = [self._ids(i, as_caption) for i in indices]
        return sft_batch(self.processor, rows, [self.items[i].image for i in indices], self.pad_id)


def sft_batch(
    processor: Any, rows: Sequence[tuple[list[int], list[int]]], images: Sequence[Any], pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, L]`` model inputs of ``(prompt ids, completion ids)`` rows, one image each, with
    ``labels`` = -100 everywhere but the completion (the loss is on the completion only)."""
    batch_size, length = len(rows), max(len(prompt) + len(answer) for prompt, answer in rows)
    input_ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, length), -100, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    for row, (prompt, answer) in enumerate(rows):
        ids = torch.tensor(prompt + answer)
        input_ids[row, : len(ids)] = ids
        labels[row, len(prompt) : len(ids)] = torch.tensor(answer)
        attention_mask[row, : len(ids)] = 1
    vision = processor.image_processor(images=list(images), return_tensors="pt")
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids(input_ids, processor.image_token_id, None),
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": vision["image_grid_thw"],
        "labels": labels,
    }


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


def evaluate(
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


def token_labels(scene: Scene, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([grid*grid] colour index, [grid*grid] shape index)`` of the image tokens of ``scene``, row-major: the
    object whose box covers most of the token's cell, or the background class (``len(COLOURS)`` /
    ``len(SHAPES)``) when no object covers a quarter of it."""
    cell = scene.size / grid
    colours = torch.full((grid, grid), len(COLOURS))
    shapes = torch.full((grid, grid), len(SHAPES))
    for gy in range(grid):
        for gx in range(grid):
            best = 0.25 * cell * cell  # the least overlap that labels a cell with an object
            for o in scene.objects:
                x0, y0, x1, y1 = o.box
                overlap = max(0.0, min(x1, (gx + 1) * cell) - max(x0, gx * cell)) * max(
                    0.0, min(y1, (gy + 1) * cell) - max(y0, gy * cell)
                )
                if overlap >= best:
                    best = overlap
                    colours[gy, gx], shapes[gy, gx] = COLOURS.index(o.colour), SHAPES.index(o.shape)
    return colours.flatten(), shapes.flatten()


def pretrain_vision(
    model: torch.nn.Module,
    processor: Any,
    train_items: Sequence[VQAItem],
    heldout: Sequence[VQAItem],
    cfg: SFTConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """Dense vision pretraining (``cfg.vision_pretrain_steps`` steps): the vision tower and its merger learn, through
    a linear head on each merged image token, the colour and shape of what covers the token (:func:`token_labels`).

    The tiny VLM learns shapes through the language model only slowly (a caption's loss reaches the vision tower
    through the whole decoder); a direct per-token objective teaches them in about a minute. The head is discarded.

    Returns:
        Held-out accuracy of the head's colour and shape on the tokens an object covers.
    """
    visual = model.model.visual
    grid = cfg.image_size // (processor.image_processor.patch_size * processor.image_processor.merge_size)
    width = model.config.text_config.hidden_size
    n_colours, n_shapes = len(COLOURS) + 1, len(SHAPES) + 1
    head = torch.nn.Linear(width, n_colours + n_shapes)
    optimizer = torch.optim.AdamW([*visual.parameters(), *head.parameters()], lr=cfg.vision_pretrain_lr)

    def logits(items: Sequence[VQAItem]) -> torch.Tensor:
        vision = processor.image_processor(images=[item.image for item in items], return_tensors="pt")
        tokens = visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
        return head(tokens.view(len(items), grid * grid, width))

    def targets(items: Sequence[VQAItem]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [token_labels(item.scene, grid) for item in items]
        return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])

    for _ in range(cfg.vision_pretrain_steps):
        batch = [
            train_items[i] for i in torch.randint(len(train_items), (cfg.batch_size,), generator=generator)
        ]
        out = logits(batch)
        colours, shapes = targets(batch)
        loss = torch.nn.functional.cross_entropy(
            out[..., :n_colours].flatten(0, 1), colours.flatten()
        ) + torch.nn.functional.cross_entropy(out[..., n_colours:].flatten(0, 1), shapes.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        out = logits(heldout)
        colours, shapes = targets(heldout)
    covered = shapes < len(SHAPES)
    return {
        "colour": float((out[..., :n_colours].argmax(-1) == colours)[covered].float().mean()),
        "shape": float((out[..., n_colours:].argmax(-1) == shapes)[covered].float().mean()),
        "loss": loss.item() if cfg.vision_pretrain_steps else float("nan"),
    }


def max_objects(progress: float, curriculum: float) -> int:
    """Most objects a training scene may hold at ``progress`` (0 -> 1) of the run: 1 at the start, one more per
    third of the ``curriculum`` share, 4 (every scene) from ``progress >= curriculum`` on."""
    if curriculum <= 0:
        return 4
    return min(4, 1 + int(3 * progress / curriculum))


def _lr_factor(step: int, progress: float, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 0 as ``progress`` goes 0 -> 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def train(cfg: SFTConfig) -> dict:
    """Run the whole SFT procedure (see the module docstring); returns the card's numbers."""
    start = time.monotonic()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    # 1. data
    train_items = make_vqa_items(cfg.train_items, seed=cfg.seed, size=cfg.image_size, split="train")
    heldout = make_vqa_items(cfg.eval_items, seed=cfg.seed + 1, size=cfg.image_size, split="heldout")
    logger.info(
        "data: %d train, %d held-out items in %.0fs", len(train_items), len(heldout), time.monotonic() - start
    )
    # 2. tokenizer, processor, random model
    model_config = TinyVLMConfig(
        image_size=cfg.image_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
        vision_depth=cfg.vision_depth,
        vision_hidden_size=cfg.vision_hidden_size,
        vision_heads=cfg.vision_heads,
        vision_intermediate_size=2 * cfg.vision_hidden_size,
        patch_size=cfg.patch_size,
        seed=cfg.seed,
    )
    tokenizer = train_tokenizer(build_corpus(train_items), vocab_size=model_config.vocab_size)
    processor = build_processor(tokenizer, model_config)
    model = build_model(tokenizer, model_config).train()
    batcher = SFTBatcher(processor, train_items, cfg.number_words, seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    vision = None
    if cfg.vision_pretrain_steps:
        vision = pretrain_vision(model, processor, train_items, heldout, cfg, generator)
        logger.info(
            "vision pretraining: held-out token colour %.3f, shape %.3f (%.0fs)",
            vision["colour"],
            vision["shape"],
            time.monotonic() - start,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # 3. train
    train_start = time.monotonic()
    budget_s = cfg.minutes * 60 - (train_start - start) - cfg.eval_reserve_s
    n_objects = torch.tensor([len(item.scene.objects) for item in train_items])
    step, losses, curve = 0, [], []
    while True:
        elapsed = time.monotonic() - train_start
        progress = step / cfg.steps if cfg.steps is not None else elapsed / budget_s
        if progress >= 1.0:
            break
        eligible = torch.nonzero(n_objects <= max_objects(progress, cfg.curriculum)).flatten()
        indices = eligible[torch.randint(len(eligible), (cfg.batch_size,), generator=generator)].tolist()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, progress, cfg.warmup_steps)
        as_caption = bool(torch.rand((), generator=generator) < cfg.caption_fraction)
        loss = model(**batcher.batch(indices, as_caption)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            logger.info("step %d  loss %.4f  %.0fs", step, sum(losses[-25:]) / 25, time.monotonic() - start)
        if cfg.eval_every and step % cfg.eval_every == 0:
            model.eval()
            point = evaluate(model, processor, heldout[: cfg.curve_items])
            model.train()
            curve.append({"step": step, "seconds": time.monotonic() - train_start, **point})
            logger.info("step %d  held-out accuracy %.3f (%d items)", step, point["overall"], cfg.curve_items)
    train_s = time.monotonic() - train_start
    # 4. evaluate
    model.eval()
    texts = greedy_answers(model, processor, heldout)
    accuracy = score_answers(heldout, texts)
    read_accuracy = score_answers(heldout, texts, number_words=True)
    baselines = blind_baselines(train_items, heldout)
    # 5. save atomically: write next to the target, then swap it in
    out = Path(cfg.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    wall_s = time.monotonic() - start
    report = {
        "config": dataclasses.asdict(cfg),
        "model_config": dataclasses.asdict(model_config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": step,
        "final_loss": sum(losses[-100:]) / max(len(losses[-100:]), 1),
        "train_seconds": train_s,
        "wall_seconds": wall_s,
        "heldout_accuracy": accuracy,
        "heldout_accuracy_number_words": read_accuracy,
        "curve": curve,
        "vision_pretraining": vision,
        "baselines": baselines,
        "command": command_line(cfg),
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}, torch.set_num_threads({cfg.threads})",
    }
    (tmp / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (tmp / "card.md").write_text(render_card(report))
    # Swap by renames, so a crash leaves either the old or the new checkpoint complete on disk.
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return report


def command_line(cfg: SFTConfig) -> str:
    """The command that reproduces ``cfg``: ``--out``, ``--minutes``, ``--seed`` and every non-default option."""
    defaults = SFTConfig()
    parts = ["python -m mmrl.vlm.sft_shapes"]
    for option in dataclasses.fields(SFTConfig):
        value = getattr(cfg, option.name)
        if option.name in ("out", "minutes", "seed") or value != getattr(defaults, option.name):
            parts.append(f"--{option.name.replace('_', '-')} {value}")
    return " ".join(parts)


def render_card(report: dict) -> str:
    """The model card: how the checkpoint was made and what it scores."""
    accuracy = report["heldout_accuracy"]
    majority = report["baselines"]["majority"]
    per_kind = report["baselines"]["majority_per_kind"]
    cfg = report["config"]
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
    vision = report.get("vision_pretraining")
    vision_line = (
        f"\n- vision pretraining first: {cfg['vision_pretrain_steps']} steps of per-image-token colour and shape "
        f"classification (`pretrain_vision`), held-out token accuracy colour {vision['colour']:.1%}, shape "
        f"{vision['shape']:.1%}"
        if vision
        else ""
    )
    curve = ""
    if report.get("curve"):
        points = "\n".join(
            f"| {p['step']} | {p['seconds'] / 60:.1f} | {p['overall']:.1%} |" for p in report["curve"]
        )
        curve = f"""
## Learning curve

Held-out accuracy on the first {cfg["curve_items"]} of those items during training (evaluation time included in
the minutes):

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
  scenes (16 image tokens), completion `<answer>X</answer><|im_end|>`; {cfg["caption_fraction"]:.0%} of the
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


def evaluate_checkpoint(path: str, threads: int = 1) -> dict[str, float]:
    """Re-evaluate a saved checkpoint on the held-out items its card reports (same seed, count and size)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(threads)
    cfg = json.loads((Path(path) / "sft_report.json").read_text())["config"]
    heldout = make_vqa_items(cfg["eval_items"], seed=cfg["seed"] + 1, size=cfg["image_size"], split="heldout")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return evaluate(model, processor, heldout)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m mmrl.vlm.sft_shapes --help``)."""
    defaults = SFTConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for option in dataclasses.fields(SFTConfig):
        default = getattr(defaults, option.name)
        kind = int if option.name == "steps" else type(default)
        parser.add_argument(
            "--" + option.name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{option.metadata['help']} (default: {default})",
        )
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="re-evaluate the checkpoint in --out on its card's held-out items and exit",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.eval_only:
        accuracy = evaluate_checkpoint(args.out, args.threads)
        print(json.dumps(accuracy, indent=2))
        return
    cfg = SFTConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SFTConfig)})
    report = train(cfg)
    print(
        json.dumps(
            {"heldout_accuracy": report["heldout_accuracy"], "baselines": report["baselines"]}, indent=2
        )
    )


if __name__ == "__main__":
    main()
