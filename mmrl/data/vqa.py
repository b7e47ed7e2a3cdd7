"""VQA examples for the VLM front end: the shapes VQA tasks, local json/jsonl/parquet files, or a hub dataset.

Every source becomes a list of :class:`VQAExample` (a stable id, the question text, the answer, the images).
Local files and hub datasets go through HF ``datasets``; an image column may hold file paths (relative to
``image_root``), a list of paths, ``datasets.Image`` values or raw bytes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from pipelines.vlm.inputs import check_image_placeholders
from rewards.images import pil_to_rgb

if TYPE_CHECKING:
    from mmrl.data.shapes_math import MathItem

__all__ = ["VQAExample", "check_answers", "fit_pixels", "format_question", "load_vqa"]

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class VQAExample:
    """One question with its ground-truth answer; ``prompt_id`` keys the trainer's statistics store.

    ``reference`` is an optional reference solution (e.g. the steps of a worked answer), which rewards that score
    the reasoning, not only the answer, compare against (``reasoning_steps``); empty when the data has none.
    """

    prompt_id: str
    question: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    kind: str = ""
    reference: str = ""


def format_question(template: str, question: Any) -> str:
    """The question text ``template.format(question=question)`` of a ``data.question_template``.

    Raises:
        ValueError: naming ``data.question_template`` and the field it cannot fill (a literal brace, as in a JSON
            example, reads as a field: it is written doubled).
    """
    try:
        return template.format(question=question)
    except KeyError as err:
        problem = f"unknown field {{{err.args[0]}}}"
    except (IndexError, AttributeError, ValueError) as err:
        problem = str(err)
    raise ValueError(
        f"data.question_template {template!r}: {problem}; its only field is {{question}}, and a literal brace is "
        "written doubled ({{ or }})"
    )


def _shapes(split: str, n: int, seed: int, size: int) -> list[VQAExample]:
    from mmrl.data.shapes_vqa import make_vqa_items

    items = make_vqa_items(n, seed, size=size, split=split)  # type: ignore[arg-type]
    return [
        VQAExample(f"shapes-{split}-{seed}-{i}", item.prompt, item.answer, [item.image], item.kind)
        for i, item in enumerate(items)
    ]


def _shapes_math(split: str, n: int, seed: int, size: int) -> list[VQAExample]:
    from mmrl.data.shapes_math import make_math_items

    items = make_math_items(n, seed, size=size, split=split)  # type: ignore[arg-type]
    return _math_examples("shapes_math", split, seed, items)


def _shapes_count(split: str, n: int, seed: int, size: int) -> list[VQAExample]:
    from mmrl.data.shapes_math import make_count_items

    items = make_count_items(n, seed, size=size, split=split)  # type: ignore[arg-type]
    return _math_examples("shapes_count", split, seed, items)


def _math_examples(source: str, split: str, seed: int, items: Sequence[MathItem]) -> list[VQAExample]:
    from mmrl.data.shapes_math import format_trace

    return [
        VQAExample(
            f"{source}-{split}-{seed}-{i}",
            item.prompt,
            str(item.answer),
            [item.image],
            item.template,
            reference=format_trace(item.steps),
        )
        for i, item in enumerate(items)
    ]


#: Generated sources ``NAME:SPLIT``: the builder ``(split, n, seed, image_size)`` and the splits it knows.
GENERATED: dict[str, tuple[Callable[[str, int, int, int], list[VQAExample]], tuple[str, ...]]] = {
    "shapes": (_shapes, ("train", "heldout")),
    "shapes_math": (_shapes_math, ("train", "heldout", "heldout_templates")),
    "shapes_count": (_shapes_count, ("train", "heldout")),
}


def fit_pixels(
    image: Image.Image, min_pixels: int | None = None, max_pixels: int | None = None
) -> Image.Image:
    """``image`` scaled by ``sqrt(bound / (width x height))`` (aspect ratio kept, bicubic, sides rounded down to
    at least 1) when its pixel count exceeds ``max_pixels`` or falls below ``min_pixels``; otherwise ``image``
    itself. EasyR1 bounds its images so before the processor (``data.min_pixels`` / ``max_pixels``: 262,144 and
    4,194,304 in its examples), which caps a large image's visual tokens (Qwen2.5-VL: one per 28 x 28 pixels).
    """
    pixels = image.width * image.height
    bound = max_pixels if max_pixels is not None and pixels > max_pixels else None
    if bound is None and min_pixels is not None and pixels < min_pixels:
        bound = min_pixels
    if bound is None:
        return image
    scale = math.sqrt(bound / pixels)
    size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def _open_image(value: Any, root: Path, where: str) -> Image.Image:
    """One image cell (a PIL image, ``{bytes, path}``, bytes or a path relative to ``root``) as 8-bit RGB, 16-bit
    and float images scaled as the rewards read them (:func:`rewards.images.pil_to_rgb`), not clipped."""
    try:
        if isinstance(value, Image.Image):
            return pil_to_rgb(value, where)
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            if value.get("bytes"):
                return pil_to_rgb(Image.open(io.BytesIO(value["bytes"])), where)
            value = value["path"]
        if isinstance(value, bytes | bytearray):
            return pil_to_rgb(Image.open(io.BytesIO(value)), where)
        path = Path(str(value))
        path = path if path.is_absolute() else root / path
        with Image.open(path) as im:
            return pil_to_rgb(im, where)
    except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: cannot read image {str(value)[:200]!r}: {err}") from None


def _json_problem(path: Path) -> str | None:
    """Where a ``.json`` / ``.jsonl`` file stops being JSON (``line N: ...``), or None (then the error lies
    elsewhere: a parquet file, columns that differ between rows)."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    import json

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte {err.start})"
    try:
        json.loads(text)
        return None  # one JSON document
    except ValueError as err:
        whole = f"line {getattr(err, 'lineno', '?')} is not valid JSON ({getattr(err, 'msg', err)})"
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    for number, line in lines:  # JSON lines: one object per line
        try:
            json.loads(line)
        except ValueError as err:
            if number == lines[0][0]:
                return whole  # not JSON lines either: where the single document breaks
            return f"line {number} is not valid JSON ({getattr(err, 'msg', err)}): {line.strip()[:120]!r}"
    return None


def _load_dataset(source: str, *args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset(*args, **kwargs)`` with its failures as one ValueError naming ``source`` and the
    innermost cause (a JSON parse error with its row, an unreachable hub)."""
    import datasets

    try:
        return datasets.load_dataset(*args, **kwargs)
    except (Exception, StopIteration) as err:  # (datasets raises StopIteration on some empty files)
        cause: BaseException = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        detail = f"{type(err).__name__}: {err}" + (
            f" ({type(cause).__name__}: {cause})" if cause is not err else ""
        )
        detail = " ".join(detail.split())[:400]
        if Path(source).suffix in _LOCAL_FORMATS:
            detail = _json_problem(Path(source)) or detail
            raise ValueError(f"VQA data file {source} cannot be read: {detail}") from None
        raise ValueError(
            f"cannot load the hub dataset {source!r}: {detail}. Without network, use a local .json/.jsonl/.parquet "
            "file or shapes:train / shapes:heldout"
        ) from None


def hub_source(source: str, default_split: str) -> tuple[str, str]:
    """``(dataset id, split)`` of a hub source: ``"org/name@test"`` names its split (EasyR1's form), a bare id
    takes ``default_split`` (``data.split``)."""
    hub_id, _, split = source.partition("@")
    return hub_id, split or default_split


def _decodes_images(feature: Any) -> bool:
    """Whether a ``datasets`` feature (an Image, or a list / sequence of them) decodes its images itself."""
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and feature:
        inner = feature[0]
    if inner is not None:
        return _decodes_images(inner)
    return type(feature).__name__ == "Image" and bool(getattr(feature, "decode", False))


def _undecoded(feature: Any, datasets: Any) -> Any:
    """The same feature with its images left as ``{bytes, path}``."""
    if isinstance(feature, list):
        return [_undecoded(feature[0], datasets)]
    if hasattr(feature, "feature"):
        return type(feature)(_undecoded(feature.feature, datasets))
    return datasets.Image(decode=False)


def load_vqa(
    source: str,
    *,
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    image_size: int = 32,
    question_column: str = "question",
    answer_column: str = "answer",
    image_column: str | None = "image",
    id_column: str | None = None,
    reference_column: str | None = None,
    image_root: str | None = None,
    question_template: str = "{question}",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> list[VQAExample]:
    """Load VQA examples.

    Args:
        source: a generated source (``shapes:train`` / ``shapes:heldout``: one-word VQA;
            ``shapes_math:train`` / ``shapes_math:heldout`` / ``shapes_math:heldout_templates``: arithmetic with
            a reasoning trace, ``mmrl.data.shapes_math``; ``limit`` items, default 1000), a local
            ``.json`` / ``.jsonl`` / ``.parquet`` file, or a hub dataset id (on a connected machine).
        split: the split of a hub dataset.
        limit: keep the first ``limit`` examples.
        seed: seed of the generated shapes items.
        image_size: side of the generated shapes images.
        question_column, answer_column, image_column, id_column: column names (``image_column=None``: no image).
        reference_column: a column of reference solutions (:attr:`VQAExample.reference`; ``None``: none). The
            generated ``shapes_math`` items carry their reference trace, ``"shapes 4. red 2. 4-2=2"``.
        image_root: folder that relative image paths are resolved against (default: the data file's folder).
        question_template: formats the question, e.g. ``"{question} Put the answer in <answer></answer>."``.
        min_pixels, max_pixels: bounds on every image's pixel count (:func:`fit_pixels`); ``None``: unbounded.

    Raises:
        ValueError: an unknown shapes split, an empty, malformed or unsupported file, a hub dataset that cannot
            be reached, a missing column (named, with the columns present), a row without a question or answer
            or with an unreadable image (named, with the row), an empty dataset, or a ``question_template`` with a
            field other than ``{question}`` (see :func:`format_question`).
    """
    name, _, which = source.partition(":")
    if name in GENERATED and which:
        build, splits = GENERATED[name]
        if which not in splits:
            raise ValueError(
                f"unknown {name} split {which!r} in {source!r}; use one of {[f'{name}:{s}' for s in splits]}"
            )
        return _fit_images(
            build(which, 1000 if limit is None else limit, seed, image_size), min_pixels, max_pixels
        )

    path = Path(source)
    if path.suffix in _LOCAL_FORMATS:
        if not path.is_file():
            raise ValueError(f"VQA data file not found: {path}")
        if path.stat().st_size == 0:
            raise ValueError(f"VQA data file {path} is empty")
        ds = _load_dataset(source, _LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        root = Path(image_root) if image_root else path.parent
    elif path.exists():
        raise ValueError(
            f"VQA data file {path}: unsupported format; use {sorted(_LOCAL_FORMATS)} or shapes:train"
        )
    else:
        hub_id, hub_split = hub_source(source, split)
        ds = _load_dataset(source, hub_id, split=hub_split)
        root = Path(image_root) if image_root else Path(".")
    needed = [c for c in (question_column, answer_column, image_column, id_column, reference_column) if c]
    missing = [c for c in needed if c not in ds.column_names]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; columns present: {ds.column_names}")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    if image_column and _decodes_images(ds.features.get(image_column)):
        import datasets

        # read as {bytes, path}: _open_image then resolves paths against the file's folder and names the row
        # of an image that does not open (datasets would decode while iterating, naming neither)
        ds = ds.cast_column(image_column, _undecoded(ds.features[image_column], datasets))
    examples = []
    for i, row in enumerate(ds):
        where = f"{source} row {i}"
        images: list[Image.Image] = []
        if image_column:
            value = row[image_column]
            values: Sequence[Any] = value if isinstance(value, list) else [value]
            if not values or all(v is None for v in values):
                raise ValueError(
                    f"{where}: no image in column {image_column!r} (the value is {value!r}); every row of a VLM "
                    "question file needs one (set data.image_column to null for text-only questions)"
                )
            if any(v is None for v in values):
                raise ValueError(
                    f"{where}: image {[v is None for v in values].index(True)} of the list in column "
                    f"{image_column!r} is null; a question shows every image its list names"
                )
            images = [_open_image(v, root, where) for v in values]
        for column in (question_column, answer_column):
            if row[column] is None or not str(row[column]).strip():
                raise ValueError(
                    f"{where}: no {column!r} (the value is {row[column]!r}); every row needs one"
                )
        question = format_question(question_template, row[question_column])
        try:
            check_image_placeholders(question, len(images))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        answer = _cell_text(row[answer_column])
        pid = _cell_text(row[id_column]) if id_column else f"{path.stem or source}-{i}"
        reference = ""
        if reference_column:
            if row[reference_column] is None or not str(row[reference_column]).strip():
                raise ValueError(
                    f"{where}: no {reference_column!r} (the value is {row[reference_column]!r}); "
                    "data.reference_column asks every row for a reference solution"
                )
            reference = str(row[reference_column])
        examples.append(VQAExample(pid, question, answer, images, reference=reference))
    if not examples:
        raise ValueError(f"{source}: no examples")
    return _fit_images(examples, min_pixels, max_pixels)


def _fit_images(
    examples: list[VQAExample], min_pixels: int | None, max_pixels: int | None
) -> list[VQAExample]:
    for example in examples:
        example.images = [fit_pixels(image, min_pixels, max_pixels) for image in example.images]
    return examples


def _cell_text(value: Any) -> str:
    """A data cell as text. A column that mixes integers and decimals (answers 4 and 2.5 in one JSON file) loads
    as floats, which would make the answer 4 the string "4.0" that no verifier matches against "4": an integral
    float is written as the integer."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else str(value)


def check_answers(examples: Sequence[VQAExample], verifiers: Sequence[tuple[str, Any]], source: str) -> None:
    """Reject ground truths a verifier cannot compare against (``Reward.ground_truth_problem``), e.g. an answer
    that is no number for ``numeric``, and rows without the reference solution a verifier reads
    (``needs_reference``, e.g. ``reasoning_steps``), before any rollout is spent.

    Args:
        examples: the loaded questions, in file order (so index ``i`` is row ``i``).
        verifiers: ``(key, reward)`` pairs, as in the config's ``rewards``.
        source: the data source, for the message.

    Raises:
        ValueError: naming the source, the row, the prompt id, the answer and the verifier.
    """
    for key, reward in verifiers:
        if getattr(reward, "needs_reference", False):
            for row, example in enumerate(examples):
                if not example.reference.strip():
                    raise ValueError(
                        f"{source} row {row} (id {example.prompt_id}): no reference solution, which the reward "
                        f"{key!r} needs (data.reference_column names the column that holds them)"
                    )
        problem_of = getattr(reward, "ground_truth_problem", None)
        if problem_of is None:
            continue
        for row, example in enumerate(examples):
            problem = problem_of(example.answer)
            if problem is not None:
                raise ValueError(
                    f"{source} row {row} (id {example.prompt_id}): answer {example.answer!r} {problem}, which the "
                    f"reward {key!r} needs"
                )
