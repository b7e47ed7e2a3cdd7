"""The run directory every recipe writes into, and its metric/sample writers.

::

    runs/NAME/
      config.yaml        the resolved config (every field), the record of the run
      config.resumed-T.yaml  the config a resume at time T continued with, when it differs (run_config_file)
      command.txt        the command that started it
      metrics.jsonl      one JSON object per logged step: {"step": ..., "time": ..., "reward/mean": ...}
      tb/                TensorBoard event files
      samples/           per step: {tag}_{step}.jsonl (each sample's prompt and scores) and the image grid .png
      checkpoints/       see mmrl/checkpoint.py
      log.txt            the run's log
      summary.json       final metrics, written at the end
      report.html        plots and samples on one page, written at the end (``mmrl report`` refreshes it)
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from mmrl.checkpoint import atomic_write_bytes, atomic_write_text, latest_checkpoint
from mmrl.config import ConfigError, RunConfig, load_yaml, to_yaml

__all__ = [
    "RESUMABLE_CHANGES",
    "MetricAccumulator",
    "Run",
    "changes_since",
    "check_resume_changes",
    "config_changes",
    "format_change",
    "launch_command",
    "read_metrics",
    "resume_checkpoint",
    "run_config_file",
    "setup_logging",
    "write_summary_json",
]

logger = logging.getLogger(__name__)


def setup_logging(level: str = "INFO", log_file: Path | None = None) -> None:
    """Configure the ``mmrl`` / ``pipelines`` / ``rewards`` loggers once: console via rich, plus a file."""
    from rich.logging import RichHandler

    from mmrl.progress import CONSOLE

    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    handlers: list[logging.Handler] = [RichHandler(console=CONSOLE, show_path=False, rich_tracebacks=False)]
    if log_file is not None:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(fh)
    for name in ("mmrl", "pipelines", "rewards", "benchmarks"):
        lg = logging.getLogger(name)
        lg.handlers = list(handlers)
        lg.setLevel(numeric)
        lg.propagate = False


def launch_command() -> str:
    """This process's command line as a shell line, the ``mmrl`` console script (or ``python -m mmrl.cli``) written
    as ``mmrl``."""
    program = Path(sys.argv[0]).name
    return shlex.join(["mmrl" if program in ("mmrl", "cli.py", "__main__.py") else program, *sys.argv[1:]])


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return float(value)


class MetricAccumulator:
    """Sums and counts per metric name within a step, NaN-aware, reduced across ranks at log time.

    ``add("reward/mean", 0.5, count=8)`` weights a batch mean by its size; ``add_max("pool/lag_max", 3)`` keeps
    the largest value; :meth:`reduce` returns the weighted means and the maxima (over the step's values on every
    rank) and clears the buffer (as TRL's trainer does).
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, float] = {}
        self._maxima: dict[str, float] = {}

    def add(self, name: str, value: float | torch.Tensor, count: float = 1.0) -> None:
        v = _to_float(value)
        if math.isnan(v):
            return
        self._sums[name] = self._sums.get(name, 0.0) + v * count
        self._counts[name] = self._counts.get(name, 0.0) + count

    def add_max(self, name: str, value: float | torch.Tensor) -> None:
        """Record ``value`` under ``name``, reduced as the largest of the step's values (a mean of per-rank maxima
        would not be the maximum)."""
        v = _to_float(value)
        if not math.isnan(v):
            self._maxima[name] = max(self._maxima.get(name, -math.inf), v)

    def add_dict(self, metrics: Mapping[str, float | torch.Tensor], count: float = 1.0) -> None:
        for k, v in metrics.items():
            self.add(k, v, count)

    @contextmanager
    def discarded(self) -> Iterator[None]:
        """What is added inside is dropped: computations run only for their collectives (an FSDP rank's
        padding minibatch) leave no value in the step's metrics."""
        kept = self._sums, self._counts, self._maxima
        self._sums, self._counts, self._maxima = {}, {}, {}
        try:
            yield
        finally:
            self._sums, self._counts, self._maxima = kept

    def reduce(self) -> dict[str, float]:
        """Weighted means over this step's values on every rank (a collective under data parallelism: every
        rank calls it once per step, whichever metrics it recorded)."""
        import torch.distributed as dist

        names, max_names = sorted(self._sums), sorted(self._maxima)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            # a rank may lack a metric the others have (no signal this step): reduce over the union of names
            gathered: list[tuple[list[str], list[str]]] = [([], []) for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, (names, max_names))
            names = sorted({n for rank_names, _ in gathered for n in rank_names})
            max_names = sorted({n for _, rank_names in gathered for n in rank_names})
        sums = torch.tensor([self._sums.get(n, 0.0) for n in names], dtype=torch.float64)
        counts = torch.tensor([self._counts.get(n, 0.0) for n in names], dtype=torch.float64)
        maxima = torch.tensor([self._maxima.get(n, -math.inf) for n in max_names], dtype=torch.float64)
        if distributed and (names or max_names):
            device = (
                torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
            )
            sums, counts, maxima = sums.to(device), counts.to(device), maxima.to(device)
            dist.all_reduce(sums)
            dist.all_reduce(counts)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
            sums, counts, maxima = sums.cpu(), counts.cpu(), maxima.cpu()
        out = {n: float(s / c) for n, s, c in zip(names, sums, counts, strict=True) if c > 0}
        out.update({n: float(m) for n, m in zip(max_names, maxima, strict=True)})
        self._sums.clear()
        self._counts.clear()
        self._maxima.clear()
        return out


def resume_checkpoint(run_cfg: RunConfig) -> Path | None:
    """The checkpoint a run resumes from when ``run.resume`` is set (None for a fresh run). Ranks other than 0
    of a data-parallel launch hold no :class:`Run` (only rank 0 writes) and find their checkpoint here."""
    if not run_cfg.resume:
        return None
    checkpoint_dir = Path(run_cfg.output_dir) / run_cfg.name / "checkpoints"
    ckpt = latest_checkpoint(checkpoint_dir)
    if ckpt is None:
        logger.warning("run.resume=true but %s has no checkpoint; starting from step 0", checkpoint_dir)
    return ckpt


class Run:
    """A run directory: resolved config, metrics JSONL, TensorBoard, samples, checkpoints, log file.

    Args:
        run_cfg: the ``run`` section of the recipe config.
        full_cfg: the whole resolved config, written to ``config.yaml``.

    A folder is a run directory when it holds ``config.yaml`` with ``command.txt`` beside it (every run
    writes both first); a run there counts once it has metrics or checkpoints. What a run that failed during
    setup leaves (those two files, the log, empty ``samples/``, ``tb/``) does not count: a fresh run replaces
    it. A resume checks the config against the run's (:func:`run_config_file`) before anything loads
    (:func:`check_resume_changes`) and, when it differs, writes it as ``config.resumed-<time>.yaml`` beside
    the original record. With ``resume`` and no checkpoint yet, the run starts again at step 0 and every
    earlier metric line is moved to ``metrics.orphaned.jsonl``, as lines after the last checkpoint are when
    one exists.

    Raises:
        FileExistsError: the directory holds a previous run and neither ``resume`` nor ``overwrite`` is set,
            or it holds files but no run (not both ``config.yaml`` and ``command.txt``: someone's own folder,
            perhaps holding the config being run), whatever is set (nothing already written is touched).
        ValueError: ``run.output_dir`` or the run directory is a file; a resume changes the recipe, or keys
            a resume may not change (:class:`~mmrl.config.ConfigError`, naming each).
    """

    def __init__(self, run_cfg: RunConfig, full_cfg: BaseModel) -> None:
        # the console first: what is decided below about an existing folder must reach the user (the log file
        # comes once the folder is known to be the run's)
        setup_logging(run_cfg.log_level)
        self.cfg = run_cfg
        self.dir = Path(run_cfg.output_dir) / run_cfg.name
        self.checkpoint_dir = self.dir / "checkpoints"
        for folder in (self.dir, *self.dir.parents):  # the nearest existing one must be a folder
            if folder.exists():
                if not folder.is_dir():
                    key = "run.name" if folder == self.dir else "run.output_dir"
                    raise ValueError(f"{key}: {folder} is a file, not a folder; choose another {key}")
                break
        existing = self.dir.exists() and any(self.dir.iterdir())
        if existing and not _is_run(self.dir):
            # neither resume nor overwrite (which deletes the folder) may touch a folder mmrl did not
            # write: it may hold the very config being run (exps/NAME/config.yaml)
            found = (
                "a config.yaml without the command.txt a run writes beside it"
                if (self.dir / "config.yaml").is_file()
                else "no config.yaml"
            )
            raise FileExistsError(
                f"{self.dir} holds files but no run ({found}); mmrl writes a run only into an empty folder "
                "or its own run directory and never replaces another folder: choose another run.name or "
                "run.output_dir, or keep your files elsewhere (a config file may live anywhere)"
            )
        changes = check_resume_changes(self.dir, full_cfg, run_cfg) if existing and run_cfg.resume else {}
        if existing and not run_cfg.resume and not run_cfg.overwrite and _setup_leftovers(self.dir):
            logger.info(
                "%s holds only what a run that stopped before its first step left; replacing it", self.dir
            )
            shutil.rmtree(self.dir)
            existing = False
        if existing and run_cfg.overwrite:
            shutil.rmtree(self.dir)
            existing = False
        elif existing and not run_cfg.resume:
            raise FileExistsError(
                f"run directory {self.dir} already holds a run; set run.resume=true to continue it, "
                "run.overwrite=true to replace it, or choose another run.name"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.samples_dir = self.dir / "samples"
        self.samples_dir.mkdir(exist_ok=True)
        setup_logging(run_cfg.log_level, self.dir / "log.txt")
        for key, (old, new) in changes.items():
            if key in RESUMABLE_CHANGES:
                logger.info("resuming with %s", format_change(key, old, new))
            else:
                logger.warning(
                    "resuming with %s (run.resume_changes accepts it)", format_change(key, old, new)
                )
        config_text = to_yaml(full_cfg)
        if existing and run_config_file(self.dir).read_text() != config_text:
            # the original record stays; the config the run continues with is written beside it and is the
            # run's config from now on (run_config_file: what export, eval and report read)
            atomic_write_text(self.dir / f"config.resumed-{int(time.time())}.yaml", config_text)
        elif not existing:  # (a resumed run keeps its launch command)
            atomic_write_text(self.dir / "config.yaml", config_text)
            atomic_write_text(self.dir / "command.txt", launch_command() + "\n")
        self.metrics_path = self.dir / "metrics.jsonl"
        if run_cfg.resume and latest_checkpoint(self.checkpoint_dir) is None:
            self.truncate_metrics(-1)  # the run restarts at step 0: every logged step will be logged again
        self._tb = None
        if run_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"))
        self._wandb = None
        if run_cfg.wandb:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("run.wandb=true needs Weights & Biases: pip install wandb") from err
            self._wandb = wandb.init(
                project="mmrl", name=run_cfg.name, config=full_cfg.model_dump(mode="json")
            )
        self._start = time.time()

    # ------------------------------------------------------------------ resume
    def truncate_metrics(self, step: int) -> None:
        """On resume from ``step``, move metric lines of later steps to ``metrics.orphaned.jsonl`` (kept, not lost).

        A last line cut short (the process was killed while writing it) is moved aside with them, with a warning
        naming it.

        Raises:
            ValueError: a line other than the last is not a JSON object (names the file and line).
        """
        if not self.metrics_path.is_file():
            return
        keep, orphaned = [], []
        lines = self.metrics_path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = _metric_record(line, self.metrics_path, number)
            except ValueError as err:
                if number < len(lines):
                    raise
                logger.warning("%s; moving it to metrics.orphaned.jsonl", err)
                orphaned.append(line)
                continue
            (keep if record.get("step", -1) <= step else orphaned).append(line)
        if orphaned:
            with open(self.dir / "metrics.orphaned.jsonl", "a") as f:
                f.write("\n".join(orphaned) + "\n")
        atomic_write_text(self.metrics_path, "".join(line + "\n" for line in keep))

    # ------------------------------------------------------------------ writers
    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one JSON line and the TensorBoard scalars for ``step``. A NaN or infinite value (a mean over
        no samples) is left out: JSON has no such numbers, and the line must stay valid JSON."""
        record: dict[str, float] = {"step": step, "time": round(time.time() - self._start, 3)}
        values = {k: _to_float(v) for k, v in metrics.items()}
        record.update({k: v for k, v in values.items() if math.isfinite(v)})
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def save_samples(
        self,
        step: int,
        tag: str,
        records: Sequence[Mapping[str, Any]],
        images: torch.Tensor | Sequence[Any] | None = None,
    ) -> Path:
        """Write one step's samples as ``samples/{tag}_{step:08d}.jsonl``, one JSON object per sample (its prompt or
        question, its scores, ...), and with ``images`` (one per record: ``[B, 3, H, W]`` in [0, 1], PIL images, or
        videos ``[B, T, 3, H, W]`` shown by their middle frame, recorded as ``frame``) the grid of them,
        ``samples/{tag}_{step:08d}.png``; each record then gets ``grid_box``, the ``[left, top, right, bottom]``
        pixels of its image in that grid. Returns the JSONL path."""
        from mmrl.images import grid_boxes, make_grid

        stem = self.samples_dir / f"{tag}_{step:08d}"
        rows = [dict(r) for r in records]
        if (
            isinstance(images, torch.Tensor) and images.ndim == 5
        ):  # videos [B, T, 3, H, W]: their middle frame
            for row in rows:
                row["frame"] = images.shape[1] // 2
            images = images[:, images.shape[1] // 2]
        if images is not None:
            if len(images) != len(rows):
                raise ValueError(f"save_samples: {len(images)} images for {len(rows)} records")
            grid = make_grid(images)
            first = images[0]
            height, width = (
                (first.shape[-2], first.shape[-1]) if isinstance(first, torch.Tensor) else first.size[::-1]
            )
            for row, box in zip(rows, grid_boxes(len(rows), int(width), int(height)), strict=True):
                row["grid_box"] = list(box)
            png = io.BytesIO()
            grid.save(png, format="PNG")
            # whole or not at all: `mmrl report` reads the grids while the run writes them
            atomic_write_bytes(stem.with_suffix(".png"), png.getvalue())
            if self._tb is not None:
                import numpy as np

                self._tb.add_image(tag, np.asarray(grid), step, dataformats="HWC")
        atomic_write_text(stem.with_suffix(".jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
        return stem.with_suffix(".jsonl")

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json``; NaN or infinite numbers are left out, as in :meth:`log_metrics`."""
        write_summary_json(self.dir / "summary.json", summary)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


#: what a run writes before its first step; a directory holding only these is what a failed setup left
_SETUP_FILES = ("config.yaml", "command.txt", "log.txt", "tb", "samples")
_RESUMED_CONFIG = re.compile(r"config\.resumed-(\d+)\.yaml")


def _is_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` bears the marks every :class:`Run` writes first: ``config.yaml`` and
    ``command.txt`` beside it. A ``config.yaml`` alone is someone's config file (perhaps the one being run),
    not a run."""
    return (run_dir / "config.yaml").is_file() and (run_dir / "command.txt").is_file()


def _setup_leftovers(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run that stopped before its first step: a run directory (:func:`_is_run`)
    holding only what :class:`Run` writes before the first step (no metrics, no checkpoints, no samples,
    TensorBoard's own event files only), so that replacing it loses nothing."""
    if not _is_run(run_dir):
        return False
    for entry in run_dir.iterdir():
        if entry.name not in _SETUP_FILES and not _RESUMED_CONFIG.fullmatch(entry.name):
            return False
        if entry.name == "samples" and any(entry.iterdir()):
            return False
        if entry.name == "tb" and any(not f.name.startswith("events.out.tfevents.") for f in entry.iterdir()):
            return False
    return True


def run_config_file(run_dir: str | Path) -> Path:
    """The file holding the config a run directory's run trains with now: its newest
    ``config.resumed-<time>.yaml`` (a resume with a changed config writes one), else ``config.yaml``. Export,
    eval and report read this one: after ``trainer.steps=3`` on resume, the run is a 3-step run.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml`` (it is not a run directory).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    resumed = [
        (int(match[1]), path)
        for path in run_dir.glob("config.resumed-*.yaml")
        if (match := _RESUMED_CONFIG.fullmatch(path.name))
    ]
    return max(resumed)[1] if resumed else run_dir / "config.yaml"


#: the keys a resume may change without ``run.resume_changes``: they extend the run (``trainer.steps``; a
#: cosine schedule then spans the new total), locate it, or only decide when and how much it is observed and
#: saved (logging, evaluation and sample cadence and sizes, checkpoint cadence, threads); every other key
#: decides what a step computes, from the world to the learning rate
RESUMABLE_CHANGES = (
    "run.name",
    "run.output_dir",
    "run.resume",
    "run.resume_changes",
    "run.overwrite",
    "run.log_every",
    "run.save_every",
    "run.keep_last",
    "run.tensorboard",
    "run.wandb",
    "run.progress",
    "run.log_level",
    "run.threads",
    "run.threads_policy",
    "trainer.steps",
    "trainer.eval_every",
    "trainer.sample_every",
    "trainer.eval_prompts",
    "trainer.eval_images_per_prompt",
    "data.eval_limit",
    "data.eval_prompts",
    "data.eval_items",
    "out",
)

_ABSENT = object()


def config_changes(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old value, new value)}`` of every leaf that differs between two config dicts; a key
    only one side has is paired with :data:`_ABSENT`, a section that became a value (``model.lora: null``) is
    one key."""
    if isinstance(old, dict) and isinstance(new, dict):
        changes: dict[str, tuple[Any, Any]] = {}
        for key in [*old, *(k for k in new if k not in old)]:
            changes.update(config_changes(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}."))
        return changes
    return {} if old == new else {prefix.removesuffix("."): (old, new)}


def changes_since(record: Path, cfg: BaseModel) -> dict[str, tuple[Any, Any]]:
    """:func:`config_changes` from the config recorded in the file ``record`` to ``cfg``, both as JSON
    values. The record is read through ``cfg``'s schema, so that fields added to mmrl since it was written
    compare at their defaults; a record that no longer validates (an older mmrl's) is compared as written,
    every difference shown."""
    data = load_yaml(record)
    try:
        recorded = type(cfg).model_validate(data).model_dump(mode="json")
    except ValidationError:
        recorded = data
    return config_changes(recorded, cfg.model_dump(mode="json"))


def format_change(key: str, old: Any, new: Any) -> str:
    """``key: old -> new`` of a :func:`config_changes` entry, values as JSON (a key one side lacks:
    ``(absent)``)."""

    def shown(value: Any) -> str:
        return "(absent)" if value is _ABSENT else json.dumps(value)

    return f"{key}: {shown(old)} -> {shown(new)}"


def check_resume_changes(
    run_dir: Path, full_cfg: BaseModel, run_cfg: RunConfig
) -> dict[str, tuple[Any, Any]]:
    """Refuse a resume whose config differs from the run's (:func:`run_config_file`) in a key outside
    :data:`RESUMABLE_CHANGES` that ``run.resume_changes`` does not list (a listed section accepts every key
    below it), naming every such key with its old and new value: the resumed steps would silently follow
    another config (a new seed, learning rate), or fail deep in torch on weights of another shape. Without a
    checkpoint only the recipe must match: the run restarts at step 0 under the new config.

    Returns:
        the accepted changes outside ``run.*``, ``{key: (old, new)}``, for the log.

    Raises:
        ValueError: the run is another recipe's.
        ConfigError: a change outside those allowed.
    """
    record = run_config_file(run_dir)
    data = load_yaml(record)
    recipe = getattr(full_cfg, "recipe", None)
    if data.get("recipe") != recipe:
        # another recipe's checkpoint would fail to load with a bare key name, after the model loaded
        raise ValueError(
            f"run.resume: {run_dir} holds a {data.get('recipe')} run and this config is {recipe}: choose "
            "another run.name"
        )
    if latest_checkpoint(run_dir / "checkpoints") is None:
        return {}
    changes = changes_since(record, full_cfg)
    refused = {
        key: change
        for key, change in changes.items()
        if key not in RESUMABLE_CHANGES
        and not any(key == k or key.startswith(f"{k}.") for k in run_cfg.resume_changes)
    }
    if refused:
        lines = "".join(f"\n  {format_change(k, a, b)}" for k, (a, b) in refused.items())
        raise ConfigError(
            f"run.resume: this config changes what the run in {run_dir} computes ({record.name} records it):"
            f"{lines}\nrestore these values, start a new run (another run.name), or accept the changes "
            f"knowingly: run.resume_changes=[{','.join(refused)}] (the run then follows neither config from "
            "step 0)"
        )
    return {k: v for k, v in changes.items() if not k.startswith("run.")}


def _metric_record(line: str, path: Path, number: int) -> dict[str, Any]:
    """One metrics line parsed, or a ValueError naming the file and line."""
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path} line {number} is not valid JSON ({err.args[0]}): {line[:120]!r}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} line {number} is not a JSON object: {line[:120]!r}")
    return record


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metric records of a run directory, in order. A run still writing may have a half-written last line,
    which is left out.

    Raises:
        ValueError: a line before the last is not a JSON object (names the file and line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(_metric_record(line, path, number))
        except ValueError:
            if index == len(lines) - 1:
                break  # the writer is appending this line right now
            raise
    return records


def write_summary_json(path: Path, summary: Mapping[str, Any]) -> None:
    """Write ``summary`` as JSON at ``path`` (atomically), leaving out NaN or infinite numbers so the file stays
    valid JSON (a mean over no sample is NaN)."""
    finite = {k: v for k, v in summary.items() if not (isinstance(v, float) and not math.isfinite(v))}
    atomic_write_text(path, json.dumps(finite, indent=2, allow_nan=False) + "\n")
