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
narrower one in the pytest run).
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.protocols import ExecResult, Sandbox, SandboxError
from legorl.records import Task
from legorl.verify.parsers import PARSERS, TestResults, records
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects

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
    task: Task, *, boot: str, sink: str, off: frozenset[str], options: list[str]
) -> str:
    # Our plugin, and nothing from the repository's own pytest options.
    args = pytest_args(task)
    if args is None:
        return task.test_cmd
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


async def _stage(sandbox: Sandbox, grade_dir: str) -> str:
    """Copy the runner files into the grading dir; the bootstrap's path (a per-run name)."""
    boot = f"{grade_dir}/boot-{secrets.token_hex(6)}.py"
    await sandbox.write_file(boot, (HERE / "bootstrap.py").read_bytes())
    for name in ("pytest_report.py", "plainrun.py"):
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
    """Run the task's tests once under our launch; the outcomes as the signed stream says."""
    boot = await _stage(sandbox, grade_dir)
    key = secrets.token_hex(16)
    tag = secrets.token_hex(4)
    sink = "fd" if "stream" not in off else f"{grade_dir}/report-{tag}.log"
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    watch, log = f"{grade_dir}/watch-{tag}.json", f"{grade_dir}/pytest-{tag}.log"
    await sandbox.write_file(watch, json.dumps(required).encode())
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if "isolated_runner" in off:
        env.update(PYTHONPATH=grade_dir, LEGORL_REPORT=sink)
        env["LEGORL_INTEGRITY"] = "0" if "integrity" in off else "1"
    run = await sandbox.exec(
        [
            "sh",
            "-c",
            _test_command(
                task, boot=boot, sink=sink, off=off, options=[f"--watch={watch}", f"--log={log}"]
            ),
        ],
        timeout=timeout,
        cwd=sandbox.workdir,
        env=env,
        stdin=(key + "\n").encode(),
    )
    parser = PARSERS[task.log_parser]
    stream = await _read_stream(sandbox, run, sink)
    printed = run.output
    if "isolated_runner" not in off:
        printed = (await _read_stream(sandbox, run, log))[-(1 << 20) :].decode(errors="replace")
    test_run = TestRun(run=run, results=parser.parse(stream, key.encode()), log=printed)
    wanted = {"differential", "twin"} - off
    if wanted and all(test_run.results.outcomes.get(t) == "passed" for t in required):
        test_run.plain = await _plain(sandbox, task, boot=boot, timeout=timeout, off=off)
    return test_run


async def _plain(
    sandbox: Sandbox, task: Task, *, boot: str, timeout: float, off: frozenset[str]
) -> dict[str, dict[str, Any]]:
    key = secrets.token_hex(16)
    options = ["--no-twin"] if "twin" in off else []
    options += ["--no-audit"] if "audit" in off else []
    argv = ["python", "-I", "-B", boot, "plain", "fd", *options, "--", *task.FAIL_TO_PASS]
    run = await sandbox.exec(
        argv, timeout=timeout, cwd=sandbox.workdir, stdin=(key + "\n").encode()
    )
    found, _ = records(run.output.encode(), key.encode())
    return {r["nodeid"]: r for r in found if r.get("event") == "plain"}


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
    if "stream" not in off and not results.finished:
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
