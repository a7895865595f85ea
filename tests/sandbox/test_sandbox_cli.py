"""`legorl sandbox …` as a user runs it: results, and one-line errors with non-zero exits."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    BACKENDS,
    TASK_ID,
    TASKS_DIR,
    TRAIN,
    fixture_docker_backend,
    fixture_local_backend,
    task,
    variant,
)

from legorl.records import write_jsonl


def legorl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        capture_output=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
        timeout=600,
    )


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode != 0
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"legorl {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture(params=BACKENDS)
def name(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(f"{request.param}_backend")  # built, or skip/fail with the reason
    return str(request.param)


def test_exec_runs_the_command_and_passes_its_exit_code(name: str) -> None:
    ok = legorl("sandbox", "exec", TASK_ID, "--tasks", str(TRAIN), "-b", name, "--",
                "python", "-m", "pytest", "-q", "-p", "no:cacheprovider")  # fmt: skip
    assert ok.returncode == 0, ok.stderr.decode()
    assert b"7 passed" in ok.stdout
    failing = legorl("sandbox", "exec", TASK_ID, "--tasks", str(TRAIN), "-b", name, "--",
                     "sh", "-c", "echo to-stdout; exit 5")  # fmt: skip
    assert failing.returncode == 5 and failing.stdout == b"to-stdout\n"


def test_unknown_task_id(name: str) -> None:
    result = legorl("sandbox", "exec", "legorl-toy__nope-1", "--tasks", str(TRAIN), "-b", name,
                    "--", "true")  # fmt: skip
    line = one_line_error(result, "sandbox exec")
    assert "unknown task id 'legorl-toy__nope-1'" in line and "100 tasks" in line


def test_missing_image_with_no_build(name: str, tmp_path: Path) -> None:
    t = variant(task(), instance_id=f"{TASK_ID}-{secrets.token_hex(4)}",
                source=str(TASKS_DIR / task().source))  # fmt: skip
    write_jsonl(tmp_path / "t.jsonl", [t])
    result = legorl("sandbox", "exec", t.instance_id, "--tasks", str(tmp_path / "t.jsonl"),
                    "-b", name, "--no-build", "--", "true")  # fmt: skip
    line = one_line_error(result, "sandbox exec")
    assert "instance layer" in line and "not built and building is off (--no-build)" in line


def test_a_failing_build_step(name: str, tmp_path: Path) -> None:
    # The instance layer's checkout step fails: the bundle has no such commit.
    t = variant(task(), base_commit="0123456789" * 4, source=str(TASKS_DIR / task().source))
    write_jsonl(tmp_path / "t.jsonl", [t])
    result = legorl("sandbox", "build", "--tasks", str(tmp_path / "t.jsonl"), "-b", name)
    line = one_line_error(result, "sandbox build")
    assert "instance layer" in line and "failed at step 1/" in line and "`checkout`" in line
    assert "cannot check out base_commit 0123456789" in line


def test_a_command_that_times_out(name: str) -> None:
    result = legorl("sandbox", "exec", TASK_ID, "--tasks", str(TRAIN), "-b", name,
                    "--timeout", "1", "--", "sh", "-c", "echo begun; sleep 60")  # fmt: skip
    assert result.returncode == 124
    assert result.stdout == b"begun\n"  # output streamed before the kill
    line = one_line_error(result, "sandbox exec")
    assert "timed out after 1s" in line


def test_a_command_out_of_memory_exits_137(name: str) -> None:
    result = legorl("sandbox", "exec", TASK_ID, "--tasks", str(TRAIN), "-b", name,
                    "--memory-mb", "128", "--", "python3", "-c",
                    "x = bytearray(600 * 1024 * 1024); print('allocated')")  # fmt: skip
    assert result.returncode == 137
    assert b"allocated" not in result.stdout
    assert "out of memory (limit 128 MB)" in one_line_error(result, "sandbox exec")


def test_the_daemon_is_down(tmp_path: Path) -> None:
    down = {"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}
    for args in (
        ["sandbox", "exec", TASK_ID, "--tasks", str(TRAIN), "--", "true"],
        ["sandbox", "build", "--tasks", str(TRAIN)],
        ["sandbox", "ls"],
    ):
        result = legorl(*args, env=down)
        line = one_line_error(result, f"sandbox {args[1]}")
        assert "cannot reach the Docker daemon" in line and "dockerd --data-root" in line


def test_bad_task_file_and_usage() -> None:
    missing = legorl("sandbox", "build", "--tasks", "/nonexistent/tasks.jsonl")
    assert "no such file" in one_line_error(missing, "sandbox build")
    no_cmd = legorl("sandbox", "exec", TASK_ID, "--tasks", str(TRAIN))
    assert no_cmd.returncode == 2 and "no command given" in no_cmd.stderr.decode()
    bad_backend = legorl("sandbox", "ls", "-b", "k8s")
    assert "unknown sandbox backend 'k8s'" in one_line_error(bad_backend, "sandbox ls")


def test_build_ls_and_gc(name: str) -> None:
    built = legorl("sandbox", "build", "--tasks", str(TRAIN), "--task", TASK_ID, "-b", name,
                   "--json")  # fmt: skip
    assert built.returncode == 0, built.stderr.decode()
    reports = [json.loads(line) for line in built.stdout.splitlines()]
    assert [r["action"] for r in reports] == ["cached"] * 3  # 0 layers rebuilt
    listed = legorl("sandbox", "ls", "-b", name)
    assert listed.returncode == 0
    assert TASK_ID in listed.stdout.decode() and "last use" in listed.stdout.decode()
    rows = [
        json.loads(line)
        for line in legorl("sandbox", "ls", "-b", name, "--json").stdout.splitlines()
    ]
    assert {"kind", "tag", "name", "size", "created", "last_used"} <= set(rows[0])
    collected = legorl("sandbox", "gc", "-b", name, "--dry-run")
    assert collected.returncode == 0 and "would remove" in collected.stderr.decode()
