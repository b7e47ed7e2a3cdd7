"""Pretrain the shapes world's tiny text-to-image flow model from random weights on a CPU (recipe
``flow_pretrain_shapes``).

    mmrl train configs/pretrain/shapes_flow.yaml                                  # the committed checkpoint
    mmrl train configs/pretrain/shapes_flow.yaml model.init=checkpoints/shapes_flow data.digits_share=0.5 \
        out=checkpoints/shapes_digits_flow                                        # add the digits world
    python -m mmrl.flow.pretrain_shapes --eval-only checkpoints/shapes_flow       # re-measure a checkpoint

The model is :func:`pipelines.flow.tiny.build_shapes_pipeline`: a pixel-space ``StableDiffusion3Pipeline``
(tiny ``SD3Transformer2DModel`` on 32x32 RGB, two tiny CLIP text encoders, a CLIP tokenizer trained on the
shapes prompts). Training is rectified-flow matching (SD3, arXiv 2403.03206, eq. 1 with logit-normal t):

    x_t = (1 - t) x0 + t eps,   t = sigmoid(n), n ~ N(0, 1),   loss = || v_theta(x_t, t | c) - (eps - x0) ||^2

on renders of the *train* prompts (``mmrl.data.shapes``), templates drawn in turn (single, count, pair,
relation) as the held-out evaluation draws them. With ``data.digits_share f`` a fraction ``f`` of each batch are
signs of the digits world's *train* numbers (``mmrl.data.digits``); ``model.init DIR`` continues from a saved
model instead of random weights, its tokenizers first extended with the digits world's words
(:func:`pipelines.flow.tiny.extend_shapes_vocabulary`) so the shapes prompts keep their tokens. The prompt is
replaced by "" with probability ``data.cond_dropout`` so the model also learns the unconditional velocity that
classifier-free guidance needs. Transformer and text encoders train jointly with AdamW (warm-up, then cosine to
``final_lr_fraction`` of the peak over ``trainer.steps``); an exponential moving average of the weights
(:class:`mmrl.ema.EMA` with warm-up) is what checkpoints (``step_N/model``) and the published model hold.

At the end the EMA model is sampled on held-out prompts with the ODE sampler and scored by the strict verifier
``rewards.build("shapes")`` (and, with digits, on held-out numbers by the ``ocr`` reward); it is published to
``out`` as a diffusers folder with ``config.yaml`` and a ``card.md`` of command, seed, wall time and scores.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import rewards
from mmrl.config import Config, Field, RunConfig, to_yaml
from mmrl.data import digits, shapes
from mmrl.data.prompts import check_prompts, load_prompts
from mmrl.ema import EMA
from mmrl.loop import run_recipe
from mmrl.run import launch_command
from mmrl.sections import SupervisedRecipeConfig, SupervisedSettings
from mmrl.supervised import MODEL_FOLDER, SupervisedTrainer
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.adapters.shapes import SHAPES_GUIDANCE_SCALE, SHAPES_NUM_STEPS, SHAPES_RESOLUTION
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.flow.tiny import build_shapes_pipeline, extend_shapes_vocabulary

__all__ = ["PretrainShapesConfig", "ShapesPretrainer", "main"]

logger = logging.getLogger(__name__)

KINDS = ("single", "count", "pair", "relation")
#: held-out digits evaluation: each held-out number this many times (one ODE sample each)
DIGITS_EVAL_REPEATS = 4


class ShapesFlowModel(Config):
    """The tiny pixel-space SD3 model: its size when built from random weights, or a saved one to continue."""

    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads of 32 dimensions each.")
    patch_size: int = Field(4, ge=1, description="Patch side in pixels (4: 64 image tokens at 32x32).")
    shift: float = Field(
        3.0,
        gt=0,
        description="The sampler's time shift t -> shift t / (1 + (shift - 1) t), saved in the scheduler (SD3's 3: "
        "more sampling steps at high noise, where the layout of the scene is decided).",
    )
    init: str | None = Field(
        None, description="Continue from this saved model (diffusers folder) instead of random weights."
    )


class ShapesFlowData(Config):
    """The training renders and the held-out evaluation."""

    train_prompts: str = Field(
        "shapes:train",
        description="Prompts rendered for training: the shapes world's train split, or a prompt file of "
        "shapes-world prompts (e.g. a few prompts of one kind, to measure what the model can learn of them).",
    )
    renders_per_kind: int = Field(
        4000, ge=1, description="Training images rendered per template kind before training (train prompts)."
    )
    cond_dropout: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Probability of training on the empty prompt (CFG's unconditional branch).",
    )
    digits_share: float = Field(
        0.0, ge=0, lt=1, description="Fraction of each batch drawn from the digits world (0: shapes only)."
    )
    eval_prompts: int = Field(
        200, ge=1, description="Held-out prompts sampled (the four templates in turn) for the score."
    )


class PretrainShapesSettings(SupervisedSettings):
    """Flow-matching defaults: cosine to 10% of the peak, no weight decay, an EMA of the weights."""

    steps: int = Field(13871, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Images per step.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")
    final_lr_fraction: float = Field(0.1, ge=0, le=1, description="Where the cosine ends, as a share of lr.")
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    ema_decay: float = Field(
        0.995,
        gt=0,
        lt=1,
        description="EMA decay of the saved weights (min(ema_decay, (1 + n) / (10 + n)) at update n).",
    )
    train_shift: float = Field(
        3.0,
        gt=0,
        description="The time shift applied to the logit-normal training times (measured: 3 scored 11.5% held-out "
        "where 1, SD3's unshifted logit-normal, scored 7.5%; the layout decided at high noise is the hard part).",
    )


class PretrainShapesConfig(SupervisedRecipeConfig):
    recipe: Literal["flow_pretrain_shapes"] = Field(
        "flow_pretrain_shapes", description="Which recipe this config runs."
    )
    run: RunConfig = Field(default_factory=lambda: RunConfig(name="pretrain_shapes", threads=1, log_every=25))
    model: ShapesFlowModel = Field(default_factory=ShapesFlowModel)
    data: ShapesFlowData = Field(default_factory=ShapesFlowData)
    trainer: PretrainShapesSettings = Field(default_factory=PretrainShapesSettings)


def render_pool(
    per_kind: int, seed: int, with_digits: bool = False, prompts: Sequence[str] | None = None
) -> dict[str, tuple[list[str], torch.Tensor]]:
    """``{kind: (prompts [N], images uint8 [N, 3, 32, 32])}`` rendered from ``prompts`` (default: the train
    split), for each template kind they hold.

    Each kind gets ``per_kind`` renders spread evenly over its prompts (few single-object prompts thus get
    many renders each, the many relation prompts few each), each render with its own scene seed. With
    ``with_digits`` the kind ``"digits"`` holds as many signs of the digits world's train numbers.
    """
    rng = np.random.default_rng(seed)
    prompts = shapes.train_prompts() if prompts is None else list(prompts)
    by_kind = {k: [p for p in prompts if shapes.prompt_kind(p) == k] for k in KINDS}
    by_kind = {k: kind_prompts for k, kind_prompts in by_kind.items() if kind_prompts}
    if with_digits:
        by_kind["digits"] = digits.train_prompts()
    pool = {}
    for k, kind_prompts in by_kind.items():
        chosen = [kind_prompts[i % len(kind_prompts)] for i in rng.permutation(per_kind)]
        seeds = rng.integers(0, 2**31, size=per_kind)
        render = digits.render_prompt if k == "digits" else shapes.render_prompt
        images = np.stack(
            [np.asarray(render(p, int(s), SHAPES_RESOLUTION)) for p, s in zip(chosen, seeds, strict=True)]
        )  # [N, H, W, 3]
        pool[k] = (chosen, torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
    return pool


@torch.no_grad()
def score_shapes(
    adapter: ShapesAdapter,
    prompts: Sequence[str],
    seed: int,
    guidance_scale: float = SHAPES_GUIDANCE_SCALE,
    num_steps: int = SHAPES_NUM_STEPS,
    batch_size: int = 100,
) -> dict[str, float]:
    """Strict verifier score of deterministic (ODE) samples, one per prompt, overall and per template kind."""
    reward = rewards.build("shapes")
    config = SamplingConfig(
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        sde_window=(0, 0),  # ODE sampling: the score of the model, not of exploration noise
        height=SHAPES_RESOLUTION,
        width=SHAPES_RESOLUTION,
    )
    generator = torch.Generator().manual_seed(seed)
    scores = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        images = rollout(adapter, chunk, 1, config, generator=generator).images
        scores.append(reward(images=images, prompts=chunk))
    score = torch.cat(scores)
    kinds = [shapes.prompt_kind(p) for p in prompts]
    out = {"strict": float(score.mean())}
    for k in KINDS:
        rows = [i for i, kind in enumerate(kinds) if kind == k]
        if rows:
            out[k] = float(score[rows].mean())
    return out


@torch.no_grad()
def evaluate_digits(
    adapter: ShapesAdapter,
    seed: int,
    guidance_scale: float = 1.0,
    num_steps: int = SHAPES_NUM_STEPS,
) -> dict[str, float]:
    """OCR score (``rewards.build("ocr", mode="recognize")``: 1 - normalised edit distance) and exact-read rate of
    deterministic (ODE) samples of the digits world's held-out numbers, each :data:`DIGITS_EVAL_REPEATS` times."""
    reward = rewards.build("ocr", mode="recognize")
    prompts = digits.heldout_prompts() * DIGITS_EVAL_REPEATS
    config = SamplingConfig(
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        sde_window=(0, 0),
        height=SHAPES_RESOLUTION,
        width=SHAPES_RESOLUTION,
    )
    images = rollout(adapter, prompts, 1, config, generator=torch.Generator().manual_seed(seed)).images
    out = reward.score(images=images, prompts=prompts)
    return {"ocr": float(out.scores.mean()), "exact": float(out.components["exact"].mean())}


def reads_digits(adapter: ShapesAdapter) -> bool:
    """Whether the model's tokenizer has the digits world's tokens (a checkpoint trained with ``data.digits_share``)."""
    return "4</w>" in adapter.pipe.tokenizer.get_vocab()


def evaluate_all(adapter: ShapesAdapter, eval_prompts: int, seed: int) -> dict[str, float]:
    """The card's scores: shapes strict with CFG (``strict`` and per template), and for a digits model also
    shapes strict without CFG (``strict_cfg1``) and the held-out OCR score with and without CFG."""
    scores = score_shapes(adapter, heldout_eval_prompts(eval_prompts, seed), seed)
    if reads_digits(adapter):
        scores["strict_cfg1"] = score_shapes(adapter, heldout_eval_prompts(eval_prompts, seed), seed, 1.0)[
            "strict"
        ]
        for guidance in (1.0, SHAPES_GUIDANCE_SCALE):
            for name, value in evaluate_digits(adapter, seed, guidance).items():
                scores[f"digits_{name}_cfg{guidance:g}"] = value
    return scores


def heldout_eval_prompts(n: int, seed: int) -> list[str]:
    """The evaluation prompt list: ``n`` held-out prompts, the four templates in turn."""
    return shapes.sample_prompts(n, seed, "heldout")


class ShapesPretrainer(SupervisedTrainer):
    """Flow-matching pretraining of the tiny shapes model (see the module docstring)."""

    cfg: PretrainShapesConfig
    show = ("loss", "eval/strict")

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.setup_runtime()
        self.start = time.monotonic()
        self.pipe = self.build_pipeline(self.resuming_from())
        self.modules = torch.nn.ModuleList(
            [self.pipe.transformer, self.pipe.text_encoder, self.pipe.text_encoder_2]
        )
        self.params = list(self.modules.parameters())
        self.modules.train()
        self.ema = EMA(self.modules, cfg.trainer.ema_decay)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, foreach=True
        )
        began = time.monotonic()
        try:
            prompts = load_prompts(cfg.data.train_prompts)
            check_prompts(cfg.data.train_prompts, prompts, [rewards.build("shapes")])
        except ValueError as err:
            raise ValueError(f"data.train_prompts: {err}") from None
        self.pool = render_pool(
            cfg.data.renders_per_kind, cfg.run.seed, with_digits=cfg.data.digits_share > 0, prompts=prompts
        )
        self.shape_kinds = tuple(kind for kind in KINDS if kind in self.pool)  # the kinds the prompts hold
        logger.info(
            "rendered %d training images in %.1fs",
            cfg.data.renders_per_kind * len(self.pool),
            time.monotonic() - began,
        )
        self.train_seconds = 0.0
        self.resume()

    def build_pipeline(self, resuming: Path | None) -> Any:
        """Random weights and a tokenizer trained on the prompt vocabulary; or ``model.init``, whose tokenizers
        learn the digits world's words; or, on resume, the checkpoint's model (its tokenizers; the weights then
        come from its state)."""
        cfg = self.cfg
        if resuming is not None:
            return ShapesAdapter.from_pretrained(str(resuming / MODEL_FOLDER)).pipe
        if cfg.model.init is not None:
            pipe = ShapesAdapter.from_pretrained(cfg.model.init).pipe
            if cfg.data.digits_share > 0 and not reads_digits(ShapesAdapter(pipe)):
                added = extend_shapes_vocabulary(
                    pipe, digits.all_prompts(), shapes.all_prompts(), cfg.run.seed
                )
                logger.info("added %d tokens to the tokenizers of %s", len(added), cfg.model.init)
            return pipe
        corpus = shapes.all_prompts() + (digits.all_prompts() if cfg.data.digits_share > 0 else [])
        return build_shapes_pipeline(
            corpus,
            cfg.model.num_layers,
            cfg.model.num_attention_heads,
            patch_size=cfg.model.patch_size,
            shift=cfg.model.shift,
        )

    # ------------------------------------------------------------------ one step
    def batch(self) -> tuple[list[str], torch.Tensor]:
        """``batch_size`` (prompt, image in [-1, 1]) pairs: the first ``round(digits_share x batch_size)`` signs,
        the others shapes with the template kinds of the training prompts in turn."""
        batch_size, data = self.cfg.trainer.batch_size, self.cfg.data
        prompts, images = [], []
        num_digits = round(data.digits_share * batch_size)
        for i in range(batch_size):
            kinds = self.shape_kinds
            shape_kind = kinds[(self.step * (batch_size - num_digits) + i - num_digits) % len(kinds)]
            kind_prompts, kind_images = self.pool["digits" if i < num_digits else shape_kind]
            j = int(torch.randint(len(kind_prompts), (1,), generator=self.generator))
            prompts.append(kind_prompts[j])
            images.append(kind_images[j])
        x0 = torch.stack(images).float() / 127.5 - 1
        drop = torch.rand(batch_size, generator=self.generator) < data.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        return prompts, x0

    def train_step(self) -> dict[str, float]:
        trainer = self.cfg.trainer
        began = time.monotonic()
        # 1. data and noise
        prompts, x0 = self.batch()  # x0: [B, 3, 32, 32]
        eps = torch.randn(x0.shape, generator=self.generator)
        u = torch.sigmoid(torch.randn(trainer.batch_size, generator=self.generator))  # logit-normal(0, 1)
        t = trainer.train_shift * u / (1 + (trainer.train_shift - 1) * u)
        t_ = t.view(-1, 1, 1, 1)
        x_t = (1 - t_) * x0 + t_ * eps
        # 2. text through the pipeline's own encoder code (the path sampling uses), with gradients
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            device="cpu",
            max_sequence_length=0,
        )
        # 3. velocity loss
        velocity = self.pipe.transformer(
            hidden_states=x_t,
            timestep=t * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(velocity, eps - x0)
        # 4. update and EMA
        loss.backward()
        lr = trainer.lr_at(self.step)
        self.optimizer_step(self.optimizer, self.params, trainer.max_grad_norm, lr=lr)
        self.ema.update(num_updates=self.step)
        self.train_seconds += time.monotonic() - began
        self.metrics.add("loss", loss.detach())
        self.metrics.add("train/lr", lr)
        return self.metrics.reduce()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The EMA model's held-out scores (:func:`evaluate_all`) every ``trainer.eval_every`` steps and at the end
        (not of the random start)."""
        every, last = self.cfg.trainer.eval_every, self.step == self.cfg.trainer.steps
        if self.step == 0 or not (last or (every and self.step % every == 0)):
            return {}
        self.modules.eval()
        with self.ema.swapped():
            scores = evaluate_all(ShapesAdapter(self.pipe), self.cfg.data.eval_prompts, self.cfg.run.seed)
        self.modules.train()
        if last:
            self.final = scores
        return {f"eval/{name}": value for name, value in scores.items()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.base_state(),
            "modules": self.modules.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "train_seconds": self.train_seconds,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_base_state(state)
        self.modules.load_state_dict(state["modules"])
        self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_seconds = float(state["train_seconds"])

    def save_model(self, directory: Path) -> None:
        """The EMA weights as a diffusers folder (``StableDiffusion3Pipeline.from_pretrained`` loads it)."""
        with self.ema.swapped():
            self.pipe.save_pretrained(directory)

    def write_release(self, directory: Path) -> None:
        self.save_model(directory)
        (directory / "config.yaml").write_text(to_yaml(self.cfg))
        write_card(
            directory,
            self.cfg,
            launch_command(),
            self.step,
            self.train_seconds / 60,
            time.monotonic() - self.start,
            self.final,
        )


def write_card(
    directory: Path,
    cfg: PretrainShapesConfig,
    command: str,
    steps: int,
    train_minutes: float,
    wall_s: float,
    scores: dict[str, float],
) -> None:
    """``card.md``: what the model is, how it was made, and its measured held-out scores."""
    size_mb = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 1e6
    params = sum(p.numel() for p in ShapesAdapter.from_pretrained(str(directory)).transformer.parameters())
    per_kind = "\n".join(f"| {k} | {scores[k]:.3f} |" for k in KINDS if k in scores)
    if cfg.data.digits_share > 0:
        start = f"`{cfg.model.init}`" if cfg.model.init else "random weights"
        title, vocabulary = "shapes and digits worlds", "shapes and digits"
        origin = (
            f"Trained from {start} by flow matching on renders of the shapes world's *train* prompts and, for "
            f"{cfg.data.digits_share:.0%} of each batch, signs of the digits world's *train* numbers"
        )
    else:
        title, vocabulary = "shapes world", "shapes"
        origin = (
            "Pretrained from random weights by flow matching on renders of the shapes world's *train* prompts"
        )
    digits_section = ""
    if "digits_ocr_cfg1" in scores:
        digits_section = f"""
Shapes strict score without CFG (guidance 1, the RL demos' sampler), same prompts and noise:
{scores["strict_cfg1"]:.3f}.

Digits world: the `ocr` reward (`rewards.build("ocr", mode="recognize")`, PP-OCRv4 recognition; 1 - normalised
edit distance to the quoted number) on the {len(digits.heldout_prompts())} held-out numbers (never rendered in
training) x {DIGITS_EVAL_REPEATS}, one ODE sample each, same noise seed:

| guidance | OCR score | exact reads |
|---|---|---|
| 1.0 | {scores["digits_ocr_cfg1"]:.3f} | {scores["digits_exact_cfg1"]:.3f} |
| {SHAPES_GUIDANCE_SCALE} | {scores[f"digits_ocr_cfg{SHAPES_GUIDANCE_SCALE:g}"]:.3f} | {scores[f"digits_exact_cfg{SHAPES_GUIDANCE_SCALE:g}"]:.3f} |
"""
    text = f"""# {Path(cfg.out or "model").name}: tiny pixel-space SD3 text-to-image model of the {title}

{origin}
(`mmrl/flow/pretrain_shapes.py`). Loads with
`StableDiffusion3Pipeline.from_pretrained(DIR, vae=None, text_encoder_3=None, tokenizer_3=None)` or
`pipelines.flow.adapters.ShapesAdapter.from_pretrained` (the path RL uses).

- architecture: `SD3Transformer2DModel` ({params / 1e6:.2f} M parameters, width {cfg.model.num_attention_heads * 32}, {cfg.model.num_layers} layers, patch {cfg.model.patch_size}, RGB 32x32, no VAE), two
  `CLIPTextModelWithProjection` encoders, CLIP tokenizer trained on the {vocabulary} prompts, no T5
- command: `{command}`
- seed: {cfg.run.seed}
- training: {steps} steps of batch {cfg.trainer.batch_size}, {train_minutes:.1f} min; AdamW lr {cfg.trainer.lr}, EMA {cfg.trainer.ema_decay},
  prompt dropout {cfg.data.cond_dropout}, {torch.get_num_threads()} CPU threads
- wall time (model setup, rendering, training, saving, evaluation; Python imports excluded): {wall_s / 60:.1f} min
- size on disk: {size_mb:.1f} MB

## Held-out score

Strict shapes verifier (`rewards.build("shapes")`, 1 only if object, count, colour and position are all right)
on {cfg.data.eval_prompts} held-out prompts (`mmrl.data.shapes.sample_prompts({cfg.data.eval_prompts}, {cfg.run.seed}, "heldout")`, the four
templates in turn), one ODE sample each ({SHAPES_NUM_STEPS} Euler steps, guidance scale {SHAPES_GUIDANCE_SCALE},
initial noise from `torch.Generator().manual_seed({cfg.run.seed})`).

| prompts | strict score |
|---|---|
| all | {scores["strict"]:.3f} |
{per_kind}
{digits_section}
Reproduce the score: `python -m mmrl.flow.pretrain_shapes --eval-only {cfg.out} --seed {cfg.run.seed} --eval-prompts {cfg.data.eval_prompts}`

Full config: `config.yaml` beside this card (`mmrl train` it to repeat the run).
"""
    (directory / "card.md").write_text(text)


def main(cfg: PretrainShapesConfig) -> dict[str, float]:
    """Train end to end (``mmrl train``); returns the final metrics."""
    return run_recipe(cfg, ShapesPretrainer)


def _cli(argv: Sequence[str] | None = None) -> dict[str, float]:
    """``python -m mmrl.flow.pretrain_shapes --eval-only DIR``: the card's scores of a saved model (training is
    ``mmrl train configs/pretrain/shapes_flow.yaml``)."""
    parser = argparse.ArgumentParser(prog="python -m mmrl.flow.pretrain_shapes", description=_cli.__doc__)
    parser.add_argument("--eval-only", metavar="DIR", required=True, help="the saved model to evaluate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the initial noise")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    scores = evaluate_all(ShapesAdapter.from_pretrained(args.eval_only), args.eval_prompts, args.seed)
    print(json.dumps(scores))
    return scores


if __name__ == "__main__":
    _cli()
