"""Prompt sources for the text-to-image front end: a prompt file, or a split of the embedded shapes world."""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_prompts"]

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
            raise ValueError(f"unknown shapes split {split!r} in {source!r}. Available: {list(_SHAPES_SPLITS)}")
        if count is not None:
            return shapes.sample_prompts(count, 0, split)  # type: ignore[arg-type]
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
