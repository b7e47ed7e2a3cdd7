"""Pretrain the shapes world's tiny text-to-image flow model from random weights on a CPU (issue 3, part 4).

    python -m mmrl.flow.pretrain_shapes --out checkpoints/shapes_flow --minutes 15 --seed 0
    python -m mmrl.flow.pretrain_shapes --eval-only checkpoints/shapes_flow      # re-measure a checkpoint
    python -m mmrl.flow.pretrain_shapes --init checkpoints/shapes_flow --digits-share 0.5 \
        --out checkpoints/shapes_digits_flow --minutes 10                       # add the digits world

The model is :func:`pipelines.flow.tiny.build_shapes_pipeline`: a pixel-space ``StableDiffusion3Pipeline``
(tiny ``SD3Transformer2DModel`` on 32x32 RGB, two tiny CLIP text encoders, a CLIP tokenizer trained on the
shapes prompts). Training is rectified-flow matching (SD3, arXiv 2403.03206, eq. 1 with logit-normal t):

    x_t = (1 - t) x0 + t eps,   t = sigmoid(n), n ~ N(0, 1),   loss = || v_theta(x_t, t | c) - (eps - x0) ||^2

on renders of the *train* prompts (``mmrl.data.shapes``), templates drawn in turn (single, count, pair,
relation) as the held-out evaluation draws them. With ``--digits-share f`` a fraction ``f`` of each batch are
signs of the digits world's *train* numbers (``mmrl.data.digits``); ``--init DIR`` continues from a saved
model instead of random weights, its tokenizers first extended with the digits world's words
(:func:`pipelines.flow.tiny.extend_shapes_vocabulary`) so the shapes prompts keep their tokens. The prompt is replaced by "" with probability
``cond_dropout`` so the model also learns the unconditional velocity that classifier-free guidance needs.
Transformer and text encoders train jointly with AdamW; an exponential moving average of the weights is what
gets saved. Training stops at the time budget (``--minutes``, minus a reserve for evaluation) or at
``--max-steps``; with a time budget the number of steps depends on the machine, and the card records it (rerun
with ``--max-steps N`` to repeat exactly).

At the end the EMA model is saved as a diffusers directory, loaded back through
:class:`pipelines.flow.adapters.ShapesAdapter` (the path RL uses), sampled on held-out prompts with the ODE
sampler and scored by the strict verifier ``rewards.build("shapes")`` (and, with digits, on held-out numbers by
the ``ocr`` reward); ``card.md`` records command, seed, wall time and scores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import rewards
from mmrl.data import digits, shapes
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.adapters.shapes import SHAPES_GUIDANCE_SCALE, SHAPES_NUM_STEPS, SHAPES_RESOLUTION
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.flow.tiny import build_shapes_pipeline, extend_shapes_vocabulary

logger = logging.getLogger(__name__)

KINDS = ("single", "count", "pair", "relation")
#: held-out digits evaluation: each held-out number this many times (one ODE sample each)
DIGITS_EVAL_REPEATS = 4


@dataclass
class PretrainConfig:
    """Settings of the shapes pretraining run.

    Attributes:
        out: checkpoint directory (diffusers layout + ``card.md`` + ``metrics.jsonl``).
        minutes: wall-time budget of the whole command (data, training, evaluation, saving).
        seed: seeds weights, data renders, batch order and the evaluation noise.
        max_steps: stop after this many optimizer steps (exact replay); ``None`` = until the time budget.
        batch_size: images per step.
        lr: AdamW peak learning rate; linear warmup over ``warmup_steps`` then cosine decay to 10% over the run.
        warmup_steps: learning-rate warmup.
        ema_decay: EMA decay of the saved weights (``min(ema_decay, (1 + n) / (10 + n))`` at step ``n``).
        cond_dropout: probability of training on the empty prompt (CFG's unconditional branch).
        renders_per_kind: training images rendered per template kind before training (drawn from train prompts).
        eval_prompts: held-out prompts sampled (balanced over templates) for the final score.
        eval_reserve_s: seconds of the budget kept for evaluation and saving.
        threads: torch CPU threads. 1 by default: on the shared 2-core machine this was tuned on, two OpenMP
            threads spin-waiting for each other under load ran about 10x slower per step than one thread.
        log_every: steps between loss log lines.
        init: continue from this saved model (diffusers directory) instead of random weights.
        digits_share: fraction of each batch drawn from the digits world (0: shapes only).
        snapshot_every: every this many steps, save the EMA model to ``{out}.snapshots/step_{N}`` (``None``: never),
            to choose a checkpoint of a given skill afterwards.
        num_layers, num_attention_heads, patch_size: transformer size (heads of 32 dimensions; patch 4 = 64
            image tokens at 32x32).
        shift: the sampler's time shift ``t -> shift t / (1 + (shift - 1) t)``, saved in the scheduler (SD3's 3:
            more sampling steps at high noise, where the layout of the scene is decided).
        train_shift: the same shift applied to the logit-normal training times (measured: 3 scored 11.5% held-out
            where 1, SD3's unshifted logit-normal, scored 7.5%; the layout decided at high noise is the hard part).
    """

    out: str = "checkpoints/shapes_flow"
    minutes: float = 15.0
    seed: int = 0
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 100
    ema_decay: float = 0.995
    cond_dropout: float = 0.1
    renders_per_kind: int = 4000
    eval_prompts: int = 200
    eval_reserve_s: float = 45.0
    threads: int = 1
    log_every: int = 25
    num_layers: int = 4
    num_attention_heads: int = 4
    patch_size: int = 4
    shift: float = 3.0
    train_shift: float = 3.0
    init: str | None = None
    digits_share: float = 0.0
    snapshot_every: int | None = None

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0 <= self.digits_share < 1:
            raise ValueError(f"digits_share must be in [0, 1), got {self.digits_share}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 or None, got {self.snapshot_every}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")
        if self.batch_size < 1 or self.renders_per_kind < 1 or self.eval_prompts < 1:
            raise ValueError("batch_size, renders_per_kind and eval_prompts must be >= 1")


def render_pool(
    per_kind: int, seed: int, with_digits: bool = False
) -> dict[str, tuple[list[str], torch.Tensor]]:
    """``{kind: (prompts [N], images uint8 [N, 3, 32, 32])}`` rendered from the train split.

    Each kind gets ``per_kind`` renders spread evenly over its train prompts (few single-object prompts thus get
    many renders each, the many relation prompts few each), each render with its own scene seed. With
    ``with_digits`` the kind ``"digits"`` holds as many signs of the digits world's train numbers.
    """
    rng = np.random.default_rng(seed)
    by_kind = {k: [p for p in shapes.train_prompts() if shapes.prompt_kind(p) == k] for k in KINDS}
    if with_digits:
        by_kind["digits"] = digits.train_prompts()
    pool = {}
    for k, prompts in by_kind.items():
        chosen = [prompts[i % len(prompts)] for i in rng.permutation(per_kind)]
        seeds = rng.integers(0, 2**31, size=per_kind)
        render = digits.render_prompt if k == "digits" else shapes.render_prompt
        images = np.stack(
            [np.asarray(render(p, int(s), SHAPES_RESOLUTION)) for p, s in zip(chosen, seeds, strict=True)]
        )  # [N, H, W, 3]
        pool[k] = (chosen, torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
    return pool


@torch.no_grad()
def evaluate(
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
    """Whether the model's tokenizer has the digits world's tokens (a checkpoint made with ``--digits-share``)."""
    return "4</w>" in adapter.pipe.tokenizer.get_vocab()


def evaluate_all(adapter: ShapesAdapter, eval_prompts: int, seed: int) -> dict[str, float]:
    """The card's scores: shapes strict with CFG (``strict`` and per template), and for a digits model also
    shapes strict without CFG (``strict_cfg1``) and the held-out OCR score with and without CFG."""
    scores = evaluate(adapter, heldout_eval_prompts(eval_prompts, seed), seed)
    if reads_digits(adapter):
        scores["strict_cfg1"] = evaluate(adapter, heldout_eval_prompts(eval_prompts, seed), seed, 1.0)[
            "strict"
        ]
        for guidance in (1.0, SHAPES_GUIDANCE_SCALE):
            for name, value in evaluate_digits(adapter, seed, guidance).items():
                scores[f"digits_{name}_cfg{guidance:g}"] = value
    return scores


def heldout_eval_prompts(n: int, seed: int) -> list[str]:
    """The evaluation prompt list: ``n`` held-out prompts, the four templates in turn."""
    return shapes.sample_prompts(n, seed, "heldout")


class ShapesPretrainer:
    """Flow-matching pretraining of the tiny shapes model: ``setup()``, ``train()``, ``save_checkpoint()``."""

    def __init__(self, config: PretrainConfig, command: str) -> None:
        self.config = config
        self.command = command
        self.start = time.time()
        self.step = 0
        self.metrics: list[dict] = []

    def setup(self) -> None:
        cfg = self.config
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        # 1. model: random weights and a tokenizer trained on the prompt vocabulary, or a saved model whose
        # tokenizers learn the digits world's words
        corpus = shapes.all_prompts() + (digits.all_prompts() if cfg.digits_share > 0 else [])
        if cfg.init is not None:
            self.pipe = ShapesAdapter.from_pretrained(cfg.init).pipe
            if cfg.digits_share > 0 and not reads_digits(ShapesAdapter(self.pipe)):
                added = extend_shapes_vocabulary(
                    self.pipe, digits.all_prompts(), shapes.all_prompts(), cfg.seed
                )
                logger.info("added %d tokens to the tokenizers of %s", len(added), cfg.init)
        else:
            self.pipe = build_shapes_pipeline(
                corpus,
                cfg.num_layers,
                cfg.num_attention_heads,
                patch_size=cfg.patch_size,
                shift=cfg.shift,
            )
        self.modules = [self.pipe.transformer, self.pipe.text_encoder, self.pipe.text_encoder_2]
        self.params = [p for m in self.modules for p in m.parameters()]
        for m in self.modules:
            m.train()
        self.ema = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0, foreach=True)
        # 2. data
        t0 = time.time()
        self.pool = render_pool(cfg.renders_per_kind, cfg.seed, with_digits=cfg.digits_share > 0)
        logger.info(
            "rendered %d training images in %.1fs", cfg.renders_per_kind * len(self.pool), time.time() - t0
        )
        self.rng = torch.Generator().manual_seed(cfg.seed)

    def _lr(self, progress: float) -> float:
        """Warmup, then cosine from ``lr`` to ``0.1 lr`` as ``progress`` (time or steps used) goes 0 -> 1."""
        cfg = self.config
        if self.step < cfg.warmup_steps:
            return cfg.lr * (self.step + 1) / cfg.warmup_steps
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def _batch(self) -> tuple[list[str], torch.Tensor]:
        """``batch_size`` (prompt, image in [-1, 1]) pairs: the first ``round(digits_share x batch_size)`` signs,
        the others shapes with the template kinds in turn."""
        cfg = self.config
        prompts, images = [], []
        num_digits = round(cfg.digits_share * cfg.batch_size)
        for i in range(cfg.batch_size):
            shape_kind = KINDS[(self.step * (cfg.batch_size - num_digits) + i - num_digits) % len(KINDS)]
            kind_prompts, kind_images = self.pool["digits" if i < num_digits else shape_kind]
            j = int(torch.randint(len(kind_prompts), (1,), generator=self.rng))
            prompts.append(kind_prompts[j])
            images.append(kind_images[j])
        x0 = torch.stack(images).float() / 127.5 - 1
        drop = torch.rand(cfg.batch_size, generator=self.rng) < cfg.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        return prompts, x0

    def _progress(self) -> float:
        cfg = self.config
        if cfg.max_steps is not None:
            return self.step / cfg.max_steps
        return (time.time() - self.start) / (cfg.minutes * 60 - cfg.eval_reserve_s)

    def train(self) -> None:
        cfg = self.config
        transformer = self.pipe.transformer
        running = []
        while self._progress() < 1.0:
            # 1. data and noise
            prompts, x0 = self._batch()  # x0: [B, 3, 32, 32]
            eps = torch.randn(x0.shape, generator=self.rng)
            u = torch.sigmoid(torch.randn(cfg.batch_size, generator=self.rng))  # logit-normal(0, 1)
            t = cfg.train_shift * u / (1 + (cfg.train_shift - 1) * u)
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
            v = transformer(
                hidden_states=x_t,
                timestep=t * 1000,
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
            loss = torch.nn.functional.mse_loss(v, eps - x0)
            # 4. update and EMA
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(self._progress())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            decay = min(cfg.ema_decay, (1 + self.step) / (10 + self.step))
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.params], 1 - decay)
            self.step += 1
            running.append(loss.item())
            if self.step % cfg.log_every == 0:
                record = {
                    "step": self.step,
                    "loss": sum(running) / len(running),
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "elapsed_s": round(time.time() - self.start, 1),
                }
                self.metrics.append(record)
                logger.info("step %(step)d loss %(loss).4f lr %(lr).2e elapsed %(elapsed_s).0fs", record)
                running = []
            if cfg.snapshot_every is not None and self.step % cfg.snapshot_every == 0:
                self.save_snapshot()
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break

    @torch.no_grad()
    def save_snapshot(self) -> None:
        """The EMA model of this step to ``{out}.snapshots/step_{N}`` (diffusers layout), training weights kept."""
        live = [p.detach().clone() for p in self.params]
        torch._foreach_copy_([p.data for p in self.params], self.ema)
        directory = Path(self.config.out + ".snapshots") / f"step_{self.step}"
        self.pipe.save_pretrained(directory)
        torch._foreach_copy_([p.data for p in self.params], live)
        logger.info("snapshot -> %s", directory)

    def save_checkpoint(self) -> dict[str, float]:
        """Write the EMA model, reload it through the adapter, evaluate held-out prompts, write the card."""
        cfg = self.config
        out = Path(cfg.out)
        with torch.no_grad():
            for e, p in zip(self.ema, self.params, strict=True):
                p.copy_(e)
        for m in self.modules:
            m.eval()
        # write to a temporary directory, then rename: an interrupted save never leaves a broken checkpoint
        tmp = out.with_name(out.name + ".tmp")
        self.pipe.save_pretrained(tmp)
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in self.metrics))
        train_minutes = (time.time() - self.start) / 60
        adapter = ShapesAdapter.from_pretrained(str(tmp))
        scores = evaluate_all(adapter, cfg.eval_prompts, cfg.seed)
        wall = time.time() - self.start
        write_card(tmp, cfg, self.command, self.step, train_minutes, wall, scores)
        if out.exists():
            backup = out.with_name(out.name + ".old")
            out.rename(backup)
            tmp.rename(out)
            shutil.rmtree(backup)
        else:
            tmp.rename(out)
        logger.info(
            "held-out strict score %.3f (%s); wall %.1f min -> %s", scores["strict"], scores, wall / 60, out
        )
        return scores


def write_card(
    directory: Path,
    cfg: PretrainConfig,
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
    if cfg.digits_share > 0:
        start = f"`{cfg.init}`" if cfg.init else "random weights"
        title, vocabulary = "shapes and digits worlds", "shapes and digits"
        origin = (
            f"Trained from {start} by flow matching on renders of the shapes world's *train* prompts and, for "
            f"{cfg.digits_share:.0%} of each batch, signs of the digits world's *train* numbers"
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
    text = f"""# {Path(cfg.out).name}: tiny pixel-space SD3 text-to-image model of the {title}

{origin}
(`mmrl/flow/pretrain_shapes.py`). Loads with `StableDiffusion3Pipeline.from_pretrained` or
`pipelines.flow.adapters.ShapesAdapter.from_pretrained` (the path RL uses).

- architecture: `SD3Transformer2DModel` ({params / 1e6:.2f} M parameters, width {cfg.num_attention_heads * 32}, {cfg.num_layers} layers, patch {cfg.patch_size}, RGB 32x32, no VAE), two
  `CLIPTextModelWithProjection` encoders, CLIP tokenizer trained on the {vocabulary} prompts, no T5
- command: `{command}`
- seed: {cfg.seed}
- training: {steps} steps of batch {cfg.batch_size}, {train_minutes:.1f} min; AdamW lr {cfg.lr}, EMA {cfg.ema_decay},
  prompt dropout {cfg.cond_dropout}, {cfg.threads} CPU threads
- wall time (model setup, rendering, training, saving, evaluation; Python imports excluded): {wall_s / 60:.1f} min
- size on disk: {size_mb:.1f} MB

## Held-out score

Strict shapes verifier (`rewards.build("shapes")`, 1 only if object, count, colour and position are all right)
on {cfg.eval_prompts} held-out prompts (`mmrl.data.shapes.sample_prompts({cfg.eval_prompts}, {cfg.seed}, "heldout")`, the four
templates in turn), one ODE sample each ({SHAPES_NUM_STEPS} Euler steps, guidance scale {SHAPES_GUIDANCE_SCALE},
initial noise from `torch.Generator().manual_seed({cfg.seed})`).

| prompts | strict score |
|---|---|
| all | {scores["strict"]:.3f} |
{per_kind}
{digits_section}
Reproduce the score: `python -m mmrl.flow.pretrain_shapes --eval-only {cfg.out} --seed {cfg.seed} --eval-prompts {cfg.eval_prompts}`

Full config: `{json.dumps(asdict(cfg))}`
"""
    (directory / "card.md").write_text(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mmrl.flow.pretrain_shapes", description=__doc__.split("\n")[0]
    )
    defaults = PretrainConfig()
    parser.add_argument("--out", default=defaults.out, help="checkpoint directory")
    parser.add_argument(
        "--minutes", type=float, default=defaults.minutes, help="wall-time budget of the command"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps (exact replay)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--renders-per-kind", type=int, default=defaults.renders_per_kind)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--patch", type=int, default=defaults.patch_size)
    parser.add_argument("--shift", type=float, default=defaults.shift)
    parser.add_argument("--train-shift", type=float, default=defaults.train_shift)
    parser.add_argument("--ema-decay", type=float, default=defaults.ema_decay)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts)
    parser.add_argument("--init", help="continue from this saved model instead of random weights")
    parser.add_argument(
        "--digits-share",
        type=float,
        default=defaults.digits_share,
        help="fraction of each batch of digit signs",
    )
    parser.add_argument(
        "--snapshot-every", type=int, help="save the EMA model every N steps to OUT.snapshots/"
    )
    parser.add_argument(
        "--eval-only", metavar="DIR", help="only evaluate the checkpoint in DIR (as the card does)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.eval_only:
        torch.set_num_threads(args.threads)
        adapter = ShapesAdapter.from_pretrained(args.eval_only)
        scores = evaluate_all(adapter, args.eval_prompts, args.seed)
        print(json.dumps(scores))
        return scores
    config = PretrainConfig(
        out=args.out,
        minutes=args.minutes,
        seed=args.seed,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        threads=args.threads,
        renders_per_kind=args.renders_per_kind,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        patch_size=args.patch,
        shift=args.shift,
        train_shift=args.train_shift,
        ema_decay=args.ema_decay,
        eval_prompts=args.eval_prompts,
        init=args.init,
        digits_share=args.digits_share,
        snapshot_every=args.snapshot_every,
    )
    command = "python -m mmrl.flow.pretrain_shapes " + " ".join(sys.argv[1:] if argv is None else argv)
    trainer = ShapesPretrainer(config, command)
    trainer.setup()
    trainer.train()
    return trainer.save_checkpoint()


if __name__ == "__main__":
    main()
