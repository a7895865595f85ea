"""The test phase of grading: one judged run of the task's tests, its signed record stream read
out of the exec output, and the verdict: each required test's in-process outcome and, above
all, its assertions judged out of process (`assertions.py`).

    legorl verify runs/traj.jsonl --tasks … --out runs/graded.jsonl   (grade() calls this)

The run is judged, not trusted. It executes as an unprivileged user in a grading sandbox whose
root file system is read-only (`SandboxBackend.start(grading=True)`, `Sandbox.exec(judged=
True)`); the grader's own code comes in on stdin (`bootstrap.py`), and grading's files in the
sandbox are root's alone (mode 0700). The required tests' files have been rewritten so that the
run's assertions send operands out instead of comparing them.

Defences, each switched off for a control by naming it in ``VerifyConfig.defences_off``:
``judge_assertions`` (off: the tests run as written and the in-process outcomes alone decide),
``own_verdicts`` (off: the judge takes the judged process's own verdict at any site),
``held_tables`` (off: a table-driven test's expected column stays in the file), ``judged_user``
(off: the tests run as root, who can read grading's folder), ``null_on_proof`` (off: a grading
failure is null without a control grading, `control.py`),
``isolated_runner`` (off: ``python -m pytest -p legorl_pytest_report`` from the repository root,
the plugin looked up by name), ``integrity`` (the guard's ``tampered`` records), ``exit_code``
(the sandbox's real exit code against the outcomes and the signed finish), ``audit_pytest`` (the
in-process audit hook, `audit.py`), ``xfail_is_failure`` (an expected failure of a unittest
test is not a pass), ``unittest_stream`` (off: a unittest-based runner is graded from its
printed output alone, as the official harness grades it), ``ordinary_run`` (off: a pass needs
no ordinary run of the task's own command, `ordinary.py`), ``pinned_containers`` (off: a
membership's computed container, and a raised message checked for a text, need not equal the
gold run's), ``onward`` (off: the gold record's run of the empty patch stops a test at its first
failed assertion, and the judge counts every later one as a secret whole), ``pinned_calls``
(off: what the callables a test hands its truth check's call did, raised or returned, need not
be what they did in the gold run), ``paired_tests`` (off: a test's end record need not carry
its begin's token), ``own_call`` (off: the callable a truth check's call is handed beside an
exception class is watched while the helper calls it, as the helper likes, instead of called
first by the sender), ``own_builtins`` (off: the grader's modules in the judged process look
names up in the builtins the code under test can rebind, not a private copy),
``operand_classes`` (off: an operand holding objects of a class not built in, read as their
base type's data, need not hold only the classes the gold run's held there),
``quiet_sender`` (off: the judged process's trace and profile functions, monitoring callbacks
and signal handlers stay set while the operand sender packs and sends a record), ``c_sender``
(off: the sender, hushed, reads and sets signal handlers through ``signal``'s Python wrappers,
which look names up in a module the judged process can change, instead of ``_signal``'s C
functions).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from legorl.protocols import ExecResult, Sandbox, SandboxError
from legorl.records import Task
from legorl.verify import assertions, rewrite
from legorl.verify.parsers import PytestReportParser, TestResults, records
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects
from legorl.verify.specs import Grader, parse_capped, resolve, test_files

HERE = Path(__file__).resolve().parent
DEFENCES = frozenset(
    {
        "judge_assertions",
        "own_verdicts",
        "decisive_secrets",
        "unpublished_secrets",
        "held_tables",
        "judged_user",
        "null_on_proof",
        "isolated_runner",
        "integrity",
        "exit_code",
        "audit_pytest",
        "xfail_is_failure",
        "unittest_stream",
        "ordinary_run",
        "pinned_containers",
        "onward",
        "pinned_calls",
        "paired_tests",
        "own_call",
        "own_builtins",
        "operand_classes",
        "quiet_sender",
        "c_sender",
    }
)
_EXTRA = ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", "."]
#: The grader modules the judged run gets on stdin.
BUNDLE = ("bootstrap.py", "pytest_report.py", "unittest_report.py", "audit.py", "operands.py")
#: Reads the key and the bundle from stdin, then runs the bootstrap from memory, with a private
#: copy of the builtins taken before any repository code runs (`bootstrap._load`).
LOADER = (
    "import sys, json\n"
    "key = sys.stdin.buffer.readline().strip()\n"
    "bundle = json.loads(sys.stdin.buffer.read())\n"
    "space = {'__name__': '_legorl_boot', '__builtins__': dict(vars(__import__('builtins')))}\n"
    "exec(compile(bundle['modules']['bootstrap.py'], '<legorl bootstrap.py>', 'exec'), space)\n"
    "space['main'](key, bundle)\n"
)
LOG_CAP = 1 << 20  # the tail of the run's printed output read back (evidence only)


def pytest_args(task: Task) -> list[str] | None:
    """The task's pytest arguments, or None when its test command is not pytest."""
    cmd = task.test_cmd.strip()
    for prefix in ("python -m pytest", "pytest"):
        if cmd == prefix or cmd.startswith(prefix + " "):
            return shlex.split(cmd[len(prefix) :])
    return None


def _test_command(task: Task, grader: Grader, off: frozenset[str]) -> str:
    if grader.kind == "output":
        argv = shlex.split(grader.command)
        if "judge_assertions" in off or not argv or argv[0] in ("python", "python3"):
            return grader.command
        script = argv[0].removeprefix("./")
        return _python(["-c", LOADER, "script", "--", script, *argv[1:]])
    if grader.kind == "unittest":
        argv = shlex.split(grader.command)
        if argv and argv[0] in ("python", "python3"):
            argv = argv[1:]
        return _python(["-c", LOADER, "unittest", "--", *argv])
    # Our plugin, and nothing from the repository's own pytest options.
    args = pytest_args(replace(task, test_cmd=grader.command))
    if args is None:
        return grader.command
    if "isolated_runner" in off:
        return shlex.join(["python", "-m", "pytest", "-p", "legorl_pytest_report", *_EXTRA, *args])
    tail = [*_EXTRA, "--import-mode=append", *args]
    return _python(["-c", LOADER, "pytest", "--", *tail])


def _python(args: list[str]) -> str:
    """The judged interpreter's command line: isolated, writing no bytecode. It reads the
    environment's own caches (the image's, read-only) and none of the repository's, which
    sealing removed (`_seal`)."""
    return f"python -I -B {shlex.join(args)}"


@dataclass(slots=True)
class TestRun:
    run: ExecResult
    results: TestResults
    log: str  # what the run printed (the code under test could write it too)
    grader: Grader | None = None
    #: The official parser's reading of the printed output (test name -> its status word).
    parsed: dict[str, str] = field(default_factory=dict)
    parse_error: str | None = None  # why the official parser gave no reading (a cap)
    #: The stream's assertion events by test key (`assertions.by_test`), and their records.
    events: dict[str, assertions.TestEvents] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)


def _bundle(options: dict[str, Any]) -> bytes:
    modules = {name: (HERE / name).read_text() for name in BUNDLE}
    return json.dumps({"modules": modules, "options": options}).encode()


async def sources_of(sandbox: Sandbox, paths: list[str]) -> dict[str, str]:
    """The pristine text of test files (read before any repository code runs)."""
    out = {}
    for path in paths:
        try:
            data = await sandbox.read_file(path)
        except (FileNotFoundError, IsADirectoryError, SandboxError):
            continue
        if len(data) <= 4 << 20:
            out[path] = data.decode("utf-8", "replace")
    return out


async def _seal(sandbox: Sandbox, grade_dir: str, plan: rewrite.Plan | None) -> None:
    """The rewritten test files in place, the repository's bytecode caches removed (the
    judged run writes none and so reads none of it), and grading's own folder root's alone,
    in one command (a tar of the files on stdin)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in (plan.files if plan is not None else {}).items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    repo = shlex.quote(sandbox.workdir)
    script = (
        f"tar -x -C {repo} -f - && find {repo} -name __pycache__ -type d -prune -exec rm -rf {{}} +"
        f" && chmod -R go-rwx {shlex.quote(grade_dir)}"
    )
    result = await sandbox.exec(["sh", "-c", script], timeout=60, stdin=buf.getvalue())
    if result.exit_code != 0:
        raise SandboxError(f"grading: sealing {grade_dir} failed: {result.output[-200:]}")


async def run_tests(
    sandbox: Sandbox,
    task: Task,
    *,
    grade_dir: str,
    timeout: float,
    off: frozenset[str],
    plan: rewrite.Plan | None,
    onward: bool = False,
) -> TestRun:
    """Run the task's tests once, as the judged user; the outcomes as the signed stream says
    (or, for a runner that only prints, as the official parser reads its output), and the
    assertion events. ``onward``: the empty patch's run of a gold record, whose required tests
    go on past a failed assertion (`operands.onward`)."""
    grader = resolve(task)
    if grader.kind == "unittest" and "unittest_stream" in off:
        grader = replace(grader, kind="output")
    key = secrets.token_hex(16)
    tag = secrets.token_hex(4)
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    log = f"/tmp/legorl-run-{tag}.log"
    await _seal(sandbox, grade_dir, plan if "judge_assertions" not in off else None)
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    stdin = (key + "\n").encode() + _bundle(
        {
            "integrity": "integrity" not in off,
            "audit": "audit_pytest" not in off,
            "xfail_passes": "xfail_is_failure" in off,
            "watch": required,
            "log": log,
            "judge": "judge_assertions" not in off,
            "onward": onward and "onward" not in off,
            "own_call": "own_call" not in off,
            "quiet_sender": "quiet_sender" not in off,
            "c_sender": "c_sender" not in off,
            "own_builtins": "own_builtins" not in off,
        }
    )
    if "isolated_runner" in off and grader.kind == "pytest":
        put = "mkdir -p /tmp/legorl-legacy && cat > /tmp/legorl-legacy/legorl_pytest_report.py"
        await sandbox.exec(
            ["sh", "-c", put], timeout=60, stdin=(HERE / "pytest_report.py").read_bytes()
        )
        env.update(PYTHONPATH="/tmp/legorl-legacy", LEGORL_REPORT="fd")
        env["LEGORL_INTEGRITY"] = "0" if "integrity" in off else "1"
        stdin = (key + "\n").encode()
    command = _test_command(task, grader, off)
    through_bootstrap = shlex.quote(LOADER) in command
    run = await sandbox.exec(
        ["sh", "-c", command],
        timeout=timeout,
        cwd=sandbox.workdir,
        env=env,
        stdin=stdin if through_bootstrap or "isolated_runner" in off else None,
        judged="judged_user" not in off,
    )
    # Through the bootstrap the run's output is its record stream, read as bytes below (as
    # text, a stream of 64 MiB with one four-byte character in it took 256 MB, round 55),
    # and what the tests printed is the log's tail.
    printed = await _tail(sandbox, log) if through_bootstrap else run.output
    parsed, parse_error = await _parse_printed(grader, printed, task)
    # Read once, and every reading of it off the event loop: the stream is what the judged run
    # wrote (up to its cap); decoding its operands took 9 s of the loop (round 9).
    found, forged = await asyncio.to_thread(records, run.data, key.encode())
    if grader.kind == "output":
        results = _from_printed(parsed, task)
    else:
        results = await asyncio.to_thread(PytestReportParser().read, found, forged)
    return TestRun(
        run=run,
        results=results,
        log=printed,
        grader=grader,
        parsed=parsed,
        parse_error=parse_error,
        events=await asyncio.to_thread(
            functools.partial(assertions.by_test, paired="paired_tests" not in off), found
        ),
        records=[r for r in found if r.get("event") in ("a", "tb", "te", "ws", "w")],
    )


#: Reads the last N bytes of a regular file, never waiting: opened non-blocking, no link
#: followed, its kind checked on the open file (round 20: the judged user put a named pipe at
#: the log's path, and ``tail`` waited a minute on it).
_TAIL = (
    "import os, stat, sys\n"
    "p, n = sys.argv[1], int(sys.argv[2])\n"
    "try:\n"
    "    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)\n"
    "except OSError:\n"
    "    sys.exit(0)\n"
    "st = os.fstat(fd)\n"
    "if not stat.S_ISREG(st.st_mode):\n"
    "    sys.exit(0)\n"
    "os.lseek(fd, max(0, st.st_size - n), 0)\n"
    "out = b''\n"
    "while len(out) < n:\n"
    "    chunk = os.read(fd, n - len(out))\n"
    "    if not chunk:\n"
    "        break\n"
    "    out += chunk\n"
    "sys.stdout.buffer.write(out)\n"
)


async def _tail(sandbox: Sandbox, path: str) -> str:
    """The last ``LOG_CAP`` bytes of a file the run wrote, read through a bounded command
    (`_TAIL`)."""
    result = await sandbox.exec(
        ["python", "-I", "-S", "-B", "-c", _TAIL, path, str(LOG_CAP)], timeout=60
    )
    return result.output[-LOG_CAP:]


async def _parse_printed(
    grader: Grader, printed: str, task: Task
) -> tuple[dict[str, str], str | None]:
    """The official parser's reading of what the run printed, capped (`specs.parse_capped`)."""
    if grader.parser is None:
        return {}, None
    return await parse_capped(grader.parser, printed, task)


#: The official parsers' status words, as legorl's outcomes (an expected failure passes there).
STATUS = {"PASSED": "passed", "XFAIL": "passed", "FAILED": "failed", "ERROR": "error"}


def _from_printed(parsed: dict[str, str], task: Task) -> TestResults:
    """Outcomes read from printed output only: whatever the run printed decides them, so the
    exit code is the check."""
    results = TestResults(finished=bool(parsed))  # nothing read: the run never got going
    for name, status in parsed.items():
        results.outcomes[name] = STATUS.get(status, "skipped")
    required = {*task.FAIL_TO_PASS, *task.PASS_TO_PASS}
    results.others_failed = sum(
        o in ("failed", "error") for n, o in results.outcomes.items() if n not in required
    )
    return results


def forged_printed(test_run: TestRun, task: Task) -> list[str]:
    """Required tests the printed output calls passed that the signed records do not."""
    if test_run.grader is None or test_run.grader.kind == "output":
        return []
    required = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
    return [
        t
        for t in required
        if STATUS.get(test_run.parsed.get(t, "")) == "passed"
        and test_run.results.outcomes.get(t) != "passed"
    ]


def is_django(grader: Grader) -> bool:
    return grader.kind == "unittest" and grader.runner == "tests/runtests.py"


def framing(grader: Grader) -> dict[str, bool]:
    """How required test names are spelled for `rewrite.locate`."""
    return {"django": is_django(grader), "pytest": grader.kind == "pytest"}


def planned_files(task: Task, grader: Grader) -> list[str]:
    """The test files the judge rewrites: those defining a required test by its name, and
    the test_patch's Python files (where a bare test name is looked up)."""
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    named = rewrite.needed_files(required, **framing(grader))
    return sorted({*named, *(f for f in test_files(task) if f.endswith(".py"))})


def judge(
    task: Task,
    test_run: TestRun,
    patch: str,
    off: frozenset[str],
    *,
    plan: rewrite.Plan | None = None,
    gold: assertions.Gold | None = None,
) -> tuple[dict[str, str], set[str], dict[str, Any]]:
    """Required outcomes (anything short of a clean, consistent pass is not ``passed``), the
    flags raised, and the verdict's runner fields."""
    run, results = test_run.run, test_run.results
    flags: set[str] = set()
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    tests = {t: results.outcomes.get(t, "missing") for t in required}
    if run.timed_out:
        tests = {t: ("timeout" if o == "missing" else o) for t, o in tests.items()}
    notes: dict[str, Any] = {}
    problems: list[str] = []
    grader = test_run.grader
    printed_only = grader is not None and grader.kind == "output"
    if test_run.parse_error:
        notes["parser"] = test_run.parse_error
    if grader is not None and printed_only:
        flags.add("output_parsed")
        notes["graded_from"] = f"printed output ({grader.parser})"
    if not results.finished and not printed_only:
        problems.append("the runner's record stream ended before its finish record")
    if results.tampered and "integrity" not in off:
        flags.add("runner_tampered")
        notes["tampered"] = results.tampered[0].get("what", [])
        problems.append("the runner was changed in-process")
    if "exit_code" not in off and run.exit_code is not None:
        failing = (
            bool(results.collect_errors)
            or results.others_failed > 0
            or any(o in ("failed", "error") for o in results.outcomes.values())
        )
        if (
            (results.exitstatus is not None and results.exitstatus != run.exit_code)
            or (run.exit_code == 0 and failing)
            or (run.exit_code != 0 and results.finished and not failing)
        ):
            flags.add("runner_tampered")
            problems.append(
                f"exit code {run.exit_code} disagrees with the outcomes "
                f"(signed exit status {results.exitstatus})"
            )
    if results.shadowed:
        flags.add("runner_shadowed")
        notes["shadowed"] = results.shadowed
    suspects = runner_tamper_suspects(patch, task)
    if suspects:
        flags.add("runner_tamper_suspect")
        notes["runner_tamper_suspect"] = suspects[:10]
    if constant_comparisons(patch):
        flags.add("constant_comparison")
    if problems:
        notes["runner_problems"] = problems
        tests = {t: ("untrusted" if o == "passed" else o) for t, o in tests.items()}
    if "judge_assertions" not in off and plan is not None and gold is not None:
        tests = _judge_assertions(task, test_run, tests, plan, gold, flags, notes, off)
    notes.update(
        exit_code=run.exit_code,
        timed_out=run.timed_out,
        runner_finished=results.finished,
        collect_errors=results.collect_errors,
    )
    return tests, flags, notes


def _judge_assertions(
    task: Task,
    test_run: TestRun,
    tests: dict[str, str],
    plan: rewrite.Plan,
    gold: assertions.Gold,
    flags: set[str],
    notes: dict[str, Any],
    off: frozenset[str],
) -> dict[str, str]:
    """Each required test's assertions, judged here; the in-process outcome must agree."""
    covered = assertions.covered_tests(
        plan,
        gold,
        set(task.FAIL_TO_PASS),
        secrets="decisive_secrets" not in off,
        public=task.problem_statement if "unpublished_secrets" not in off else "",
    )
    declared = set(task.uncoverable)
    out = dict(tests)
    why: dict[str, str] = {}
    in_process: list[str] = []  # tests with an assertion (or all of them) judged in process
    handles: list[str] = []  # table handles at failed events
    counts = {"fail_to_pass": [0, 0], "pass_to_pass": [0, 0]}  # [judged out, all events]
    for test in task.FAIL_TO_PASS + task.PASS_TO_PASS:
        group = "fail_to_pass" if test in task.FAIL_TO_PASS else "pass_to_pass"
        key = plan.keys.get(test)
        if not covered.get(test) and test not in declared:
            flags.add("unverified")
            why[test] = (
                "none of the assertions a fix must change is judged out of process against a secret"
                if test in task.FAIL_TO_PASS and "decisive_secrets" not in off
                else "no assertion of it is judged out of process"
            )
            out[test] = "unverified"
            continue
        if key is None:  # declared, and its function is not in the pristine source
            in_process.append(test)
            continue
        # A declared test is carried by the in-process outcome, but its events are still
        # judged: the judge's sites never fail in the judged process, so only here can they.
        verdict = assertions.judge_test(
            key,
            test_run.events,
            plan,
            gold,
            bool(covered.get(test)),
            own_verdicts="own_verdicts" in off,
            pin_in="pinned_containers" not in off,
            pin_calls="pinned_calls" not in off,
            pin_classes="operand_classes" not in off,
        )
        counts[group][0] += verdict.judged_out
        counts[group][1] += verdict.judged_out + verdict.judged_in
        if verdict.judged_in or not covered.get(test):
            in_process.append(test)
        if verdict.outcome != "passed":
            why[test] = verdict.detail
            handles.extend(verdict.handles)
            if out[test] == "passed":
                out[test] = "failed" if verdict.outcome in ("failed", "raised") else verdict.outcome
    notes["assertions"] = {
        group: {"judged_out_of_process": n, "events": total} for group, (n, total) in counts.items()
    }
    if why:
        notes["assertion_failures"] = dict(list(why.items())[:10])
    if in_process:
        notes["judged_in_process"] = in_process[:20]
    if handles:
        notes["failed_handles"] = sorted(set(handles))
    return out
