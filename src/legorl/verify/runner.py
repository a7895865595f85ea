"""The test phase of grading: launch the task's tests through our bootstrap, read the signed
record stream out of the exec output, run the FAIL_TO_PASS tests again in the independent
runner (with their twins), and judge it all into outcomes and flags.

    legorl verify runs/traj.jsonl --tasks … --out runs/graded.jsonl   (grade() calls this)

Defences, each switched off for a control by naming it in ``VerifyConfig.defences_off``:
``isolated_runner`` (off: ``python -m pytest -p legorl_pytest_report`` from the repository
root, the plugin looked up by name), ``stream`` (off: records go to a report file that is read
afterwards), ``integrity`` (the guard's ``tampered`` records), ``exit_code`` (the sandbox's real
exit code against the outcomes and the signed finish), ``differential`` (FAIL_TO_PASS passed by
pytest must pass in the independent runner), ``twin`` (a FAIL_TO_PASS test whose comparisons also
hold against an impossible value gets ``always_equal``), ``audit`` (the independent runner's audit hook
that keeps the signer out of the test code's reach, `plainrun.audit`), ``audit_pytest`` (the
narrower one in the pytest run), ``ctypes_absent`` (the independent runner cannot import
``_ctypes``, whose pointers read and write memory with no audit event), ``xfail_is_failure``
(an expected failure of a unittest test is not a pass, in the recorder and the independent
runner: the code under test can mark it so), ``unittest_stream``
(off: a unittest-based runner is graded from its printed output alone, as the official harness
grades it).

The run under the task's own runner cannot keep its signer from the code under test: pytest and
Django's runner need frames, and a frame, a closure (``unittest.TestCase.run.__closure__``) or
ctypes reaches it. What that run signs is trusted only as far as the independent runner, where
frames, object walks and ``_ctypes`` are out of reach, agrees: every FAIL_TO_PASS test it can
run must pass there.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from legorl.protocols import ExecResult, Sandbox, SandboxError
from legorl.records import Task
from legorl.verify.parsers import TestResults, parse_stream, records
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects
from legorl.verify.specs import Grader, resolve, swebench_parser, test_files

HERE = Path(__file__).resolve().parent
DEFENCES = frozenset(
    {
        "isolated_runner",
        "stream",
        "integrity",
        "exit_code",
        "differential",
        "twin",
        "audit",
        "audit_pytest",
        "ctypes_absent",
        "xfail_is_failure",
        "unittest_stream",
    }
)
_EXTRA = ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", "."]


def pytest_args(task: Task) -> list[str] | None:
    """The task's pytest arguments, or None when its test command is not pytest."""
    cmd = task.test_cmd.strip()
    for prefix in ("python -m pytest", "pytest"):
        if cmd == prefix or cmd.startswith(prefix + " "):
            return shlex.split(cmd[len(prefix) :])
    return None


def _test_command(
    task: Task, grader: Grader, *, boot: str, sink: str, off: frozenset[str], options: list[str]
) -> str:
    if grader.kind == "output":
        return grader.command
    if grader.kind == "unittest":
        argv = shlex.split(grader.command)
        if argv and argv[0] in ("python", "python3"):
            argv = argv[1:]
        options = [*options, *(["--no-integrity"] if "integrity" in off else [])]
        options += ["--no-audit"] if "audit_pytest" in off else []
        options += ["--xfail-passes"] if "xfail_is_failure" in off else []
        return shlex.join(["python", "-I", "-B", boot, "unittest", sink, *options, "--", *argv])
    # Our plugin, and nothing from the repository's own pytest options.
    args = pytest_args(replace(task, test_cmd=grader.command))
    if args is None:
        return grader.command
    if "isolated_runner" in off:
        return shlex.join(["python", "-m", "pytest", "-p", "legorl_pytest_report", *_EXTRA, *args])
    options = [*options, *(["--no-integrity"] if "integrity" in off else [])]
    options += ["--no-audit"] if "audit_pytest" in off else []
    tail = [*_EXTRA, "--import-mode=append", *args]
    return shlex.join(["python", "-I", "-B", boot, "pytest", sink, *options, "--", *tail])


@dataclass(slots=True)
class TestRun:
    run: ExecResult
    results: TestResults
    log: str  # what the run printed (the code under test could write it too)
    plain: dict[str, dict[str, Any]] | None = None  # nodeid -> the independent runner's record
    grader: Grader | None = None
    #: The official parser's reading of the printed output (test name -> its status word).
    parsed: dict[str, str] = field(default_factory=dict)


async def _stage(sandbox: Sandbox, grade_dir: str) -> str:
    """Copy the runner files into the grading dir; the bootstrap's path (a per-run name)."""
    boot = f"{grade_dir}/boot-{secrets.token_hex(6)}.py"
    await sandbox.write_file(boot, (HERE / "bootstrap.py").read_bytes())
    for name in ("pytest_report.py", "plainrun.py", "unittest_report.py"):
        await sandbox.write_file(f"{grade_dir}/{name}", (HERE / name).read_bytes())
    # The legacy launch (isolated_runner off) finds the plugin by this name.
    await sandbox.write_file(
        f"{grade_dir}/legorl_pytest_report.py", (HERE / "pytest_report.py").read_bytes()
    )
    return boot


async def _read_stream(sandbox: Sandbox, run: ExecResult, sink: str) -> bytes:
    if sink == "fd":
        return run.output.encode()
    try:
        return await sandbox.read_file(sink)
    except (SandboxError, FileNotFoundError, OSError):
        return b""


async def run_tests(
    sandbox: Sandbox, task: Task, *, grade_dir: str, timeout: float, off: frozenset[str]
) -> TestRun:
    """Run the task's tests once under our launch; the outcomes as the signed stream says (or,
    for a runner that only prints, as the official parser reads its output)."""
    grader = resolve(task)
    if grader.kind == "unittest" and "unittest_stream" in off:
        grader = replace(grader, kind="output")
    boot = await _stage(sandbox, grade_dir)
    key = secrets.token_hex(16)
    tag = secrets.token_hex(4)
    sink = "fd" if "stream" not in off else f"{grade_dir}/report-{tag}.log"
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    watch, log = f"{grade_dir}/watch-{tag}.json", f"{grade_dir}/pytest-{tag}.log"
    await sandbox.write_file(watch, json.dumps(required).encode())
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if "isolated_runner" in off and grader.kind == "pytest":
        env.update(PYTHONPATH=grade_dir, LEGORL_REPORT=sink)
        env["LEGORL_INTEGRITY"] = "0" if "integrity" in off else "1"
    run = await sandbox.exec(
        [
            "sh",
            "-c",
            _test_command(
                task,
                grader,
                boot=boot,
                sink=sink,
                off=off,
                options=[f"--watch={watch}", f"--log={log}"],
            ),
        ],
        timeout=timeout,
        cwd=sandbox.workdir,
        env=env,
        stdin=(key + "\n").encode(),
    )
    printed = run.output
    if "isolated_runner" not in off and grader.kind != "output":
        printed = (await _read_stream(sandbox, run, log))[-(1 << 20) :].decode(errors="replace")
    parsed = _parse_printed(grader, printed, task)
    if grader.kind == "output":
        results = _from_printed(parsed, task)
    else:
        results = parse_stream(await _read_stream(sandbox, run, sink), key.encode())
    test_run = TestRun(run=run, results=results, log=printed, grader=grader, parsed=parsed)
    wanted = {"differential", "twin"} - off
    if wanted and all(test_run.results.outcomes.get(t) == "passed" for t in required):
        test_run.plain = await _plain(sandbox, task, grader, boot=boot, timeout=timeout, off=off)
    return test_run


def _parse_printed(grader: Grader, printed: str, task: Task) -> dict[str, str]:
    if grader.parser is None:
        return {}
    from swebench.types import TestSpec

    spec = TestSpec(
        instance_id=task.instance_id,
        image="",
        eval_script_list=[],
        repo=task.repo,
        version=task.version,
        FAIL_TO_PASS=task.FAIL_TO_PASS,
        PASS_TO_PASS=task.PASS_TO_PASS,
        log_parser=grader.parser,
    )
    return {str(k): str(v) for k, v in swebench_parser(grader.parser)(printed, spec).items()}


#: The official parsers' status words, as legorl's outcomes (an expected failure passes there).
STATUS = {"PASSED": "passed", "XFAIL": "passed", "FAILED": "failed", "ERROR": "error"}


def _from_printed(parsed: dict[str, str], task: Task) -> TestResults:
    """Outcomes read from printed output only: whatever the run printed decides them, so the
    exit code and the independent runner are the checks."""
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


def plain_ids(task: Task, grader: Grader) -> dict[str, str]:
    """FAIL_TO_PASS names as the independent runner's node ids, where it can run them: pytest
    ids as they are, ``test_x (pkg.mod.Class)`` of a plain unittest run or of Django's
    ``tests/runtests.py`` (its labels are below ``tests/``; the file must be one the test_patch
    touches), and a bare function name (sympy) defined in one test file of the test_patch."""
    if grader.kind == "pytest":
        return {t: t for t in task.FAIL_TO_PASS}
    out: dict[str, str] = {}
    files = [f for f in test_files(task) if f.endswith(".py")]
    if django_settings(grader) is not None:
        for test in task.FAIL_TO_PASS:
            unit = re.fullmatch(r"(\w+) \(([\w.]+)\)", test)
            if unit:
                method, dotted = unit.groups()
                module, _, cls = dotted.removesuffix("." + method).rpartition(".")
                path = f"tests/{module.replace('.', '/')}.py"
                if path in files:
                    out[test] = f"{path}::{cls}::{method}"
        return out
    for test in task.FAIL_TO_PASS:
        unit = re.fullmatch(r"(\w+) \(([\w.]+)\)", test)
        words = grader.command.split()
        runs_unittest = words[words[:1] in (["python"], ["python3"]) :][:2] == ["-m", "unittest"]
        if unit and runs_unittest:
            method, dotted = unit.groups()
            dotted = dotted.removesuffix("." + method)  # Python 3.11 prints it twice
            module, _, cls = dotted.rpartition(".")
            out[test] = f"{module.replace('.', '/')}.py::{cls}::{method}"
        elif grader.kind == "output" and re.fullmatch(r"test_\w+", test):
            defined = [f for f in files if re.search(rf"^def {test}\(", _file_text(task, f), re.M)]
            if len(defined) == 1:
                out[test] = f"{defined[0]}::{test}"
    return out


def django_settings(grader: Grader) -> str | None:
    """``tests:SETTINGS`` when the grader is Django's ``tests/runtests.py`` with ``--settings``."""
    if grader.kind != "unittest" or grader.runner != "tests/runtests.py":
        return None
    words = shlex.split(grader.command)
    for i, word in enumerate(words):
        if word.startswith("--settings="):
            return "tests:" + word.split("=", 1)[1]
        if word == "--settings" and i + 1 < len(words):
            return "tests:" + words[i + 1]
    return None


def _file_text(task: Task, path: str) -> str:
    """The lines the test_patch gives ``path`` (what it adds and keeps)."""
    chunk = task.test_patch.split(f"diff --git a/{path} b/{path}\n", 1)[-1].split(
        "\ndiff --git ", 1
    )[0]
    return "\n".join(ln[1:] for ln in chunk.splitlines() if ln[:1] in ("+", " "))


async def _plain(
    sandbox: Sandbox,
    task: Task,
    grader: Grader,
    *,
    boot: str,
    timeout: float,
    off: frozenset[str],
) -> dict[str, dict[str, Any]]:
    ids = plain_ids(task, grader)
    uncovered = {"outcome": "uncovered", "detail": "the independent runner cannot run it"}
    out = {t: {"event": "plain", "nodeid": t, **uncovered} for t in task.FAIL_TO_PASS}
    if not ids:
        return out
    key = secrets.token_hex(16)
    options = ["--no-twin"] if "twin" in off else []
    options += ["--no-audit"] if "audit" in off else []
    options += ["--ctypes"] if "ctypes_absent" in off else []
    options += ["--xfail-passes"] if "xfail_is_failure" in off else []
    django = django_settings(grader)
    options += [f"--django={django}"] if django else []
    argv = ["python", "-I", "-B", boot, "plain", "fd", *options, "--", *ids.values()]
    run = await sandbox.exec(
        argv, timeout=timeout, cwd=sandbox.workdir, stdin=(key + "\n").encode()
    )
    found, _ = records(run.output.encode(), key.encode())
    by_id = {r["nodeid"]: r for r in found if r.get("event") == "plain"}
    for test, nodeid in ids.items():
        out[test] = by_id.get(nodeid, {"outcome": "missing"})
    return out


def judge(
    task: Task, test_run: TestRun, patch: str, off: frozenset[str]
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
    if grader is not None and printed_only:
        flags.add("output_parsed")
        notes["graded_from"] = f"printed output ({grader.parser})"
    if "stream" not in off and not results.finished and not printed_only:
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
    if test_run.plain is not None:
        uncovered = []
        for test in task.FAIL_TO_PASS:
            record = test_run.plain.get(test, {"outcome": "missing"})
            if record["outcome"] == "uncovered":
                uncovered.append(test)
            elif "differential" not in off and record["outcome"] != "passed":
                flags.add("runner_disagrees")
                why = f" ({record['detail']})" if record["outcome"] == "refused" else ""
                problems.append(f"{test}: {record['outcome']} in the independent runner{why}")
            if "twin" not in off and record.get("vacuous"):
                flags.add("always_equal")
                problems.append(f"{test}: a comparison also holds against an impossible value")
        notes["differential_uncovered"] = uncovered
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
    notes.update(
        exit_code=run.exit_code,
        timed_out=run.timed_out,
        runner_finished=results.finished,
        collect_errors=results.collect_errors,
    )
    return tests, flags, notes
