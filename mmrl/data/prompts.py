"""Prompt sources for the text-to-image front end: a prompt file, or a split of the embedded shapes world."""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_prompts"]

_SHAPES_SPLITS = ("train", "heldout", "all")


def load_prompts(source: str) -> list[str]:
    """Prompts from ``source``.

    ``shapes:train`` / ``shapes:heldout`` / ``shapes:all`` are the shapes world's prompt splits; anything else
    is a UTF-8 text file with one prompt per line (blank lines and ``#`` comments skipped).

    Raises:
        ValueError: unknown shapes split, a missing file, or a file without a single prompt.
    """
    if source.startswith("shapes:"):
        from mmrl.data import shapes

        split = source.split(":", 1)[1]
        if split not in _SHAPES_SPLITS:
            raise ValueError(f"unknown shapes split {split!r} in {source!r}. Available: {list(_SHAPES_SPLITS)}")
        return {"train": shapes.train_prompts, "heldout": shapes.heldout_prompts, "all": shapes.all_prompts}[split]()
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (or use shapes:train / shapes:heldout)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path} is not UTF-8 text: {err}") from None
    prompts = [" ".join(line.split()) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompt (one prompt per line expected)")
    return prompts
