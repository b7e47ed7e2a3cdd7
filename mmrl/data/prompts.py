"""Prompt sources for the text-to-image front end: a prompt file, or a split of an embedded world (shapes, digits)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_prompts", "load_prompts"]

_SPLITS = ("train", "heldout", "all")
#: the embedded worlds whose splits ``WORLD:SPLIT`` names (modules with train/heldout/all/sample_prompts)
_WORLDS = {"shapes": "mmrl.data.shapes", "digits": "mmrl.data.digits"}


def load_prompts(source: str) -> list[str]:
    """Prompts from ``source``.

    ``shapes:train`` / ``shapes:heldout`` / ``shapes:all`` are the shapes world's prompt splits, ``digits:train``
    / ``digits:heldout`` / ``digits:all`` the digits world's (split by number); ``shapes:heldout@100`` is a
    sample of 100 prompts of the split (for shapes the four templates in turn, as GenEval balances its tasks and
    as the base checkpoint's card measures; for digits the split shuffled under seed 0); anything else is a
    UTF-8 text file with one prompt per line (blank lines and ``#`` comments skipped).

    Raises:
        ValueError: unknown world split, a missing file, or a file without a single prompt.
    """
    world, colon, split = source.partition(":")
    if colon and world in _WORLDS:
        import importlib

        module = importlib.import_module(_WORLDS[world])
        count = None
        if "@" in split:
            split, _, n = split.partition("@")
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"{source!r}: the sample size after '@' must be a positive integer")
            count = int(n)
        if split not in _SPLITS:
            raise ValueError(f"unknown {world} split {split!r} in {source!r}. Available: {list(_SPLITS)}")
        if count is not None:
            return module.sample_prompts(count, 0, split)
        return {"train": module.train_prompts, "heldout": module.heldout_prompts, "all": module.all_prompts}[
            split
        ]()
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"prompt file not found: {path} (or use a world split: shapes:train, digits:heldout, ...)"
        )
    prompts = [prompt for _, prompt in _numbered_prompts(path)]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompt (one prompt per line expected)")
    return prompts


def _numbered_prompts(path: Path) -> list[tuple[int, str]]:
    """``(line number, prompt)`` of a prompt file, blank lines and ``#`` comments skipped, spaces collapsed."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # (a byte-order mark is no prompt text)
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path} is not UTF-8 text: {err}") from None
    return [
        (n, " ".join(line.split()))
        for n, line in enumerate(lines, 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def check_prompts(source: str, prompts: Sequence[str], rewards: Sequence[Any]) -> None:
    """Let every reward refuse the prompts it cannot score (``Reward.check_prompt``, e.g. the shapes verifier's
    grammar) before anything is generated for them.

    Args:
        source: where the prompts came from (:func:`load_prompts`'s argument), named in the error.
        prompts: the prompts, as :func:`load_prompts` returned them.
        rewards: the rewards that will score them.

    Raises:
        ValueError: the first refused prompt, named by file and line (or by index for a shapes split).
    """
    for reward in rewards:
        for i, prompt in enumerate(prompts):
            try:
                reward.check_prompt(prompt)
            except ValueError as err:
                path = Path(source)
                where = f"prompt {i}"
                if path.is_file():
                    where = f"line {_numbered_prompts(path)[i][0]}"
                raise ValueError(f"{source} {where}: {err} (reward {reward.name!r})") from None
