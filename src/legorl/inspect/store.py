"""What the viewer knows: every record read so far, indexed, plus the queries the screens ask.

    store = RunStore()
    store.add(record, source=Path("runs/graded.jsonl"))
    rows = store.rows(query="status:ok reward>0 -hack:any", sort="reward", reverse=True)

A trajectory seen twice (rollout's record, then verify's graded one) keeps its first place and
takes the latest content. Turn records read directly (a run's folder being followed) show
their session as a ``running`` row until its trajectory record arrives; only counts are kept
for them, and the detail view reads the turn file when opened.

The query language, one term per word (all must hold):

* ``word``: in the trajectory id, task, harness, status or hack flags;
* ``task:x`` ``harness:x`` ``status:x`` ``group:x`` ``id:x``: that field contains x
  (``status:running`` for sessions still going);
* ``hack:any`` / ``hack:none`` / ``hack:NAME``;
* ``reward>0.5``, ``turns>=3``, ``tokens<1000``, ``prompt>…`` (also ``<=``, ``=``);
  ``reward=none`` matches ungraded runs;
* ``-term`` negates a term.
"""

from __future__ import annotations

import math
import operator
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.monitors import Monitor, prob_pearson
from legorl.records import (
    ENVIRONMENT_FAILURES,
    Alert,
    Metric,
    Record,
    RecordError,
    Sample,
    TrainerLogprobs,
    Trajectory,
    Turn,
    read_jsonl,
)

#: "order" is arrival order; the rest are the list's columns.
SORT_KEYS = (
    "order",
    "task",
    "harness",
    "status",
    "reward",
    "hack",
    "turns",
    "prompt",
    "tokens",
    "id",
)


@dataclass(slots=True)
class TrajEntry:
    traj: Trajectory
    source: Path  # the file it was read from: turns_ref are relative to its folder
    order: int  # first arrival
    updates: int = 0
    # A session known only from its turn file (a run still going): ``traj`` is a placeholder
    # holding its id and token counts, ``source`` is the turn file.
    running: bool = False
    live_turns: int = 0

    @property
    def status(self) -> str:
        return "running" if self.running else self.traj.status


@dataclass(slots=True)
class SampleEntry:
    sample: Sample
    source: Path
    order: int


@dataclass(slots=True)
class Series:
    """One metric's values by step (the latest value of a step wins)."""

    name: str
    by_step: dict[int, float | None] = field(default_factory=dict)

    def points(self) -> list[tuple[int, float]]:
        return sorted((s, v) for s, v in self.by_step.items() if v is not None and math.isfinite(v))


class RunStore:
    def __init__(self) -> None:
        self.trajectories: dict[str, TrajEntry] = {}
        self.samples: dict[str, SampleEntry] = {}
        self.trainer_logprobs: dict[str, TrainerLogprobs] = {}
        self.metrics: dict[str, Series] = {}
        self.recorded_alerts: list[Alert] = []  # read from alerts.jsonl files
        self.monitor = Monitor(stream=None)  # alerts computed here over what is read
        self.errors: list[RecordError] = []
        self.counts: dict[str, int] = {}
        self.version = 0  # bumped on every change; screens redraw when it moves
        self._turn_counts: dict[tuple[str, int, float], int] = {}
        # Series derived from trajectories, by arrival: crash rate and reward (rolling).
        self.derived: dict[str, Series] = {
            "runs: crash rate": Series("runs: crash rate"),
            "runs: reward (mean of 20)": Series("runs: reward (mean of 20)"),
        }
        self._recent_rewards: deque[float] = deque(maxlen=20)

    # ---- ingest -------------------------------------------------------------------------

    def add(self, record: Record, source: Path) -> None:
        kind = type(record).__name__
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.version += 1
        if isinstance(record, Trajectory):
            self._add_trajectory(record, source)
        elif isinstance(record, Sample):
            entry = self.samples.get(record.sample_id)
            order = entry.order if entry else len(self.samples)
            self.samples[record.sample_id] = SampleEntry(record, source, order)
        elif isinstance(record, Metric):
            series = self.metrics.setdefault(record.name, Series(record.name))
            series.by_step[record.step] = record.value
            self.monitor.observe_metric(record)
        elif isinstance(record, TrainerLogprobs):
            self.trainer_logprobs[record.sample_id] = record
        elif isinstance(record, Alert):
            self.recorded_alerts.append(record)
        elif isinstance(record, Turn):
            self._add_turn(record, source)

    def add_error(self, error: RecordError) -> None:
        self.errors.append(error)
        self.version += 1

    def _add_turn(self, turn: Turn, source: Path) -> None:
        # A turn file read directly (a folder being followed): its session is shown as a
        # running trajectory until the trajectory record arrives. Only counts are kept.
        root = turn.parent_session or turn.session.split("~", 1)[0]
        entry = self.trajectories.get(root)
        if entry is not None and not entry.running:
            return
        if entry is None:
            placeholder = Trajectory(
                trajectory_id=root,
                task_id="",
                group_id="",
                sample_index=0,
                harness="",
                status="ok",
            )
            entry = TrajEntry(placeholder, source, len(self.trajectories), running=True)
            self.trajectories[root] = entry
        entry.live_turns += 1
        entry.traj.tokens.prompt += turn.prompt_len
        entry.traj.tokens.completion += len(turn.completion_ids)

    def _add_trajectory(self, traj: Trajectory, source: Path) -> None:
        self.monitor.observe_trajectory(traj)  # counts each trajectory id once
        old = self.trajectories.get(traj.trajectory_id)
        if old is not None and old.running:  # the run ended: its record takes the place
            old.traj, old.source, old.running = traj, source, False
            self.derived["runs: crash rate"].by_step[self._finished()] = self.monitor.crash_rate
            if traj.reward is not None:
                self._add_reward(traj.reward)
            return
        if old is not None and traj.reward is None and old.traj.reward is not None:
            return  # the graded record (a later stage) of this run was read first: keep it
        graded_now = traj.reward is not None and (old is None or old.traj.reward is None)
        if old is not None:
            old.traj, old.source, old.updates = traj, source, old.updates + 1
        else:
            self.trajectories[traj.trajectory_id] = TrajEntry(traj, source, len(self.trajectories))
            self.derived["runs: crash rate"].by_step[self._finished()] = self.monitor.crash_rate
        if graded_now:
            assert traj.reward is not None
            self._add_reward(traj.reward)

    def _finished(self) -> int:
        return sum(1 for e in self.trajectories.values() if not e.running)

    def _add_reward(self, reward: float) -> None:
        self._recent_rewards.append(reward)
        rewards = self.derived["runs: reward (mean of 20)"]
        rewards.by_step[len(rewards.by_step) + 1] = sum(self._recent_rewards) / len(
            self._recent_rewards
        )

    @property
    def alerts(self) -> list[tuple[str, Alert]]:
        """(source, alert): recorded ones from files, then the ones computed while reading."""
        seen = {(a.kind, a.step, a.trajectory_id) for a in self.recorded_alerts}
        return [("recorded", a) for a in self.recorded_alerts] + [
            ("computed", a)
            for a in self.monitor.alerts
            if (a.kind, a.step, a.trajectory_id) not in seen
        ]

    # ---- trajectories -------------------------------------------------------------------

    def turn_count(self, entry: TrajEntry) -> int:
        if entry.running:
            return entry.live_turns
        traj = entry.traj
        if traj.turns is not None:
            return len(traj.turns)
        total = 0
        for ref in traj.turns_ref or ():
            path = entry.source.parent / ref
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (str(path), st.st_size, st.st_mtime)
            if key not in self._turn_counts:
                with open(path, "rb") as fh:
                    self._turn_counts[key] = sum(1 for line in fh if line.strip())
            total += self._turn_counts[key]
        return total

    def turns_of(self, trajectory_id: str) -> tuple[list[Turn], list[str]]:
        """The trajectory's turns in call order, and problems met reading them."""
        entry = self.trajectories.get(trajectory_id)
        if entry is None:
            return [], [f"no trajectory {trajectory_id!r}"]
        if entry.running:  # read its turn file now; a line still being written is skipped
            reader = read_jsonl(entry.source, Turn, skip_bad=True)
            live = [
                t
                for t in reader
                if (t.parent_session or t.session.split("~", 1)[0]) == trajectory_id
            ]
            return live, []
        traj = entry.traj
        if traj.turns is not None:
            return list(traj.turns), []
        turns: list[Turn] = []
        problems = []
        for ref in traj.turns_ref or ():
            path = entry.source.parent / ref
            if not path.is_file():
                problems.append(f"turns_ref {ref}: no such file ({path})")
                continue
            reader = read_jsonl(path, Turn, skip_bad=True)
            turns.extend(reader)
            problems += [str(e) for e in reader.errors]
        return turns, problems

    def samples_of(self, trajectory_id: str) -> list[Sample]:
        return [
            e.sample
            for e in sorted(self.samples.values(), key=lambda e: e.order)
            if e.sample.episode_id == trajectory_id
        ]

    def _sort_value(self, entry: TrajEntry, key: str) -> Any:
        t = entry.traj
        if key == "order":
            return entry.order
        if key == "task":
            return t.task_id
        if key == "harness":
            return t.harness
        if key == "status":
            return entry.status
        if key == "reward":
            return -math.inf if t.reward is None else t.reward
        if key == "hack":
            return len(t.hack_flags)
        if key == "turns":
            return self.turn_count(entry)
        if key == "prompt":
            return t.tokens.prompt
        if key == "tokens":
            return t.tokens.completion
        if key == "id":
            return t.trajectory_id
        raise ValueError(f"unknown sort key {key!r} (known: {', '.join(SORT_KEYS)})")

    def rows(self, query: str = "", sort: str = "order", reverse: bool = False) -> list[TrajEntry]:
        match = compile_query(query, self)
        rows = [e for e in self.trajectories.values() if match(e)]
        # Rows arrive in order; a stable sort (reverse too) keeps ties in arrival order.
        rows.sort(key=lambda e: self._sort_value(e, sort), reverse=reverse)
        return rows

    # ---- samples ------------------------------------------------------------------------

    def sample_rows(self) -> list[SampleEntry]:
        return sorted(self.samples.values(), key=lambda e: e.order)

    def correlation_of(self, sample_id: str) -> float | None:
        entry, side = self.samples.get(sample_id), self.trainer_logprobs.get(sample_id)
        if entry is None or side is None:
            return None
        if len(side.logprobs) != len(entry.sample.rollout_logprobs):
            return None
        return prob_pearson(entry.sample.rollout_logprobs, side.logprobs)

    def series(self) -> list[Series]:
        """Metric series by name, then the ones derived from trajectories (when any)."""
        out = [self.metrics[k] for k in sorted(self.metrics)]
        if self.trajectories:
            out += list(self.derived.values())
        return out


# --------------------------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
}
_FIELDS: dict[str, Callable[[TrajEntry], str]] = {
    "task": lambda e: e.traj.task_id,
    "harness": lambda e: e.traj.harness,
    "status": lambda e: e.status,
    "group": lambda e: e.traj.group_id,
    "id": lambda e: e.traj.trajectory_id,
}
_NUMERIC = ("reward", "turns", "tokens", "prompt")


class QueryError(ValueError):
    pass


def compile_query(query: str, store: RunStore | None = None) -> Callable[[TrajEntry], bool]:
    """A predicate over ``TrajEntry`` for a query (see the module docstring); ``QueryError``
    for a term it cannot read."""
    terms = [_term(word, store) for word in query.split()]
    return lambda entry: all(term(entry) for term in terms)


def _term(word: str, store: RunStore | None) -> Callable[[TrajEntry], bool]:
    if word.startswith("-") and len(word) > 1:
        inner = _term(word[1:], store)
        return lambda e: not inner(e)
    low = word.lower()
    for name in _NUMERIC:
        if low.startswith(name) and low[len(name) : len(name) + 1] in ("<", ">", "="):
            rest = low[len(name) :]
            op = next(o for o in _OPS if rest.startswith(o))
            value_text = rest[len(op) :]
            return _numeric(name, op, value_text, store)
    key, sep, value = low.partition(":")
    if sep and key in _FIELDS:
        get = _FIELDS[key]
        return lambda e: value in get(e).lower()
    if sep and key == "hack":
        if value in ("any", "yes", "true"):
            return lambda e: bool(e.traj.hack_flags)
        if value in ("none", "no", "false"):
            return lambda e: not e.traj.hack_flags
        return lambda e: any(value in f.lower() for f in e.traj.hack_flags)
    if sep and key in ("env", "crash"):
        want = value in ("yes", "true", "any")
        return lambda e: (e.status in ENVIRONMENT_FAILURES) == want
    if sep:
        raise QueryError(
            f"unknown field {key!r} (use {', '.join([*_FIELDS, 'hack'])} or {', '.join(_NUMERIC)})"
        )

    def anywhere(e: TrajEntry) -> bool:
        t = e.traj
        hay = " ".join([t.trajectory_id, t.task_id, t.harness, e.status, *t.hack_flags]).lower()
        return low in hay

    return anywhere


def _numeric(
    name: str, op: str, value_text: str, store: RunStore | None
) -> Callable[[TrajEntry], bool]:
    compare = _OPS[op]
    if value_text in ("none", "null"):
        if name != "reward" or op != "=":
            raise QueryError(f"{name}{op}{value_text}: only reward=none is allowed")
        return lambda e: e.traj.reward is None
    try:
        target = float(value_text)
    except ValueError:
        raise QueryError(f"{name}{op}{value_text}: {value_text!r} is not a number") from None

    def value(e: TrajEntry) -> float | None:
        t = e.traj
        if name == "reward":
            return t.reward
        if name == "tokens":
            return t.tokens.completion
        if name == "prompt":
            return t.tokens.prompt
        return store.turn_count(e) if store is not None else len(t.turns or [])

    def test(e: TrajEntry) -> bool:
        v = value(e)
        return v is not None and compare(v, target)

    return test
