"""Prompt sources for the text-to-image front end: a prompt file, or a split of the embedded shapes world."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_prompts", "load_prompts"]

_SHAPES_SPLITS = ("train", "heldout", "all")


def load_prompts(source: str) -> list[str]:
    """Prompts from ``source``.

    ``shapes:train`` / ``shapes:heldout`` / ``shapes:all`` are the shapes world's prompt splits;
    ``shapes:heldout@100`` is a template-balanced sample of 100 prompts of the split (the four templates in
    turn, as GenEval balances its tasks and as the base checkpoint's card measures); anything else is a UTF-8
    text file with one prompt per line (blank lines and ``#`` comments skipped).

    Raises:
        ValueError: unknown shapes split, a missing file, or a file without a single prompt.
    """
    if source.startswith("shapes:"):
        from mmrl.data import shapes

        split = source.split(":", 1)[1]
        count = None
        if "@" in split:
            split, _, n = split.partition("@")
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"{source!r}: the sample size after '@' must be a positive integer")
            count = int(n)
        if split not in _SHAPES_SPLITS:
            raise ValueError(
                f"unknown shapes split {split!r} in {source!r}. Available: {list(_SHAPES_SPLITS)}"
            )
        if count is not None:
            return shapes.sample_prompts(count, 0, split)  # type: ignore[arg-type]
        return {"train": shapes.train_prompts, "heldout": shapes.heldout_prompts, "all": shapes.all_prompts}[
            split
        ]()
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (or use shapes:train / shapes:heldout)")
    prompts = [prompt for _, prompt in _numbered_prompts(path)]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompt (one prompt per line expected)")
    return prompts


def _numbered_prompts(path: Path) -> list[tuple[int, str]]:
    """``(line number, prompt)`` of a prompt file, blank lines and ``#`` comments skipped, spaces collapsed."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
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
