"""One checkpoint format for every recipe, written atomically.

Layout under a run directory::

    checkpoints/
      step_00000100/      one folder per checkpoint
        state.pt          trainer state: model/optimizer/scheduler state dicts, PromptStats, RNG states, step
        adapter/          (front ends, LoRA) the adapter in PEFT format, loadable by diffusers/transformers
        model/            (VLM full fine-tuning, SFT recipes) a transformers from_pretrained folder
        transformer/      (flow full fine-tuning) a diffusers model folder; Wan2.2 also transformer_2/
      latest              text file: the folder name of the newest complete checkpoint

A checkpoint is assembled in a hidden temporary folder and renamed into place, and ``latest`` is replaced by
rename too, so a crash at any moment leaves the previous checkpoint intact and ``latest`` pointing at a
complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainable",
    "publish_folder",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
LATEST_FILE = "latest"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8) via a temporary file and ``os.replace`` (atomic on POSIX)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace`` (atomic on POSIX): a reader (``mmrl
    report`` while the run writes) or a crash never leaves a file cut short."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    extra: Callable[[Path], None] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save ``state`` (anything ``torch.save`` takes) as checkpoint ``step`` under ``root``; return its folder.

    Args:
        root: the ``checkpoints`` folder.
        step: training step the state belongs to (the state should also record it).
        state: the trainer state.
        extra: called with the temporary folder to write more files (e.g. ``model.save_pretrained(dir)``).
        keep_last: delete older checkpoints beyond this many (the new one counts).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    if extra is not None:
        extra(tmp)
    if final.exists():
        # Re-saving the same step (e.g. after a resume): move the old one aside only once the new one is complete.
        old = root / f".old-{name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    atomic_write_text(root / LATEST_FILE, name + "\n")
    if keep_last is not None:
        done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
        for stale in done[:-keep_last]:
            shutil.rmtree(stale)
    logger.info("saved checkpoint %s", final)
    return final


def publish_folder(out: str | Path, write: Callable[[Path], None]) -> Path:
    """Replace the folder ``out`` with what ``write(directory)`` writes (a model release: weights, card):
    written into a hidden sibling, then swapped in by renames, so a crash leaves the old or the new folder
    complete on disk, never a mix; if ``write`` raises, the sibling is removed and ``out`` is untouched."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    old = out.with_name(f".old-{out.name}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left, and ``out`` is as it was
        raise
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    logger.info("wrote %s", out)
    return out


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    root = Path(root)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", require: Sequence[str] = ()
) -> dict[str, Any]:
    """Load the state saved by :func:`save_checkpoint` from a checkpoint folder (or its ``state.pt``).

    The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers only, so
    a file that names a Python object to build (a pickle's way to run code) is refused, not run.

    Raises:
        FileNotFoundError: no state file there.
        ValueError: the file is not a readable checkpoint (cut short, not a torch file), or lacks a key of
            ``require`` (the checkpoint of another recipe); the message names the file.
    """
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint state at {file}")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:  # a zip cut short, an empty file, a file that is no pickle, a pickle of objects
        # torch's weights-only message runs to many lines; its one line that says what was refused is enough
        reason = str(err).partition("WeightsUnpickler error:")[2].strip().partition("\n")[0] or str(err)
        if reason.startswith("Unsupported global"):
            raise ValueError(
                f"{file} is not an mmrl checkpoint: it names a Python object to build ({reason}); checkpoints "
                f"are read as tensors and plain values only, and code a file names is never run"
            ) from err
        raise ValueError(
            f"{file} is not a readable checkpoint ({type(err).__name__}: {reason}); if it was cut short, delete "
            f"{file.parent} to resume from the checkpoint before it"
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"{file} is not an mmrl checkpoint (it holds a {type(state).__name__})")
    missing = [key for key in require if key not in state]
    if missing:
        raise ValueError(f"{file} has no {missing}: the checkpoint of another recipe or model")
    return state


def load_trainable(module: torch.nn.Module, trainable: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's ``trainable`` tensors into ``module``'s parameters of the same names (whole tensors;
    on a model sharded by ``mmrl.distributed.shard_model`` every rank must call this, each keeps its shard).

    Raises:
        ValueError: the checkpoint names parameters the module lacks, or holds them in other shapes (a different
            model or LoRA layout).
    """
    from mmrl.distributed import shard_like

    params = dict(module.named_parameters())
    missing = sorted(set(trainable) - set(params))
    if missing:
        raise ValueError(f"checkpoint has parameters this model lacks, e.g. {missing[:3]}")
    resized = [
        f"{name} {tuple(value.shape)} (the model: {tuple(params[name].shape)})"
        for name, value in trainable.items()
        if tuple(value.shape) != tuple(params[name].shape)
    ]
    if resized:
        raise ValueError(
            f"checkpoint tensors differ in shape from the model's (another LoRA rank or model size?): {resized[:3]}"
        )
    with torch.no_grad():
        for name, value in trainable.items():
            params[name].copy_(shard_like(value, params[name]))
