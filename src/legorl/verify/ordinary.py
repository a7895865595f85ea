"""The ordinary run: the task's own test command, run as the task's environment runs it, whose
outcome a pass also needs. ``grade()`` starts it beside the judged run and settles ``wanted``
once the judge has spoken: True, and its command runs and is read; False, and its sandbox is
closed with the command never run:

    run = await ordinary_run(task, patch, backend=…, tasks_dir=…, run_id=…, config=…,
                             runners=…, wanted=verdict_future)
    failing = vetoed(run.passed, record.ordinary)   # required tests the gold passes here, not it

The judged run (`runner.py`) is recognisable to code that looks: through our bootstrap, with
the tests rewritten. A patch can fix the bug only there and keep it everywhere else. The
ordinary run closes that: a fresh sandbox from the pristine image, the tests as the test_patch
wrote them, the command as the task gives it, nothing of ours in the process. A required test
the gold patch passes in its ordinary run must pass in the candidate's too.

Its code runs as the judged run's does, and nothing it can do is more: a grading sandbox
(`SandboxBackend.start(grading=True)`: the root read-only, the repository and /tmp size- and
inode-capped tmpfs, open files capped; round 30: with a writable root it filled the host's
disk) and the unprivileged judged user (`exec(judged=True)`: rounds 35 and 36, the image's
root shares host root's per-user kernel limits). The user and the read-only root are then no
tell of the judged run.

The ordinary run can only take a pass away, never give one: its outcomes are read from what
it printed (pytest's ``-rA`` summary, unittest's verbose lines, or the task's official parser,
capped), which the code under test could forge, so a forgery there gains nothing the judged
run has not already granted. Its command runs only for a candidate the judged run passed, after
the judged run's sandbox is gone: the ordinary run holds the tests as written, literals and all,
and no process of the patch's that can see them may run while the judged run does (round 41:
on the local backend the two runs of one grading shared the judged user's kernel keyring, and
an ordinary run that overlapped the judged run handed it the test's expected values). Only its
sandbox's start and the patches' steps, where none of the patch's code runs, overlap the judged
run.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from legorl.protocols import Limits, Sandbox, SandboxBackend, SandboxError
from legorl.records import Task
from legorl.verify.specs import Grader, parse_capped, resolve
from legorl.verify.tree import apply_model_patch, apply_test_patch

#: Lines longer than this are not read (a reading linear in what the run printed).
LINE = 4096
#: Status words of pytest's summary lines and unittest's verbose lines, as outcomes.
#: What a status word of the printed output means. An expected failure is no pass (round 48:
#: a patch marked the required test expected to fail everywhere but the judged run, through
#: pytest's and unittest's own means, and its failure was read as a pass), as in the judged run.
_PYTEST = {"PASSED": "passed", "XFAIL": "xfailed", "FAILED": "failed", "ERROR": "error"}
_UNITTEST = {"ok": "passed", "expected failure": "xfailed", "FAIL": "failed", "ERROR": "error"}


@dataclass(slots=True)
class OrdinaryRun:
    """What the task's own command printed, read as required test -> outcome."""

    outcomes: dict[str, str] = field(default_factory=dict)
    error: str = ""  # the run could not be made (an environment failure of grading)
    unread: str = ""  # why what it printed gave no reading (a parser's cap: the run's doing)
    exit_code: int | None = None
    timed_out: bool = False
    stopped: bool = False  # not wanted: its command never ran

    @property
    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == "passed"}


def read_pytest(log: str, required: set[str]) -> dict[str, str]:
    """Required tests' outcomes from pytest's ``-rA`` summary (``PASSED id``) and verbose
    lines (``id PASSED``); a test read both ways is not passed."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        if len(line) > LINE:
            continue
        words = line.split()
        for i, word in enumerate(words):
            status = _PYTEST.get(word)
            if status is None:
                continue
            for near in (
                words[i + 1] if i == 0 and len(words) > 1 else None,
                words[i - 1] if i else None,
            ):
                if near in required:
                    _note(out, near, status)
    return out


def read_unittest(log: str, required: set[str]) -> dict[str, str]:
    """Required tests' outcomes from unittest's verbose lines (``name (id) ... ok``), where a
    task names a test as the line does. A test with a docstring is described on two lines,
    its name alone and then the docstring's first line (``name (id)``, ``Doc line. ... ok``):
    the outcome is the named test's (round 47: such a test was never read, so the ordinary
    run could not take its pass away)."""
    out: dict[str, str] = {}
    named = None  # the line before, when it is a required test's name and nothing else
    for line in log.splitlines():
        if len(line) > LINE:
            named = None
            continue
        if " ... " not in line:
            named = line.strip() if line.strip() in required else None
            continue
        name, _, status = line.rpartition(" ... ")
        test = name.strip() if name.strip() in required else named
        named = None
        outcome = _UNITTEST.get(status.strip())
        if outcome is not None and test is not None:
            _note(out, test, outcome)
    return out


def _note(out: dict[str, str], test: str, status: str) -> None:
    if out.get(test, "passed") == "passed":  # any other word read for it stands
        out[test] = status


async def read(grader: Grader, log: str, task: Task) -> tuple[dict[str, str], str | None]:
    """The required tests' outcomes the ordinary run printed: the task's official parser when
    it has one (capped, `specs.parse_capped`), unittest's own lines read beside it, else
    pytest's or unittest's own lines."""
    required = {*task.FAIL_TO_PASS, *task.PASS_TO_PASS}
    if grader.parser is not None:
        parsed, error = await parse_capped(grader.parser, log, task)
        words = {"PASSED": "passed", "XFAIL": "xfailed", "FAILED": "failed", "ERROR": "error"}
        out = {t: words.get(s, "skipped") for t, s in parsed.items() if t in required}
        if grader.kind == "unittest":  # Django's parser reads no two-line description
            for test, outcome in read_unittest(log, required).items():
                _note(out, test, outcome)
        return out, error
    if grader.kind == "pytest":
        return read_pytest(log, required), None
    return read_unittest(log, required), None


async def ordinary_run(
    task: Task,
    patch: str,
    *,
    backend: SandboxBackend,
    tasks_dir: str,
    run_id: str,
    timeout: float,
    limits: Limits | None,
    runners: frozenset[str],
    defences_off: frozenset[str] = frozenset(),
    wanted: asyncio.Future[bool] | None = None,
) -> OrdinaryRun:
    """The task's own command on ``patch`` (judged as a tree the same way) and its test_patch,
    in a fresh ordinary sandbox, read back; the sandbox is closed after. ``wanted``: the
    sandbox is made and the patches applied meanwhile (no code of the patch's runs in those
    steps), and the command runs only once it settles True; False, and the run stops at its
    next step and comes back ``stopped`` (a step is never cut short: a start cut short would
    leave its container behind)."""
    out = OrdinaryRun()
    sandbox: Sandbox | None = None

    def unwanted() -> bool:
        out.stopped = wanted is not None and wanted.done() and not wanted.result()
        return out.stopped

    try:
        grader = resolve(task)
        sandbox = await backend.start(
            task,
            tasks_dir,
            run_id=f"{run_id}-ordinary",
            proxy_url=None,
            limits=limits,
            grading=True,
        )
        if unwanted():
            return out
        judged = await apply_model_patch(
            sandbox, task, patch, defences_off=defences_off, runners=runners
        )
        if judged.method is None:  # it applied for the judged run: this run's failure
            out.error = f"the patch does not apply: {judged.error}"
            return out
        if unwanted():
            return out
        applied, error = await apply_test_patch(sandbox, task, defences_off=defences_off)
        if applied is None:
            out.error = f"the task's test_patch does not apply: {error}"
            return out
        if wanted is not None:
            await wanted  # the judged run's code has ended: nothing of this run reaches it
        if unwanted():
            return out
        # As the environment runs it: Python reads the image's bytecode caches (compiling the
        # environment afresh under a private prefix cost about 0.4 s a run). It reads no
        # cache the patch made: the tree judge reverts compiled files, and a source the patch
        # changed no longer matches its pristine cache.
        plain = ["env", "-u", "PYTHONPYCACHEPREFIX", "sh", "-c", grader.command]
        run = await sandbox.exec(plain, timeout=timeout, cwd=sandbox.workdir, judged=True)
        out.exit_code, out.timed_out = run.exit_code, run.timed_out
        out.outcomes, unread = await read(grader, run.output, task)
        out.unread = unread or ""
    except SandboxError as exc:
        out.error = f"the ordinary run's sandbox failed: {exc}"
    finally:
        if sandbox is not None:
            with contextlib.suppress(Exception):
                await sandbox.close()
    return out


def vetoed(candidate: OrdinaryRun, gold_passes: list[str]) -> list[str]:
    """The required tests the gold patch's ordinary run passes and the candidate's does not."""
    return [t for t in gold_passes if t not in candidate.passed]


def exit_vetoed(candidate: OrdinaryRun, gold_exit: int | None) -> bool:
    """Whether the task's command failed (or never finished) for the candidate where it
    succeeded for the gold patch: the runner's own verdict on every test it ran, which no
    reading of its lines can miss (round 48: a required test's failure printed where neither
    reader tied it to the test)."""
    return gold_exit == 0 and candidate.exit_code != 0
