"""The one progress display: a rich bar with the step count, rate, ETA and the latest metrics."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["CONSOLE", "TrainProgress"]

# the terminal the bar and the log lines share (on stderr), so that log lines print above a live bar
CONSOLE = Console(stderr=True)


class TrainProgress:
    """Context manager: ``with TrainProgress(total, start=step) as bar: bar.update(step, metrics)``.

    Shows at most ``max_metrics`` metrics (the ``show`` keys first). Disabled (no output) when ``enabled`` is
    False, e.g. in tests or when stdout is not a terminal and the user asked for quiet runs.
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        description: str = "train",
        show: tuple[str, ...] = (),
        max_metrics: int = 4,
        enabled: bool = True,
    ) -> None:
        self.show = show
        self.max_metrics = max_metrics
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=CONSOLE,
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, completed=start, metrics="")

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        text = ""
        if metrics:
            keys = [k for k in self.show if k in metrics]
            keys += [k for k in metrics if k not in keys]
            text = "  ".join(f"{k}={metrics[k]:.4g}" for k in keys[: self.max_metrics])
        self._progress.update(self._task, completed=step, metrics=text)
