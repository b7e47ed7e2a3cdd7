"""What the VLM SFT recipes share: the batch layout, dense vision pretraining, the tiny model's config section
and :class:`VLMSFTTrainer`, the supervised loop on :class:`mmrl.supervised.SupervisedTrainer`.

A recipe (``sft_shapes``, ``sft_reason``) subclasses the trainer with its data, tokenizer corpus, batch sampling,
evaluation, report and card; the loop, schedule, seeding, checkpoints, resume and the published model folder are
written here once.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from mmrl.config import Config, Field, to_yaml
from mmrl.data.shapes import COLOURS, SHAPES, Scene
from mmrl.data.shapes_math import describe_scene
from mmrl.run import launch_command
from mmrl.sections import SupervisedSettings
from mmrl.supervised import MODEL_FOLDER, SupervisedTrainer
from pipelines.vlm.families.qwen2_5_vl import mm_token_type_ids
from pipelines.vlm.inputs import VLMPrompt, prepare_prompts
from pipelines.vlm.tiny import TinyVLMConfig, build_model, build_processor, train_tokenizer

__all__ = [
    "CAPTION_QUESTION",
    "CompletionBatcher",
    "TinyVLMSection",
    "VLMSFTSettings",
    "VLMSFTTrainer",
    "VisionLabels",
    "caption",
    "centre_labels",
    "flat_settings",
    "merged_image_tokens",
    "pretrain_vision",
    "rescore_main",
    "sft_batch",
    "token_labels",
    "vision_pretraining_line",
]

logger = logging.getLogger(__name__)

#: The auxiliary captioning task: a scene's objects left to right. A caption carries one colour and one shape
#: token per object, several times the visual signal of a one-word VQA answer, on a shorter prompt, so it
#: teaches the vision tower colours, shapes, counts and order faster than VQA alone.
CAPTION_QUESTION = "list the objects from left to right."


class SceneItem(Protocol):
    """A training item of the shapes world: a rendered scene and its image."""

    scene: Scene
    image: Any


def caption(item: SceneItem) -> str:
    """``"red triangle, green circle"``: the scene's objects sorted by their centre's x."""
    return describe_scene(item.scene)


class CompletionBatcher(ABC):
    """Right-padded training batches of ``(prompt, completion)`` pairs on the items' scenes (:func:`sft_batch`):
    prompt ids cached per question text (every scene has the same size, hence the same image-token count),
    completion ids (plus ``<|im_end|>``) per completion text. A batch is all captioning (:data:`CAPTION_QUESTION`
    -> ``<answer>red circle, blue square</answer>``) or all the task: caption prompts are shorter, which padding
    to a mixed batch would waste.

    Subclasses implement :meth:`task_texts`, the question and completion of an item's task.
    """

    def __init__(self, processor: Any, items: Sequence[SceneItem]) -> None:
        self.processor = processor
        self.items = items
        self.pad_id = processor.tokenizer.pad_token_id
        self.end_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._prompt_ids: dict[str, list[int]] = {}
        self._completion_ids: dict[str, list[int]] = {}

    @abstractmethod
    def task_texts(self, index: int) -> tuple[str, str]:
        """``(question, completion)`` of item ``index``'s task."""

    def _ids(self, index: int, as_caption: bool) -> tuple[list[int], list[int]]:
        item = self.items[index]
        if as_caption:
            question, completion = CAPTION_QUESTION, f"<answer>{caption(item)}</answer>"
        else:
            question, completion = self.task_texts(index)
        if question not in self._prompt_ids:
            prompt = VLMPrompt.from_question(question, [item.image])
            self._prompt_ids[question] = prepare_prompts(self.processor, [prompt])[0][0].input_ids
        if completion not in self._completion_ids:
            ids = self.processor.tokenizer(completion, add_special_tokens=False)["input_ids"]
            self._completion_ids[completion] = [*ids, self.end_id]
        return self._prompt_ids[question], self._completion_ids[completion]

    def batch(self, indices: Sequence[int], as_caption: bool) -> dict[str, torch.Tensor]:
        """Model inputs of items ``indices``: their captions when ``as_caption``, else their task."""
        rows = [self._ids(i, as_caption) for i in indices]
        return sft_batch(self.processor, rows, [self.items[i].image for i in indices], self.pad_id)


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


def centre_labels(scene: Scene, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([grid*grid] colour index, [grid*grid] shape index)`` of the image tokens of ``scene``, row-major: the
    object whose centre lies in the token's cell, or the background class where none does.

    Every object marks exactly one token, so the objects of a colour are the tokens that carry it: an
    object-centric reading from which a count is a sum over tokens (:func:`token_labels` marks every token an
    object covers, one to four per object at 16 pixels a token). Scenes keep their objects' boxes a gap apart, so
    two centres never share a cell while a cell is no wider than the smallest object plus the gap; a cell that
    holds two anyway takes the later object's labels.
    """
    cell = scene.size / grid
    colours = torch.full((grid, grid), len(COLOURS))
    shapes = torch.full((grid, grid), len(SHAPES))
    for o in scene.objects:
        gx, gy = min(int(o.x / cell), grid - 1), min(int(o.y / cell), grid - 1)
        colours[gy, gx], shapes[gy, gx] = COLOURS.index(o.colour), SHAPES.index(o.shape)
    return colours.flatten(), shapes.flatten()


#: Which per-token labels dense vision pretraining teaches: ``cover`` (:func:`token_labels`) alone, or with a
#: second head on the same tokens, ``centre`` (:func:`centre_labels`).
VisionLabels = Literal["cover", "cover_and_centre"]


def merged_image_tokens(visual: torch.nn.Module, processor: Any, images: Sequence[Any]) -> torch.Tensor:
    """``[B, tokens, hidden]`` merged image tokens of same-size ``images``: what the vision tower and its merger
    hand the language model in place of each image's ``<|image_pad|>`` tokens."""
    vision = processor.image_processor(images=list(images), return_tensors="pt")
    tokens = visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
    return tokens.view(len(images), -1, tokens.shape[-1])


def pretrain_vision(
    model: torch.nn.Module,
    processor: Any,
    train_items: Sequence[SceneItem],
    heldout: Sequence[SceneItem],
    *,
    image_size: int,
    steps: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    labels: VisionLabels = "cover",
) -> dict[str, float]:
    """Dense vision pretraining (``steps`` AdamW steps at a constant ``lr``): the vision tower and its merger learn, through
    a linear head on each merged image token, the colour and shape of what covers the token (:func:`token_labels`),
    and with ``labels="cover_and_centre"`` through a second head the colour and shape of the object centred in it
    (:func:`centre_labels`); the loss is the sum of the heads' cross-entropies.

    The tiny VLM learns shapes through the language model only slowly (a caption's loss reaches the vision tower
    through the whole decoder); a direct per-token objective teaches them in about a minute. The heads are
    discarded.

    Returns:
        Held-out accuracy of the cover head's colour and shape on the tokens an object covers (``colour``,
        ``shape``); with the centre head, its accuracy on every token (``centre``: colour and shape both right,
        background included) and on the tokens holding a centre (``centre_objects``).
    """
    visual = model.model.visual
    grid = image_size // (processor.image_processor.patch_size * processor.image_processor.merge_size)
    width = model.config.text_config.hidden_size
    n_colours, n_shapes = len(COLOURS) + 1, len(SHAPES) + 1
    label_fns = [token_labels] + ([centre_labels] if labels == "cover_and_centre" else [])
    head = torch.nn.Linear(width, len(label_fns) * (n_colours + n_shapes))
    optimizer = torch.optim.AdamW([*visual.parameters(), *head.parameters()], lr=lr)

    def logits(items: Sequence[SceneItem]) -> torch.Tensor:
        """``[B, grid*grid, heads, n_colours + n_shapes]``."""
        tokens = merged_image_tokens(visual, processor, [item.image for item in items])
        return head(tokens).unflatten(-1, (len(label_fns), -1))

    def targets(items: Sequence[SceneItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, grid*grid, heads] colour, [B, grid*grid, heads] shape)``."""
        per_head = [[fn(item.scene, grid) for fn in label_fns] for item in items]
        colours = torch.stack([torch.stack([c for c, _ in pairs], -1) for pairs in per_head])
        shapes = torch.stack([torch.stack([s for _, s in pairs], -1) for pairs in per_head])
        return colours, shapes

    for _ in range(steps):
        batch = [train_items[i] for i in torch.randint(len(train_items), (batch_size,), generator=generator)]
        out = logits(batch)
        colours, shapes = targets(batch)
        loss = torch.nn.functional.cross_entropy(
            out[..., :n_colours].flatten(0, 2), colours.flatten()
        ) + torch.nn.functional.cross_entropy(out[..., n_colours:].flatten(0, 2), shapes.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the SFT steps start from no gradients
    with torch.no_grad():
        out = logits(heldout)
        colours, shapes = targets(heldout)
    colour_right = out[..., :n_colours].argmax(-1) == colours  # [B, grid*grid, heads]
    shape_right = out[..., n_colours:].argmax(-1) == shapes
    covered = shapes[..., 0] < len(SHAPES)
    accuracy = {
        "colour": float(colour_right[..., 0][covered].float().mean()),
        "shape": float(shape_right[..., 0][covered].float().mean()),
        "loss": loss.item() if steps else float("nan"),
    }
    if labels == "cover_and_centre":
        both = colour_right[..., 1] & shape_right[..., 1]
        accuracy["centre"] = float(both.float().mean())
        accuracy["centre_objects"] = float(both[shapes[..., 1] < len(SHAPES)].float().mean())
    return accuracy


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


def flat_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A recipe config's settings by field name, its sections merged (``{"run": {"seed": 0}, "out": X}`` ->
    ``{"seed": 0, "out": X}``): what a card reads, from a report of this recipe or of the script before it,
    which stored them flat."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def vision_pretraining_line(report: dict[str, Any], steps: int) -> str:
    """A card's line on the vision tower's pretraining (:func:`pretrain_vision`, ``steps`` steps) and its held-out
    token accuracies; ``""`` for a run that skipped it (``vision_pretrain_steps: 0``)."""
    vision = report.get("vision_pretraining")
    if not vision:
        return ""
    return (
        f"- vision pretraining first: {steps} steps of per-image-token colour and shape classification "
        f"(`mmrl.vlm.sft.pretrain_vision`), held-out token accuracy colour {vision['colour']:.1%}, shape "
        f"{vision['shape']:.1%}"
    )


def rescore_main(prog: str, rescore: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
    """``python -m PROG --eval-only --out DIR``: print ``rescore(DIR, settings)``, the held-out scores of a model
    the recipe published, ``settings`` being its ``sft_report.json`` config (:func:`flat_settings`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Re-score a published model on the held-out items its card reports."
    )
    parser.add_argument("--eval-only", action="store_true", required=True, help="re-score the model in --out")
    parser.add_argument("--out", required=True, help="a folder the recipe published (with sft_report.json)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: the training run's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = flat_settings(json.loads((Path(args.out) / "sft_report.json").read_text())["config"])
    torch.set_num_threads(args.threads or settings.get("threads") or 1)
    print(json.dumps(rescore(args.out, settings), indent=2))


class TinyVLMSection(Config):
    """Sizes of the tiny Qwen2.5-VL built from random weights (:class:`pipelines.vlm.tiny.TinyVLMConfig`)."""

    image_size: int = Field(
        TinyVLMConfig.image_size, ge=8, description="Scene side in pixels (64: 16 image tokens at patch 8)."
    )
    hidden_size: int = Field(TinyVLMConfig.hidden_size, ge=8, description="Language-model width.")
    num_layers: int = Field(TinyVLMConfig.num_layers, ge=1, description="Language-model decoder layers.")
    intermediate_size: int = Field(
        TinyVLMConfig.intermediate_size, ge=1, description="Language-model MLP width."
    )
    vision_depth: int = Field(TinyVLMConfig.vision_depth, ge=1, description="Vision-tower blocks.")
    vision_hidden_size: int = Field(
        TinyVLMConfig.vision_hidden_size, ge=8, description="Vision-tower width (its MLP is twice as wide)."
    )
    vision_heads: int = Field(TinyVLMConfig.vision_heads, ge=1, description="Vision-tower attention heads.")
    patch_size: int = Field(
        TinyVLMConfig.patch_size,
        ge=1,
        description="Vision patch side in pixels (image tokens = (image_size / patch / 2)^2).",
    )

    def tiny_vlm(self, seed: int) -> TinyVLMConfig:
        """The builder's config, initialised from ``seed``."""
        return TinyVLMConfig(
            **self.model_dump(), vision_intermediate_size=2 * self.vision_hidden_size, seed=seed
        )


class VLMSFTSettings(SupervisedSettings):
    """The supervised settings plus the two stages special to the tiny VLM: dense vision pretraining first, and
    a share of captioning batches."""

    vision_pretrain_steps: int = Field(
        0,
        ge=0,
        description="Steps of dense vision pretraining before SFT: the vision tower and merger learn, through a "
        "linear head on each image token, the colour and shape of the object covering it (or background), as "
        "real VLMs start from a pretrained vision encoder. 0: none.",
    )
    vision_pretrain_lr: float = Field(3e-3, gt=0, description="Learning rate (AdamW, constant) of it.")
    vision_labels: VisionLabels = Field(
        "cover",
        description="What the dense vision pretraining labels each image token with. cover: the colour and shape "
        "of the object covering the token (one to four tokens per object). cover_and_centre: also, through a "
        "second head, those of the object whose centre lies in the token (exactly one token per object, an "
        "object-centric reading from which counting is a sum over tokens).",
    )
    caption_fraction: float = Field(
        0.6,
        ge=0,
        le=1,
        description="Share of training batches that are the captioning task instead of the task.",
    )
    caption_pretrain_steps: int = Field(
        0,
        ge=0,
        description="The first this many SFT steps are all the captioning task (then caption_fraction applies): "
        "the language model learns to read the scene's objects before it learns the task, as a real VLM's "
        "alignment stage precedes its instruction tuning. Counted in trainer.steps. 0: none.",
    )


class VLMSFTTrainer(SupervisedTrainer):
    """Supervised fine-tuning of the tiny VLM from random weights, with the loss on the completion only.

    ``setup``: data (:meth:`build_data`), a tokenizer trained on :meth:`corpus` (on resume: the checkpoint's),
    the random model, vision pretraining, AdamW. ``train_step``: :meth:`sample_indices`, then a batch that is the
    captioning task for the first ``trainer.caption_pretrain_steps`` steps and then with probability
    ``trainer.caption_fraction``, one clipped AdamW step at
    ``trainer.lr_at(step)``. Checkpoints hold the state and the model as a ``save_pretrained`` folder
    (``step_N/model``); at the end the model, its ``config.yaml``, ``sft_report.json`` and ``card.md`` are
    published to ``out`` (:class:`mmrl.supervised.SupervisedTrainer`).

    Subclasses implement :meth:`build_data`, :meth:`corpus`, :meth:`make_batcher`, :meth:`sample_indices`,
    :meth:`evaluate` (setting :attr:`final` at the last step), :meth:`report` and :meth:`render_card`.
    """

    show = ("loss",)

    # ------------------------------------------------------------------ recipe hooks
    @abstractmethod
    def build_data(self) -> None:
        """Set ``self.train_items`` and the held-out items."""

    @abstractmethod
    def corpus(self) -> list[str]:
        """Text the tokenizer is trained on."""

    @abstractmethod
    def make_batcher(self) -> Any:
        """An object with ``batch(indices, as_caption) -> model inputs`` (see :func:`sft_batch`)."""

    @abstractmethod
    def sample_indices(self) -> list[int]:
        """Training items of this step, drawn from ``self.generator``."""

    @abstractmethod
    def report(self) -> dict[str, Any]:
        """The numbers of ``sft_report.json`` (the card is rendered from them)."""

    @abstractmethod
    def render_card(self, report: dict[str, Any]) -> str:
        """``card.md``."""

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg, trainer = self.cfg, self.cfg.trainer
        self.setup_runtime()
        self.start = time.monotonic()
        self.build_data()
        model_config = cfg.model.tiny_vlm(seed=cfg.run.seed)
        resuming = self.resuming_from()
        if resuming is not None:  # the tokenizer the checkpoint's weights were trained with
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(resuming / MODEL_FOLDER)
        else:
            tokenizer = train_tokenizer(self.corpus(), vocab_size=model_config.vocab_size)
            self.processor = build_processor(tokenizer, model_config)
        self.model = build_model(self.processor.tokenizer, model_config).train()
        self.batcher = self.make_batcher()
        self.vision: dict[str, float] | None = None
        if trainer.vision_pretrain_steps and resuming is None:
            self.vision = pretrain_vision(
                self.model,
                self.processor,
                self.train_items,
                self.vision_heldout(),
                image_size=cfg.model.image_size,
                steps=trainer.vision_pretrain_steps,
                lr=trainer.vision_pretrain_lr,
                batch_size=trainer.batch_size,
                generator=self.generator,
                labels=trainer.vision_labels,
            )
            logger.info(
                "vision pretraining: held-out token colour %.3f, shape %.3f (%.0fs)",
                self.vision["colour"],
                self.vision["shape"],
                time.monotonic() - self.start,
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=trainer.lr, weight_decay=trainer.weight_decay
        )
        self.losses: list[float] = []
        self.curve: list[dict[str, Any]] = []
        self.train_seconds = 0.0
        self.resume()

    def vision_heldout(self) -> Sequence[SceneItem]:
        """Held-out items vision pretraining reports its token accuracy on."""
        return self.heldout

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        trainer = self.cfg.trainer
        began = time.monotonic()
        indices = self.sample_indices()
        lr = trainer.lr_at(self.step)
        # drawn every step, so the generator's stream does not depend on the captioning stage
        draw = torch.rand((), generator=self.generator)
        as_caption = self.step < trainer.caption_pretrain_steps or bool(draw < trainer.caption_fraction)
        loss = self.model(**self.batcher.batch(indices, as_caption)).loss
        loss.backward()
        self.optimizer_step(self.optimizer, list(self.model.parameters()), trainer.max_grad_norm, lr=lr)
        self.losses.append(loss.item())
        self.train_seconds += time.monotonic() - began
        self.metrics.add("loss", self.losses[-1])
        self.metrics.add("train/lr", lr)
        self.metrics.add("train/caption_batch", float(as_caption))
        return self.metrics.reduce()

    def curve_due(self) -> bool:
        """Whether this step scores a learning-curve point (every ``trainer.eval_every`` steps)."""
        every = self.cfg.trainer.eval_every
        return bool(every) and self.step > 0 and self.step % every == 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.base_state(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "losses": self.losses,
            "curve": self.curve,
            "vision": self.vision,
            "train_seconds": self.train_seconds,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_base_state(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.losses, self.curve = list(state["losses"]), list(state["curve"])
        self.vision, self.train_seconds = state["vision"], float(state["train_seconds"])

    def save_model(self, directory: Path) -> None:
        """Model and processor as ``save_pretrained`` folders (loadable by transformers' Auto classes)."""
        self.model.save_pretrained(directory)
        self.processor.save_pretrained(directory)

    def write_release(self, directory: Path) -> None:
        self.model.eval()
        self.save_model(directory)
        report = {
            **self.report(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "steps": self.step,
            "final_loss": sum(self.losses[-100:]) / max(len(self.losses[-100:]), 1),
            "train_seconds": self.train_seconds,
            "wall_seconds": time.monotonic() - self.start,
            "vision_pretraining": self.vision,
            "curve": self.curve,
            "command": launch_command(),
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}, "
            f"torch.set_num_threads({torch.get_num_threads()})",
            "config": self.cfg.model_dump(mode="json"),
        }
        (directory / "config.yaml").write_text(to_yaml(self.cfg))
        (directory / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
        (directory / "card.md").write_text(self.render_card(report))
