"""Run reports: one self-contained HTML page per run (``mmrl report RUN``) and several runs' curves overlaid on one
page (``mmrl compare RUN_A RUN_B ...``).

A report reads only the run directory (its config: ``config.yaml``, or a resumed run's newest
``config.resumed-*.yaml``, :func:`mmrl.run.run_config_file`; ``metrics.jsonl``, ``summary.json``,
``samples/``), so it can be refreshed while the run is writing. A sample image that cannot be read (cut
short, not an image) is named on the page, and its samples are shown without images. Everything is inside the
page: the plots are PNGs drawn with matplotlib and embedded as base64 ``data:`` URIs, the styles are inline,
there is no script and nothing is fetched, so the page opens offline and can be mailed or attached as one
file.

The page holds the run's summary (first and last held-out scores, final metrics), one plot per group of metric
keys (:func:`metric_panels`: rewards and their components, held-out scores, KL, clipping, entropy, NFE and
rollouts, the step-time split, and every other prefix the run logged), galleries of the samples written at each
step (``samples/{tag}_{step}.jsonl`` and its image grid: each image with its prompt and scores, or each question
image with the completion, answer and verdict) and the resolved config.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.config import load_yaml
from mmrl.run import read_metrics, run_config_file

__all__ = [
    "Panel",
    "metric_panels",
    "moving_average",
    "render_comparison",
    "render_report",
    "write_comparison",
    "write_report",
]

logger = logging.getLogger(__name__)

REPORT_FILE = "report.html"
COMPARE_FILE = "compare.html"
# samples shown per step and tag, and the longest side of a gallery image (bigger images are downscaled)
SAMPLES_PER_STEP = 32
THUMBNAIL = 192
_SAMPLE_FILE = re.compile(r"^(?P<tag>.+)_(?P<step>\d{8})\.jsonl$")
_TEXT_FIELDS = ("prompt", "question", "completion", "answer")
_HIDDEN_FIELDS = {"grid_box", "index", "image", "verdict"}


@dataclass(frozen=True)
class Panel:
    """One plot: ``keys`` drawn against the step; ``stacked`` draws them as stacked areas (parts of a whole)."""

    title: str
    keys: tuple[str, ...]
    stacked: bool = False


def _is_main_eval(key: str) -> bool:
    """Held-out scores proper (``eval/reward_mean``, ``eval/{reward}/mean``, ``eval/accuracy`` of the supervised
    recipes, ``eval/{verifier}``) rather than their components or per-kind breakdowns."""
    rest = key.removeprefix("eval/")
    if rest.endswith("/mean"):
        return True
    return "/" not in rest and not rest.startswith(("accuracy_", "reward_mean_"))


def metric_panels(keys: Iterable[str]) -> list[Panel]:
    """Group a run's metric keys into plots, in reading order.

    Named groups first: ``Reward`` (``reward/mean`` and each ``reward/{name}/mean``), one ``Reward components:
    {name}`` per reward with components, ``Held-out scores`` and ``Held-out breakdown`` (``eval/*``), ``Loss``,
    ``KL to the reference`` (``policy/kl``), ``Clipped fraction`` (``clip/*``), ``Entropy`` (``entropy/*``),
    ``NFE per step`` and ``NFE total`` (``nfe/*``), ``Rollouts`` (``rollouts/*``), ``Step time split``
    (``time/rollout_s`` and ``time/train_s``, stacked), the other ``time/*`` keys (a pool's wait and its
    workers' generation time, which overlap the step); then one plot per remaining prefix (``train/*``, ``gen/*``, ...), so every logged
    key is drawn exactly once.
    """
    remaining = sorted(set(keys) - {"step", "time"})
    panels: list[Panel] = []

    def take(title: str, chosen: Sequence[str], stacked: bool = False) -> None:
        chosen = [k for k in chosen if k in remaining]
        if chosen:
            panels.append(Panel(title, tuple(chosen), stacked))
            for k in chosen:
                remaining.remove(k)

    reward_means = [k for k in remaining if re.fullmatch(r"reward/[^/]+/mean", k)]
    take("Reward", ["reward/mean", *reward_means])
    names = sorted({k.split("/")[1] for k in remaining if k.startswith("reward/") and k.count("/") == 2})
    for name in names:
        take(f"Reward components: {name}", [k for k in remaining if k.startswith(f"reward/{name}/")])
    evals = [k for k in remaining if k.startswith("eval/")]
    take("Held-out scores", [k for k in evals if _is_main_eval(k)])
    take("Held-out breakdown", [k for k in evals if not _is_main_eval(k)])
    take("Loss", ["loss"])
    take("KL to the reference", ["policy/kl"])
    take("Clipped fraction", [k for k in remaining if k.startswith("clip/")])
    take("Entropy", [k for k in remaining if k.startswith("entropy/")])
    take("NFE total", ["nfe/total"])
    take("NFE per step", [k for k in remaining if k.startswith("nfe/")])
    take("Rollouts", [k for k in remaining if k.startswith("rollouts/")])
    # only the step's own parts stack; a pool's wait (inside the rollout time) and its workers' generation
    # seconds (beside the training) overlap them and go to a plain panel
    take("Step time split (s)", ["time/rollout_s", "time/train_s"], stacked=True)
    take("Time, overlapping the step (s)", [k for k in remaining if k.startswith("time/")])
    for prefix in sorted({k.split("/")[0] for k in remaining}):
        take(prefix, [k for k in remaining if k.split("/")[0] == prefix])
    return panels


# ---------------------------------------------------------------------------------------------- reading a run
@dataclass
class _Run:
    path: Path
    name: str
    config_file: Path
    config_text: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    command: str | None


def _load_run(run_dir: str | Path) -> _Run:
    path = Path(run_dir)
    config_file = run_config_file(path)
    config_text = config_file.read_text()
    config = load_yaml(config_file)
    records = read_metrics(path) if (path / "metrics.jsonl").is_file() else []
    summary_file = path / "summary.json"
    summary = None
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text())
        except ValueError as err:
            raise ValueError(f"{summary_file} is not valid JSON ({err})") from None
    command_file = path / "command.txt"
    command = command_file.read_text().strip() if command_file.is_file() else None
    name = str((config.get("run") or {}).get("name") or path.name)
    return _Run(path, name, config_file, config_text, config, records, summary, command)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` over the records that logged it (finite values only)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            steps.append(float(r["step"]))
            values.append(float(v))
    return steps, values


# ---------------------------------------------------------------------------------------------- plots
def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean ``m_i = mean(v_{max(0, i-window+1)}, ..., v_i)`` (same length as ``values``)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure_png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buffer.getvalue()


def _axes(title: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(4.4, 2.8))
    ax.set_title(title, fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    return fig, ax


def _plot_panel(panel: Panel, runs: Sequence[_Run]) -> bytes:
    """One panel as a PNG: every key of every run against the step (stacked areas for a single run's time split).
    Sparse series (evaluations) get markers; dense ones are drawn faintly with their moving average over a
    twentieth of the points on top."""
    fig, ax = _axes(panel.title)
    if panel.stacked and len(runs) == 1:
        records = runs[0].records
        rows = [r for r in records if all(isinstance(r.get(k), int | float) for k in panel.keys)]
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r[k] for r in rows] for k in panel.keys], labels=list(panel.keys), alpha=0.8)
    else:
        for run in runs:
            for key in panel.keys:
                steps, values = _series(run.records, key)
                if not steps:
                    continue
                label = (
                    key if len(runs) == 1 else (run.name if len(panel.keys) == 1 else f"{run.name}: {key}")
                )
                if len(steps) <= 30:  # sparse (evaluations): every point marked
                    ax.plot(steps, values, label=label, marker="o", markersize=3, linewidth=1.2)
                else:  # dense and noisy: the raw curve faint, its moving average on top
                    (line,) = ax.plot(steps, values, linewidth=0.8, alpha=0.3)
                    window = max(1, len(values) // 20)
                    ax.plot(
                        steps,
                        moving_average(values, window),
                        label=label,
                        color=line.get_color(),
                        linewidth=1.5,
                    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    return _figure_png(fig)


# ---------------------------------------------------------------------------------------------- galleries
def _sample_files(run: _Run) -> dict[str, list[tuple[int, Path]]]:
    """``{tag: [(step, jsonl path), ...]}`` sorted by step."""
    found: dict[str, list[tuple[int, Path]]] = {}
    samples = run.path / "samples"
    if samples.is_dir():
        for file in sorted(samples.glob("*.jsonl")):
            match = _SAMPLE_FILE.match(file.name)
            if match:
                found.setdefault(match["tag"], []).append((int(match["step"]), file))
    return {tag: sorted(items) for tag, items in sorted(found.items())}


def _read_samples(file: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: not a JSON object: {err}") from None
    return records


def _thumbnail_uri(grid: Any, box: Sequence[int]) -> str:
    from PIL import Image

    image = grid.crop(tuple(int(v) for v in box))
    longest = max(image.size)
    if longest > THUMBNAIL:
        scale = THUMBNAIL / longest
        image = image.resize(
            (max(1, round(image.width * scale)), max(1, round(image.height * scale))),
            Image.Resampling.LANCZOS,
        )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return _png_data_uri(buffer.getvalue())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _verdict(verdict: str) -> str:
    css = {"correct": "ok", "partial": "part", "wrong": "bad"}.get(verdict, "part")
    return f'<span class="verdict {css}">{html.escape(verdict)}</span>'


def _sample_card(record: Mapping[str, Any], image_uri: str | None) -> str:
    parts = ['<div class="card">']
    if image_uri is not None:
        parts.append(f'<img class="sample" src="{image_uri}" alt="sample">')
    for field in _TEXT_FIELDS:
        if field in record:
            parts.append(f'<div class="f"><b>{field}</b> {html.escape(str(record[field]))}</div>')
    if "verdict" in record:
        parts.append(_verdict(str(record["verdict"])))
    scores = [(k, v) for k, v in record.items() if k not in _TEXT_FIELDS and k not in _HIDDEN_FIELDS]
    if scores:
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in scores
        )
        parts.append(f'<table class="scores">{rows}</table>')
    parts.append("</div>")
    return "".join(parts)


def _open_grid(grid_file: Path) -> tuple[Any, str]:
    """``(image, note)``: a step's sample grid (None if it has none) and, for a grid that cannot be read
    (cut short, not an image, a broken chunk), the page's note naming the file, whose samples are then shown
    without images: one damaged image must not cost the whole report."""
    from PIL import Image

    if not grid_file.is_file():
        return None, ""
    try:
        return Image.open(grid_file).convert("RGB"), ""
    except (OSError, SyntaxError, ValueError) as err:
        reason = f"{type(err).__name__}: {err}"
        logger.warning("%s cannot be read (%s); its samples are shown without images", grid_file, reason)
        text = f"{grid_file} cannot be read ({reason}); its samples are shown without images."
        return None, f'<p class="note">{html.escape(text)}</p>'


def _gallery(run: _Run) -> str:
    sections = []
    for tag, items in _sample_files(run).items():
        blocks = []
        for position, (step, file) in enumerate(reversed(items)):
            records = _read_samples(file)[:SAMPLES_PER_STEP]
            grid, note = _open_grid(file.with_suffix(".png"))
            cards = "".join(
                _sample_card(
                    r, _thumbnail_uri(grid, r["grid_box"]) if grid is not None and "grid_box" in r else None
                )
                for r in records
            )
            mean = [r["reward"] for r in records if isinstance(r.get("reward"), int | float)]
            mean_text = f" — mean reward {sum(mean) / len(mean):.3f} over {len(mean)} shown" if mean else ""
            opened = " open" if position == 0 else ""
            blocks.append(
                f"<details{opened}><summary>step {step}{mean_text}</summary>"
                f'{note}<div class="cards">{cards}</div></details>'
            )
        sections.append(f"<h3>{html.escape(tag)} samples</h3>" + "".join(blocks))
    return "".join(sections) or "<p>No samples written yet.</p>"


# ---------------------------------------------------------------------------------------------- summary
def _summary_rows(run: _Run) -> list[tuple[str, str]]:
    config = run.config
    total = (config.get("trainer") or {}).get("steps")
    last = run.records[-1]["step"] if run.records else 0
    done = run.summary is not None
    rows = [
        ("run", run.name),
        ("recipe", str(config.get("recipe", "?"))),
        ("status", "finished" if done else "in progress (or stopped)"),
        ("steps", f"{last} of {total}" if total is not None else str(last)),
    ]
    if run.command:
        rows.append(("command", run.command))
    if run.records:
        rows.append(("wall time", f"{run.records[-1].get('time', 0.0) / 60:.1f} min"))
    main_evals = [
        k
        for p in metric_panels({k for r in run.records for k in r})
        if p.title == "Held-out scores"
        for k in p.keys
    ]
    for key in main_evals:
        steps, values = _series(run.records, key)
        if values:
            rows.append(
                (key, f"{values[0]:.4g} (step {steps[0]:.0f}) → {values[-1]:.4g} (step {steps[-1]:.0f})")
            )
    return rows


def _latest_values(run: _Run) -> dict[str, float]:
    latest: dict[str, float] = {}
    for r in run.records:
        latest.update(
            {k: v for k, v in r.items() if k not in ("step", "time") and isinstance(v, int | float)}
        )
    return latest


def _table(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary">{body}</table>'


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#1c1c1c;max-width:1400px}
h1{margin-bottom:4px} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table.summary th{text-align:left;padding:2px 12px 2px 0;font-weight:600;vertical-align:top}
table.summary td{font-family:ui-monospace,Menlo,monospace;font-size:13px}
.plots{display:flex;flex-wrap:wrap;gap:12px} .plots img{border:1px solid #e4e4e4;background:#fff}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.card{border:1px solid #e4e4e4;border-radius:6px;padding:8px;width:180px;font-size:12px;background:#fafafa}
.card img.sample{width:128px;image-rendering:pixelated;display:block;margin-bottom:6px}
.card .f{margin-bottom:3px;word-wrap:break-word}
table.scores{font-family:ui-monospace,Menlo,monospace;font-size:11px;border-collapse:collapse}
table.scores td{padding:0 8px 0 0}
.verdict{display:inline-block;border-radius:4px;padding:1px 6px;font-weight:600;margin:2px 0}
.ok{background:#d4f4d4} .part{background:#fff1c2} .bad{background:#f8d4d4}
details summary{cursor:pointer;font-weight:600;margin:6px 0}
pre{background:#f6f6f6;padding:12px;font-size:12px;overflow:auto}
.note{background:#f8d4d4;padding:4px 8px;font-size:13px}
"""


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>\n"
    )


def _plots_html(panels: Sequence[Panel], runs: Sequence[_Run]) -> str:
    images = "".join(
        f'<img src="{_png_data_uri(_plot_panel(p, runs))}" alt="{html.escape(p.title)}" '
        f'title="{html.escape(", ".join(p.keys))}">'
        for p in panels
    )
    return f'<div class="plots">{images}</div>' if images else "<p>No metrics logged yet.</p>"


def render_report(run_dir: str | Path) -> str:
    """The HTML page of the run in ``run_dir`` (see the module docstring for what it holds).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml``.
        ValueError: a metrics or sample line is malformed (the message names the file and line).
    """
    run = _load_run(run_dir)
    panels = metric_panels({k for r in run.records for k in r})
    latest = sorted(_latest_values(run).items())
    body = [
        f"<h1>{html.escape(run.name)}</h1>",
        f"<p>Run directory <code>{html.escape(str(run.path))}</code>; refresh with "
        f"<code>mmrl report {html.escape(str(run.path))}</code>.</p>",
        "<h2>Summary</h2>",
        _table(_summary_rows(run)),
        "<h2>Curves</h2>",
        _plots_html(panels, [run]),
        "<h2>Samples</h2>",
        _gallery(run),
        "<h2>Latest value of every metric</h2>",
        _table((k, _fmt(v)) for k, v in latest),
        "<h2>Config</h2>",
        f"<details><summary>{html.escape(run.config_file.name)}</summary>"
        f"<pre>{html.escape(run.config_text)}</pre></details>",
    ]
    return _page(f"mmrl report: {run.name}", "".join(body))


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.html`` for the run in ``run_dir`` into ``out_dir`` (default: the run directory), atomically
    (a browser refreshing it never reads half a page); returns its path."""
    from mmrl.checkpoint import atomic_write_text

    text = render_report(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / REPORT_FILE, text)
    return out / REPORT_FILE


def render_comparison(run_dirs: Sequence[str | Path]) -> str:
    """One page with every metric of ``run_dirs`` overlaid, one plot per key (a line per run), and each run's
    summary side by side."""
    if len(run_dirs) < 2:
        raise ValueError(f"compare needs at least two run directories, got {len(run_dirs)}")
    runs = [_load_run(d) for d in run_dirs]
    keys = {k for run in runs for r in run.records for k in r}
    panels = [
        Panel(f"{p.title}: {k}" if len(p.keys) > 1 else p.title, (k,))
        for p in metric_panels(keys)
        for k in p.keys
    ]
    summaries = "".join(
        f'<div class="card" style="width:420px">{_table(_summary_rows(run))}</div>' for run in runs
    )
    names = ", ".join(run.name for run in runs)
    body = [
        f"<h1>Compare: {html.escape(names)}</h1>",
        "<h2>Runs</h2>",
        f'<div class="cards">{summaries}</div>',
        "<h2>Curves</h2>",
        _plots_html(panels, runs),
    ]
    return _page(f"mmrl compare: {names}", "".join(body))


def write_comparison(run_dirs: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Write ``compare.html`` for ``run_dirs`` into ``out_dir``; returns its path."""
    from mmrl.checkpoint import atomic_write_text

    text = render_comparison(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / COMPARE_FILE, text)
    return out / COMPARE_FILE
