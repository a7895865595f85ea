"""The gold record: what the task's gold patch's runs recorded, the expectation every candidate
of that task is judged against (`assertions.py`). Recorded once per task and grader version,
in two judged runs of the gold patch and one of the empty patch, each in a fresh grading
sandbox of its own, then the gold patch's ordinary run (`ordinary.py`), and cached on disk.

    record = await store.get(task, record_run)   # record_run(inproc) -> GoldRun

Run 1 strips every literal and holds the tables' expected items (when a required test then
fails, run 1 is made again with that test's tables as written); a site whose operands did not
cross as plain data there runs in process in run 2 (and in every candidate's run). Values the
two runs agree on are pinned; a test whose event sequence differs between them is unstable
(its sequence is not enforced). The empty patch's run, planned as run 2, tells which events a
fix must change (`assertions.decisive`), and so which required tests can be covered.

The gold record is also the environment's control grading: when the gold patch does not pass
its own required tests here, the task cannot be graded in this environment and a candidate's
reward is null (``GoldRecord.ok`` False, with the reason).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from legorl.records import Task
from legorl.verify import assertions
from legorl.verify.ordinary import OrdinaryRun

HERE = Path(__file__).resolve().parent
#: The grading switches (`runner.DEFENCES`) that change what the gold record's runs are.
PLAN_SWITCHES = frozenset({"held_tables", "onward"})
_GRADER_FILES = (
    "assertions.py",
    "rewrite.py",
    "operands.py",
    "bootstrap.py",
    "runner.py",
    "gold.py",
    "tree.py",
    "ordinary.py",
    "pytest_report.py",
    "unittest_report.py",
    "audit.py",
    "parsers.py",
    "specs.py",
)


@dataclass(slots=True)
class GoldRun:
    """One judged run of the gold patch."""

    ok: bool  # the run happened and every required test passed in process
    reason: str = ""
    sources: dict[str, str] = field(default_factory=dict)  # pristine test files it planned from
    records: list[dict[str, Any]] = field(default_factory=list)  # the stream's assertion records
    failing: list[str] = field(default_factory=list)  # functions of the tests that did not pass


class Recorder(Protocol):
    """One judged run of the gold patch (of the empty patch with ``empty``), planned with
    ``inproc``, ``sources`` and ``untabled``; the gold patch's assertions judged against
    ``previous`` (this record's earlier run), when there is one. An empty patch's run is ok
    when it ran, whatever its tests did."""

    def __call__(
        self,
        inproc: set[str],
        sources: dict[str, str] | None,
        untabled: frozenset[str],
        previous: list[list[dict[str, Any]]],
        *,
        empty: bool = False,
    ) -> Awaitable[GoldRun]: ...


@dataclass(slots=True)
class GoldRecord:
    ok: bool
    reason: str
    sources: dict[str, str]
    inproc: list[str]  # sites judged in process (not plain data for the gold patch)
    runs: list[list[dict[str, Any]]]
    untabled: list[str] = field(default_factory=list)  # functions whose tables stay as written
    empty: list[dict[str, Any]] | None = None  # the empty patch's run, planned as run 2
    #: required tests the gold patch passes in its ordinary run (`ordinary.py`), which a
    #: candidate's ordinary run must pass too
    ordinary: list[str] = field(default_factory=list)
    #: the exit status of the gold patch's ordinary run (0: every test it ran passed)
    ordinary_exit: int | None = None

    def gold(self) -> assertions.Gold:
        return assertions.Gold(
            runs=[assertions.by_test(r) for r in self.runs],
            empty=assertions.by_test(self.empty) if self.empty is not None else None,
        )


#: The sandbox's code that decides what a graded run sees (its root, its user, its limits):
#: a gold record made before it changed is not the same environment's (round 56: a record
#: made where the gold passed, kept after the judged root lost the time-zone files, turned
#: every right patch to 0 where its control should have said null).
_SANDBOX_FILES = (
    "common.py",
    "docker_backend.py",
    "local_backend.py",
    "memory_root.py",
    "seccomp.py",
    "view.py",
    "tree_probe.py",
)


def grader_version() -> str:
    digest = hashlib.sha256()
    for name in _GRADER_FILES:
        digest.update((HERE / name).read_bytes())
    for name in _SANDBOX_FILES:
        digest.update((HERE.parent / "sandbox" / name).read_bytes())
    return digest.hexdigest()[:16]


def task_key(task: Task, backend: str, off: frozenset[str] = frozenset()) -> str:
    fields = {
        "id": task.instance_id,
        "patch": task.patch,
        "test_patch": task.test_patch,
        "tests": [task.FAIL_TO_PASS, task.PASS_TO_PASS],
        "cmd": task.test_cmd,
        "parser": task.log_parser,
        "image": task.image,
        "env": asdict(task.env) if task.env else None,
        "base": task.base_commit,
        "grader": grader_version(),
        "backend": backend,
        "off": sorted(off & PLAN_SWITCHES),  # a control's switch that changes the plan
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def _assertion_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") in ("a", "tb", "te", "ws", "w")]


class GoldStore:
    """Gold records by task, in memory and under ``root`` (one JSON file each)."""

    def __init__(self, root: Path | None = None, backend: str = "") -> None:
        if root is None:
            from legorl.sandbox.common import cache_root

            root = cache_root() / "gold"
        self.root = root
        self.backend = backend
        self._memory: dict[str, GoldRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _load(self, key: str) -> GoldRecord | None:
        try:
            data = json.loads(self._path(key).read_text())
            return GoldRecord(**data)
        except (OSError, ValueError, TypeError):
            return None

    def _save(self, key: str, record: GoldRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self._path(key))

    async def get(
        self,
        task: Task,
        record_run: Recorder,
        off: frozenset[str] = frozenset(),
        ordinary: Callable[[], Awaitable[OrdinaryRun]] | None = None,
    ) -> GoldRecord:
        """The task's gold record, recorded with ``record_run(inproc, sources)`` (and the gold
        patch's ordinary run, ``ordinary()``) when missing."""
        key = task_key(task, self.backend, off)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            found = self._memory.get(key) or self._load(key)
            if found is None:
                found = await self._record(task, record_run, ordinary)
                if not found.ok:
                    return found  # a failure is this moment's: the next grading records again
                self._save(key, found)
            self._memory[key] = found
            return found

    async def _record(
        self,
        task: Task,
        record_run: Recorder,
        ordinary: Callable[[], Awaitable[OrdinaryRun]] | None,
    ) -> GoldRecord:
        if not task.patch.strip():
            return GoldRecord(False, "the task has no gold patch", {}, [], [])
        untabled: frozenset[str] = frozenset()
        for _attempt in range(3):
            first = await record_run(set(), None, untabled, [])
            if not first.ok and first.failing and not set(first.failing) <= untabled:
                # A test computed with a table item the judge held: its tables stay as written.
                untabled |= frozenset(first.failing)
                continue
            if not first.ok:
                return GoldRecord(
                    False,
                    f"the gold patch does not pass here: {first.reason}",
                    first.sources,
                    [],
                    [],
                )
            runs = [_assertion_records(first.records)]
            unplain = assertions.unplain_handles(assertions.by_test(runs[0]))
            if not unplain <= untabled:
                # A held item beside an operand that is not plain data cannot be judged
                # anywhere: those rows stay as written.
                untabled |= unplain
                continue
            inproc = assertions.nonplain_sites([assertions.by_test(runs[0])])
            second = await record_run(inproc, first.sources, untabled, runs)
            if not second.ok and second.failing and not set(second.failing) <= untabled:
                untabled |= frozenset(second.failing)
                continue
            if not second.ok:
                return GoldRecord(
                    False,
                    f"the gold patch does not pass here: {second.reason}",
                    first.sources,
                    sorted(inproc),
                    [],
                )
            runs.append(_assertion_records(second.records))
            break
        else:
            return GoldRecord(False, "the gold record did not settle in three tries", {}, [], [])
        # The empty patch's run, planned as run 2: what it reproduces a fix need not change.
        empty = await record_run(inproc, first.sources, untabled, runs, empty=True)
        if not empty.ok:
            return GoldRecord(
                False, f"the empty patch's run failed here: {empty.reason}", first.sources, [], []
            )
        passes: list[str] = []
        exit_code = None
        if ordinary is not None:
            plain = await ordinary()
            # A run cut short is no record of what the gold patch's run passes: kept, it would
            # hold no candidate to anything for the task (round 50, read).
            why = plain.error or (plain.timed_out and "it did not finish in time")
            if why:
                return GoldRecord(
                    False, f"the gold patch's ordinary run failed here: {why}", {}, [], []
                )
            passes, exit_code = sorted(plain.passed), plain.exit_code
        return GoldRecord(
            True,
            "",
            first.sources,
            sorted(inproc),
            runs,
            sorted(untabled),
            _assertion_records(empty.records),
            passes,
            exit_code,
        )
