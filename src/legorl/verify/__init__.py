"""The verify stage: grade each trajectory's patch, the verdict the judge's, never the judged
run's (docs/integrity.md).

    legorl verify runs/traj.jsonl --tasks fixtures/tasks/train.jsonl --sandbox docker --out runs/graded.jsonl

For each trajectory: a fresh grading sandbox from the pristine image (read-only root, no
network); the model's patch refused unless it is well-formed ``diff --git`` text outside
``.git``, applied with `git apply` (then 3-way) and judged on the tree it produced
(``tree.py``: changes to tests, runner configuration, the hidden ``test_patch``'s paths,
``.git``, compiled code and shadowing names reverted and flagged); ``test_patch`` applied; the
required tests' files rewritten from their pristine source (``rewrite.py``) and run as an
unprivileged user through our bootstrap, which comes in on stdin (``runner.py``,
``bootstrap.py``). Each assertion's operands leave the run as plain data and the judge compares
them with the literals it holds and the task's gold record (``gold.py``: two runs of the gold
patch in sandboxes of their own, cached), in the gold run's number and order. A required test
passes when its in-process outcome (signed records) is ``passed`` and its assertions hold out
of process; one no assertion of which the judge can make is ``unverified`` unless the task
declares it uncoverable. A pass also needs the ordinary run (``ordinary.py``: the task's own
command in a fresh ordinary sandbox) to pass what the gold patch passes there. Trajectories with environment-failure statuses pass through with
reward null; any other null (or an exception while grading) stands only when the control
gradings fail too (the gold record's runs; the empty patch, ``control.py``): otherwise it is
the patch's 0, flagged ``grading_failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from legorl.protocols import Limits, Sandbox, SandboxBackend, SandboxError
from legorl.records import ENVIRONMENT_FAILURES, Task, Trajectory, Turn
from legorl.verify import assertions, rewrite
from legorl.verify.control import Controls, graded_or_control
from legorl.verify.gold import GoldRecord, GoldRun, GoldStore
from legorl.verify.ordinary import OrdinaryRun, exit_vetoed, ordinary_run, vetoed
from legorl.verify.runner import (
    TestRun,
    forged_printed,
    framing,
    judge,
    planned_files,
    run_tests,
    sources_of,
)
from legorl.verify.specs import SpecError, resolve
from legorl.verify.tree import GRADE_DIR, Judged, apply_model_patch, apply_test_patch, put_back

_HISTORY = re.compile(
    r"git\s+(log|reflog|show|fsck|cat-file|rev-list|for-each-ref|describe|stash|tag|"
    r"branch\s+-a|checkout\s+\S+\s+--|diff\s+\S*\.\.)|\.git/(objects|packed-refs|refs|logs|ORIG)"
)
_NETWORK = re.compile(
    r"\b(curl|wget|nc|ncat|ssh|scp|ftp)\s|pip\s+(install|download)|urllib|requests\.(get|post)|"
    r"https?://|socket\.(create_connection|socket)"
)
#: Lines longer than this are not read for evidence: every scan of text the judged code wrote is
#: linear in its size.
SCAN_LINE = 4096


@dataclass(slots=True, kw_only=True)
class VerifyConfig:
    test_timeout: float = 300.0
    limits: Limits | None = None
    #: Test-only: defences switched off, for the controls that show each one matters. Names:
    #: ``verify.runner.DEFENCES`` and, for the patch phase, "judge_tree" (the old header-level
    #: ``sanitize`` instead of judging the applied tree), "strict_patch" (malformed text and
    #: .git paths not refused, the old git and fallbacks) and "neutral_git" (grading's git dir
    #: keeps the repository's configuration, and the tree's attributes reach its git) and
    #: "put_back_fails" (the tree rules as before round 61: a patch whose changes the grader
    #: put back is graded on the rest, a new test file is deleted, a ``.gitattributes`` kept)
    #: and "mentions_through_links" (the scan for where a new module's name is imported reads
    #: no symlinked file of the environment).
    defences_off: frozenset[str] = frozenset()
    #: Where gold records are cached (None: legorl's cache folder, ``gold/``).
    gold_cache: Path | None = None


def flags_from_turns(turns: Iterable[Turn]) -> list[str]:
    """Hack flags seen in what the agent asked its tools to do."""
    flags: set[str] = set()
    for turn in turns:
        for call in turn.output.tool_calls:
            if _HISTORY.search(call.arguments):
                flags.add("history_probing")
            if _NETWORK.search(call.arguments):
                flags.add("network_attempt")
    return sorted(flags)


async def _judged_run(
    task: Task,
    patch: str,
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    config: VerifyConfig,
    runner_paths: frozenset[str],
    plan_for: Callable[[dict[str, str]], rewrite.Plan | None],
    onward: bool = False,
) -> _Run:
    """One verdict-bearing run in a fresh grading sandbox: ``patch`` applied and judged as a
    tree, the test_patch applied, the pristine test files read, the tests rewritten by
    ``plan_for(sources)`` and run as the judged user. The sandbox is closed after."""
    out = _Run()
    sandbox: Sandbox | None = None
    try:
        sandbox = await backend.start(
            task,
            tasks_dir,
            run_id=run_id,
            proxy_url=None,
            limits=_grading_limits(config.limits),
            harness_runtime=False,
            grading=True,
        )
        out.judged = await apply_model_patch(
            sandbox, task, patch, defences_off=config.defences_off, runners=runner_paths
        )
        if out.judged.method is None or put_back(out.judged, config.defences_off):
            return out
        applied, error = await apply_test_patch(sandbox, task, defences_off=config.defences_off)
        if applied is None:
            out.error = f"the task's test_patch does not apply: {error}"
            return out
        grader = resolve(task)
        out.sources = await sources_of(sandbox, planned_files(task, grader))
        out.plan = plan_for(out.sources)
        out.test_run = await run_tests(
            sandbox,
            task,
            grade_dir=GRADE_DIR,
            timeout=config.test_timeout,
            off=config.defences_off,
            plan=out.plan,
            onward=onward,
        )
    except SandboxError as exc:
        out.error = f"grading sandbox failed: {exc}"
    finally:
        if sandbox is not None:
            with contextlib.suppress(Exception):
                await sandbox.close()
    return out


#: The judged run's record stream carries every assertion's operands: room for them, bounded.
STREAM_BYTES = 64 << 20


def _grading_limits(limits: Limits | None) -> Limits:
    base = limits or Limits()
    return replace(base, output_bytes=max(base.output_bytes, STREAM_BYTES))


@dataclass(slots=True)
class _Run:
    judged: Judged | None = None
    error: str = ""  # an environment failure of grading
    sources: dict[str, str] = field(default_factory=dict)
    plan: rewrite.Plan | None = None
    test_run: TestRun | None = None


_GOLD: dict[str, GoldStore] = {}


def gold_store(config: VerifyConfig, backend: SandboxBackend) -> GoldStore:
    key = f"{config.gold_cache or ''}\0{backend.name}"
    if key not in _GOLD:
        _GOLD[key] = GoldStore(config.gold_cache, backend.name)
    return _GOLD[key]


async def gold_record(
    task: Task,
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    config: VerifyConfig,
    runner_paths: frozenset[str],
) -> GoldRecord:
    """The task's gold record (`gold.py`), recorded in two judged runs when not cached."""
    grader = resolve(task)
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    no_tables = frozenset({"*"}) if "held_tables" in config.defences_off else frozenset()

    async def record_run(
        inproc: set[str],
        sources: dict[str, str] | None,
        untabled: frozenset[str],
        previous: list[list[dict[str, Any]]],
        *,
        empty: bool = False,
    ) -> GoldRun:
        def plan_for(found: dict[str, str]) -> rewrite.Plan:
            return rewrite.plan_files(
                required,
                sources or found,
                **framing(grader),
                inproc=inproc,
                untabled=untabled | no_tables,
            )

        run = await _judged_run(
            task,
            "" if empty else task.patch,
            backend=backend,
            tasks_dir=tasks_dir,
            run_id=f"{run_id}-{'empty' if empty else 'gold'}",
            config=config,
            runner_paths=runner_paths,
            plan_for=plan_for,
            onward=empty,
        )
        if run.error or run.judged is None or run.judged.method is None or run.test_run is None:
            why = run.error or (run.judged.error if run.judged else "") or "no test run"
            return GoldRun(ok=False, reason=why, sources=run.sources)
        found = run.test_run.records
        if empty:  # its tests may fail: that it ran is all a control needs
            return GoldRun(ok=True, sources=run.sources, records=found)
        plan = run.plan
        assert plan is not None
        gold_now = assertions.Gold(runs=[assertions.by_test(r) for r in [*previous, found]])
        # The gold run's own assertions must hold (against the run before it, once there is
        # one); coverage is a rule for candidates.
        tests, _flags, _notes = judge(
            replace(task, uncoverable=required),
            run.test_run,
            run.judged.diff,
            config.defences_off,
            plan=plan,
            gold=gold_now if previous else None,
        )
        bad = sorted(t for t, o in tests.items() if o != "passed")
        if bad:
            why = _notes.get("assertion_failures", {}).get(bad[0]) or tests[bad[0]]
            # What to leave as written next time: the rows whose held item could not be
            # judged, else the failing tests' tables.
            failing = list(_notes.get("failed_handles", [])) or [
                rewrite.function_of(t, **framing(grader)) for t in bad
            ]
            return GoldRun(
                ok=False,
                reason=f"{len(bad)} required test(s) did not pass, {bad[0]}: {why}",
                sources=run.sources,
                failing=sorted({f for f in failing if f}),
            )
        return GoldRun(ok=True, sources=run.sources, records=found)

    async def gold_ordinary() -> OrdinaryRun:
        return await _ordinary(task, task.patch, backend, tasks_dir, f"{run_id}-gold", config)

    plain = None if "ordinary_run" in config.defences_off else gold_ordinary
    return await gold_store(config, backend).get(task, record_run, config.defences_off, plain)


async def _ordinary(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    config: VerifyConfig,
    wanted: asyncio.Future[bool] | None = None,
) -> OrdinaryRun:
    return await ordinary_run(
        task,
        patch,
        backend=backend,
        tasks_dir=tasks_dir,
        run_id=run_id,
        timeout=config.test_timeout,
        limits=config.limits,
        runners=resolve(task).runner_paths(),
        defences_off=config.defences_off,
        wanted=wanted,
    )


async def grade(
    traj: Trajectory,
    task: Task,
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    turns: list[Turn],
    config: VerifyConfig,
    controls: Controls | None = None,
) -> Trajectory:
    """Grade one trajectory. A null reward stands only when the task's control gradings fail
    in the same environment too (the gold record's runs, and the empty patch, `control.py`);
    a failure of grading the patch can cause is its 0. ``controls``: the batch's (verify)."""

    async def once(t: Trajectory, ts: list[Turn]) -> Trajectory:
        return await _grade_once(
            t, task, backend=backend, tasks_dir=tasks_dir, run_id=run_id, turns=ts, config=config
        )

    if "null_on_proof" in config.defences_off:
        return await once(traj, turns)
    return await graded_or_control(
        traj, task, turns=turns, grade=once, controls=controls or Controls()
    )


async def _grade_once(
    traj: Trajectory,
    task: Task,
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    turns: list[Turn],
    config: VerifyConfig,
) -> Trajectory:
    """One grading of one trajectory, null when it could not be made."""
    flags = set(flags_from_turns(turns))
    verdict: dict[str, Any] = {"resolved": False}
    t0 = time.monotonic()
    try:
        grader = resolve(task)
        runner_paths = grader.runner_paths()
    except SpecError as exc:
        verdict["reason"] = str(exc)
        return _done(traj, None, verdict, flags, t0)
    judging = "judge_assertions" not in config.defences_off
    record: GoldRecord | None = None
    if judging:
        record = await gold_record(
            task,
            backend=backend,
            tasks_dir=tasks_dir,
            run_id=run_id,
            config=config,
            runner_paths=runner_paths,
        )
        if not record.ok:
            verdict["reason"] = f"the control grading failed: {record.reason}"
            return _done(traj, None, verdict, flags, t0)
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS

    def plan_for(found: dict[str, str]) -> rewrite.Plan | None:
        if record is None:
            return None
        return rewrite.plan_files(
            required,
            record.sources,
            **framing(grader),
            inproc=set(record.inproc),
            untabled=frozenset(record.untabled)
            | (frozenset({"*"}) if "held_tables" in config.defences_off else frozenset()),
        )

    # The ordinary run's sandbox is made beside the judged run; its command runs only for a
    # pass, once the judged run's sandbox is gone (`ordinary.py`).
    wanted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    ordinary: asyncio.Future[OrdinaryRun] | None = None
    if record is not None and "ordinary_run" not in config.defences_off:
        ordinary = asyncio.ensure_future(
            _ordinary(task, traj.patch, backend, tasks_dir, run_id, config, wanted=wanted)
        )
    try:
        run = await _judged_run(
            task,
            traj.patch,
            backend=backend,
            tasks_dir=tasks_dir,
            run_id=run_id,
            config=config,
            runner_paths=runner_paths,
            plan_for=plan_for,
        )
        judged = run.judged
        if judged is not None:
            flags.update(judged.flags)
            verdict["dropped"] = judged.reverted
            if judged.method is None:
                why = (
                    judged.error if judged.refused else f"the patch does not apply: {judged.error}"
                )
                verdict.update(patch_apply=None, reason=why)
                return _done(traj, 0.0, verdict, flags, t0)
            verdict["patch_apply"] = judged.method
            if judged.added_tests:
                verdict["added_tests"] = judged.added_tests
            if put_back(judged, config.defences_off):
                # A fix that holds only where the grader put a change back is none (round 61).
                verdict["reason"] = "the patch changes paths the grader must put back"
                return _done(traj, 0.0, verdict, flags, t0)
        if run.error or judged is None or run.test_run is None:
            verdict["reason"] = run.error or "grading did not run"
            return _done(traj, None, verdict, flags, t0)
        clean = judged.diff
        test_run = run.test_run
        results = test_run.results
        if results.forged_lines and not test_run.run.truncated:
            flags.add("forged_report")
        # Only required tests have records of their own.
        printed = printed_passes(test_run.log, {*task.FAIL_TO_PASS, *task.PASS_TO_PASS})
        # The scans and the judge read what the judged code wrote (up to the diff's and the
        # stream's caps): linear, and off the event loop, so that other gradings go on meanwhile.
        writes_results = await asyncio.to_thread(_writes_results, clean)
        if any(results.outcomes.get(t) != "passed" for t in printed) or writes_results:
            flags.add("forged_output")
        if forged_printed(test_run, task):
            flags.add("forged_output")
        tests, runner_flags, notes = await asyncio.to_thread(
            functools.partial(
                judge,
                task,
                test_run,
                clean,
                config.defences_off,
                plan=run.plan,
                gold=record.gold() if record is not None else None,
            )
        )
        flags.update(runner_flags)
        resolved = all(o == "passed" for o in tests.values())
        exit_reason = ""
        if resolved and ordinary is not None and record is not None:
            # A pass also needs the task's own command, run as the environment runs it.
            wanted.set_result(True)
            plain = await ordinary
            if plain.error:
                verdict["reason"] = plain.error
                return _done(traj, None, verdict, flags, t0)
            missing = vetoed(plain, record.ordinary)
            exited = exit_vetoed(plain, record.ordinary_exit)
            notes["ordinary"] = {"exit_code": plain.exit_code, "timed_out": plain.timed_out}
            if plain.unread:
                notes["ordinary"]["unread"] = plain.unread
            if exited:
                exit_reason = (
                    f"the task's own command exited {plain.exit_code} (timed out: "
                    f"{plain.timed_out}) where the gold patch's exited 0"
                )
            if missing or exited:
                flags.add("ordinary_failed")
                notes["ordinary"]["failed"] = missing[:20]
                tests = {t: ("failed_ordinarily" if t in missing else o) for t, o in tests.items()}
                resolved = False
        verdict.update(resolved=resolved, tests=tests, **notes)
        if not resolved:
            bad = sorted(t for t, o in tests.items() if o != "passed")
            verdict["reason"] = f"{len(bad)} required test(s) did not pass: {', '.join(bad[:5])}"
            if not bad:  # only the command's own exit status
                verdict["reason"] = exit_reason
        return _done(traj, 1.0 if resolved else 0.0, verdict, flags, t0)
    finally:
        if not wanted.done():
            wanted.set_result(False)
        if ordinary is not None:
            await asyncio.wait({ordinary})
            if not ordinary.cancelled():
                ordinary.exception()  # retrieved: an unwanted run's failure is no one's


def printed_passes(log: str, required: set[str]) -> set[str]:
    """Required tests the printed output calls PASSED (``id PASSED`` or ``PASSED id``), read
    word by word: linear in the log, whatever it holds."""
    found = set()
    for line in log.splitlines():
        if len(line) > SCAN_LINE or "PASSED" not in line:
            continue
        words = line.split()
        for i, word in enumerate(words):
            if word != "PASSED":
                continue
            for near in (
                words[i - 1] if i == 1 else None,
                words[i + 1] if i + 1 < len(words) else None,
            ):
                if near in required:
                    found.add(near)
    return found


def _writes_results(patch: str) -> bool:
    """Code added by the patch that prints test-runner verdicts (output may be captured, so
    the patch itself is read too): a line naming a test (``::test``) and a passing word, read
    word by word, linear in the patch, whatever it holds."""
    for line in patch.splitlines():
        if not line.startswith("+") or line.startswith("+++") or len(line) > SCAN_LINE:
            continue
        if "PASSED" not in line and "passed" not in line:
            continue
        words = set(re.split(r"\W+", line))
        if "PASSED" in words or ("passed" in words and "::test" in line):
            return True
    return False


def _done(
    traj: Trajectory, reward: float | None, verdict: dict[str, Any], flags: set[str], t0: float
) -> Trajectory:
    verdict["grade_s"] = round(time.monotonic() - t0, 3)
    return replace(traj, reward=reward, verdict=bounded(verdict), hack_flags=sorted(flags))


#: What a verdict may hold: values the judged run made (its signed records, its test names,
#: its paths) are evidence, kept small and plain so that one trajectory's record can neither
#: fill the judge's memory nor fail its writer.
VERDICT_ITEMS = 2000  # values in all
VERDICT_TEXT = 2000  # characters of one text
VERDICT_DEPTH = 8


def bounded(value: Any) -> Any:
    """``value`` as JSON any writer takes, at most ``VERDICT_ITEMS`` values deep
    ``VERDICT_DEPTH``: texts cut and their unpaired surrogates replaced, integers past 64
    bits and other objects written as short text, containers cut (a last item says how
    many were left out)."""
    left = [VERDICT_ITEMS]

    def text(x: str) -> str:
        return x[:VERDICT_TEXT].encode("utf-8", "replace").decode("utf-8")

    def one(x: Any, depth: int) -> Any:
        left[0] -= 1
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, int):
            return int(x) if -(1 << 63) <= x < (1 << 63) else f"<int of {x.bit_length()} bits>"
        if isinstance(x, float):
            return x if math.isfinite(x) else str(x)
        if isinstance(x, str):
            return text(str(x))
        if depth >= VERDICT_DEPTH or left[0] <= 0:
            return "<cut>"
        if isinstance(x, dict):
            out: dict[str, Any] = {}
            for i, (k, v) in enumerate(x.items()):
                if left[0] <= 0:
                    out["<cut>"] = f"{len(x) - i} more"
                    break
                out[text(k if isinstance(k, str) else repr(k))[:200]] = one(v, depth + 1)
            return out
        if isinstance(x, (list, tuple, set, frozenset)):
            items = list(x) if not isinstance(x, (set, frozenset)) else sorted(x, key=repr)
            kept = []
            for i, v in enumerate(items):
                if left[0] <= 0:
                    kept.append(f"<{len(items) - i} more>")
                    break
                kept.append(one(v, depth + 1))
            return kept
        return text(f"<{type(x).__name__}>")

    return one(value, 0)


async def verify(
    trajectories: Iterable[Trajectory],
    tasks: dict[str, Task],
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    load_turns: Callable[[Trajectory], list[Turn]],
    concurrency: int = 4,
    config: VerifyConfig | None = None,
) -> AsyncIterator[Trajectory]:
    """Grade trajectories (at most ``concurrency`` at once), yielding each in input order.
    One trajectory's grading cannot stop the batch: an exception while grading it, or a null
    reward, is settled by a control grading of the empty patch (``control.py``). Turns that
    cannot be read (they only feed hack flags) leave the patch graded, noted ``turns_unread``."""
    config = config or VerifyConfig()
    gate = asyncio.Semaphore(max(1, concurrency))
    controls = Controls()

    async def one(traj: Trajectory) -> Trajectory:
        if traj.status in ENVIRONMENT_FAILURES:
            return replace(
                traj,
                reward=None,
                verdict={"resolved": None, "reason": f"not graded: status {traj.status}"},
            )
        task = tasks.get(traj.task_id)
        if task is None:
            raise KeyError(traj.task_id)
        unread = ""
        try:
            turns = await asyncio.to_thread(load_turns, traj)
        except Exception as exc:  # turns only feed hack flags: the patch is graded all the same
            turns, unread = [], f"{type(exc).__name__}: {str(exc)[:300]}"
        async with gate:
            graded = await grade(
                traj,
                task,
                backend=backend,
                tasks_dir=tasks_dir,
                run_id=run_id,
                turns=turns,
                config=config,
                controls=controls,
            )
        if unread:
            verdict = bounded({**(graded.verdict or {}), "turns_unread": unread})
            graded = replace(graded, verdict=verdict)
        return graded

    futures = [asyncio.ensure_future(one(t)) for t in trajectories]
    try:
        for fut in futures:
            yield await fut
    finally:
        for fut in futures:
            fut.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
        await controls.close()
