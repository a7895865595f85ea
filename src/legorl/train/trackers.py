"""Metric records to the experiment trackers RL users watch (wandb, TensorBoard, MLflow), through
accelerate's tracker classes; the JSONL metrics stay the source of truth.

    legorl train samples.jsonl --model M --out ckpt --metrics m.jsonl --report-to tensorboard
    WANDB_MODE=offline legorl loop --out runs/loop --report-to wandb,tensorboard

Each record goes to every tracker as ``SOURCE/NAME`` (``train/loss``, ``loop/reward_mean``)
against its own step axis (``SOURCE/step``): the trainer counts optimizer steps, the loop
iterations. A tracker whose package is missing is refused before any work, in one line.
``follow_metrics`` feeds a tracker from growing JSONL files (the loop's run folder).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from legorl.records import Metric

#: --report-to name -> the package it needs.
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


class TrackerError(ValueError):
    """A --report-to value that cannot be served (unknown tracker, package not installed)."""


def parse_report_to(values: Sequence[str] | None) -> list[str]:
    """Tracker names from ``--report-to`` values (repeated or comma-separated; ``none`` = no
    tracker), each checked to be known and importable."""
    names: list[str] = []
    for value in values or []:
        for name in (n.strip().lower() for n in value.split(",")):
            if not name or name == "none" or name in names:
                continue
            if name not in TRACKERS:
                raise TrackerError(
                    f"--report-to {name}: unknown tracker (known: {', '.join(TRACKERS)}, none)"
                )
            package = TRACKERS[name]
            if importlib.util.find_spec(package) is None:
                raise TrackerError(
                    f"--report-to {name}: the {package!r} package is not installed "
                    f"(pip install {package})"
                )
            names.append(name)
    return names


class Reporter:
    """Sends Metric records to trackers, one ``log`` per (source, step): a step's records
    arrive together, so each is held until a record of another step comes (or ``close``)."""

    def __init__(
        self, names: Sequence[str], *, run_name: str, logging_dir: Path, config: dict[str, Any]
    ) -> None:
        self.names = list(names)
        self.trackers = [_start(n, run_name, logging_dir) for n in self.names]
        hparams = {k: v for k, v in config.items() if isinstance(v, (bool, int, float, str))}
        for tracker in self.trackers:
            tracker.store_init_configuration(hparams)
        self._pending: dict[str, Any] = {}
        self._at: tuple[str, int] | None = None
        self._axes: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, metric: Metric) -> None:
        with self._lock:
            at = (metric.source, metric.step)
            if at != self._at:
                self._flush()
                self._at = at
            if metric.value is not None:
                self._pending[f"{metric.source}/{metric.name}"] = metric.value

    def _flush(self) -> None:
        if self._at is None or not self._pending:
            return
        source, step = self._at
        for name, tracker in zip(self.names, self.trackers, strict=True):
            if name == "wandb":
                run = tracker.tracker
                if source not in self._axes:  # each source on its own step axis
                    run.define_metric(f"{source}/step")
                    run.define_metric(f"{source}/*", step_metric=f"{source}/step")
                run.log({**self._pending, f"{source}/step": step})
            else:
                tracker.log(self._pending, step=step)
        self._axes.add(source)
        self._pending = {}

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._at = None
            for tracker in self.trackers:
                tracker.finish()


def _start(name: str, run_name: str, logging_dir: Path) -> Any:
    from accelerate import PartialState, tracking

    PartialState()  # the trackers log through accelerate's logger, which needs its state
    logging_dir.mkdir(parents=True, exist_ok=True)
    tracker: Any
    if name == "tensorboard":
        tracker = tracking.TensorBoardTracker(run_name, logging_dir)
    elif name == "wandb":
        tracker = tracking.WandBTracker(run_name, dir=str(logging_dir))
    else:
        tracker = tracking.MLflowTracker(run_name, logging_dir=str(logging_dir))
    tracker.start()
    return tracker


def follow_metrics(
    folder: Path, patterns: Iterable[str], reporter: Reporter, stop: threading.Event, every: float
) -> None:
    """Send the Metric records appended to the files ``patterns`` find under ``folder`` until
    ``stop`` is set, then once more (run in a thread beside the loop)."""
    from legorl.inspect.follow import FileFollower

    followers: dict[Path, FileFollower] = {}
    patterns = list(patterns)
    while True:
        last = stop.is_set()
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                followers.setdefault(path, FileFollower(path))
        for follower in followers.values():
            for line in follower.poll():
                if isinstance(line.record, Metric):
                    reporter(line.record)
        if last:
            return
        stop.wait(every)
