"""The Sandbox API on both backends, in real containers and real bubblewrap sandboxes."""

from __future__ import annotations

import os
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.protocols import Limits, Sandbox, SandboxError


async def _start(backend: Any, **kw: Any) -> Any:
    return await backend.start(task(), str(TASKS_DIR), run_id=run_id(), **kw)


def test_commands_files_and_diff(backend: Any) -> None:
    async def go() -> None:
        box = await _start(backend)
        try:
            assert isinstance(box, Sandbox)
            assert box.workdir == "/testbed" and box.proxy_url is None
            r = await box.exec("echo out; echo err >&2; exit 3")
            assert r.exit_code == 3 and r.output == "out\nerr\n" and not r.timed_out
            assert (await box.exec(["printf", "%s|", "a b", "c"])).output == "a b|c|"
            r = await box.exec("pwd; echo $GREETING", env={"GREETING": "hi"}, cwd="/tmp")
            assert r.output == "/tmp\nhi\n"
            assert (await box.exec("cat", stdin=b"piped\x00bytes")).output == "piped\x00bytes"
            # The env layer's venv leads PATH: `python` and pytest are there.
            r = await box.exec("python -m pytest -q -p no:cacheprovider", timeout=120)
            assert r.exit_code == 0 and "passed" in r.output

            streamed: list[bytes] = []
            r = await box.exec("for i in 1 2 3; do echo $i; done", on_output=streamed.append)
            assert b"".join(streamed) == b"1\n2\n3\n" == r.output.encode()

            await box.write_file("notes/new.txt", b"hello\n")
            await box.write_file("/tmp/abs.bin", bytes(range(256)))
            assert await box.read_file("notes/new.txt") == b"hello\n"
            assert await box.read_file("/tmp/abs.bin") == bytes(range(256))
            with pytest.raises(FileNotFoundError):
                await box.read_file("no/such/file")

            await box.exec("sed -i 's/width + height/width * height/' geometry.py")
            await box.exec("python -c 'import geometry'")  # leaves __pycache__ behind
            patch = await box.diff()
            assert "diff --git a/geometry.py b/geometry.py" in patch
            assert "+    return width * height" in patch
            assert "diff --git a/notes/new.txt b/notes/new.txt" in patch  # untracked files too
            assert "__pycache__" not in patch and ".pyc" not in patch
            # diff() leaves the agent's own index alone.
            assert (
                await box.exec("git status --porcelain geometry.py")
            ).output == " M geometry.py\n"
        finally:
            await box.close()
        await box.close()  # idempotent
        with pytest.raises(SandboxError, match="closed"):
            await box.exec("true")

    run(go())


def test_timeouts_and_background_children_never_hang(backend: Any) -> None:
    async def go() -> None:
        box = await _start(backend)
        try:
            r = await box.exec("echo started; sleep 60", timeout=1)
            assert r.timed_out and r.exit_code is None and r.killed_by == "timeout"
            assert r.output == "started\n"
            # A child left running in the background does not keep the command open.
            r = await box.exec("sleep 60 & echo done", timeout=30)
            assert r.exit_code == 0 and not r.timed_out and r.output == "done\n"
            assert (await box.exec("echo alive")).output == "alive\n"
        finally:
            await box.close()

    run(go())


def test_limits_are_classified(backend: Any) -> None:
    limits = Limits(memory_mb=128, pids=48, cpus=1.0, output_bytes=10_000, wall_s=120)

    async def go() -> None:
        box = await _start(backend, limits=limits)
        try:
            r = await box.exec("python3 -c 'x = bytearray(600 * 1024 * 1024); print(len(x))'")
            assert r.killed_by == "memory" and r.exit_code is None, r

            r = await box.exec("for i in $(seq 200); do sleep 30 & done; wait", timeout=15)
            assert r.killed_by == "pids", r
            assert (await box.exec("echo recovered", timeout=30)).output == "recovered\n"

            r = await box.exec("head -c 500000 /dev/zero | tr '\\0' x")
            assert r.truncated and r.exit_code == 0 and len(r.output) < 10_200
            assert r.output.startswith("xxx") and r.output.endswith("xxx")
            assert "bytes of output cut" in r.output

            # One CPU: a quota of one period.
            if backend.name == "docker":
                quota = (await box.exec("cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us")).output
            else:
                quota = (box.cgroup.cpu / "cpu.cfs_quota_us").read_text()
            assert quota.strip() == "100000"
        finally:
            await box.close()

    if backend.name == "local":
        probe = run(_start(backend))
        enforced = probe.limits_enforced
        run(probe.close())
        if not enforced:
            if os.environ.get("CI") == "true":
                pytest.fail("the local backend cannot create cgroups here (CI runs as root)")
            pytest.skip("the local backend may not create cgroups here (not root)")
    run(go())


def test_the_pids_kill_reaches_no_process_outside_the_container(docker_backend: Any) -> None:
    """After a command that ran out of PIDs, Docker's backend ends the leftovers of its process
    group (led by the exec's host pid). A host process leading a group of that number, as one
    may once the host reuses the pid, is never signalled: only the container's own processes
    are (the old ``os.killpg`` of the exec's pid would have killed this one)."""
    import subprocess

    async def go() -> None:
        box = await _start(docker_backend, limits=Limits(pids=48))
        outside = subprocess.Popen(["sleep", "60"], start_new_session=True)
        try:
            r = await box.exec("for i in $(seq 200); do sleep 30 & done; wait", timeout=15)
            assert r.killed_by == "pids", r  # the leftovers were ended: the box still runs
            assert (await box.exec("echo recovered", timeout=30)).output == "recovered\n"
            assert os.getpgid(outside.pid) == outside.pid
            box._end_group(outside.pid)  # a pid the host gave to another group's leader
            assert outside.poll() is None
        finally:
            outside.kill()
            outside.wait()
            await box.close()

    run(go())


def test_wall_time_ends_the_sandbox_life(backend: Any) -> None:
    async def go() -> None:
        box = await _start(backend, limits=Limits(wall_s=3))
        try:
            r = await box.exec("sleep 30", timeout=60)
            assert r.killed_by == "wall" and r.timed_out and r.exit_code is None
            r = await box.exec("echo too late")
            assert r.killed_by == "wall" and r.exit_code is None and r.output == ""
        finally:
            await box.close()

    run(go())


def test_each_sandbox_gets_its_own_copy(backend: Any) -> None:
    async def go() -> None:
        a, b = await _start(backend), await _start(backend)
        try:
            await a.write_file("mine.txt", b"a")
            r = await b.exec("test -e mine.txt && echo seen || echo absent")
            assert r.output == "absent\n"
            assert a.id != b.id
        finally:
            await a.close()
            await b.close()

    run(go())


def test_local_files_go_through_the_sandbox_not_the_host(local_backend: Any) -> None:
    # A symlink planted by the agent must not make read_file/write_file touch host files.
    async def go() -> None:
        box = await _start(local_backend)
        try:
            await box.exec("ln -s /proc/1/environ leak; ln -s /root/.bashrc home-link")
            try:  # the sandbox's own pid 1 (bwrap's, which its user may not read, run by root)
                leaked = await box.read_file("leak")
            except SandboxError as exc:
                leaked = str(exc).encode()
            assert b"LEGORL" not in leaked
            await box.write_file("/root/.bashrc", b"sandbox home\n")
            assert await box.read_file("home-link") == b"sandbox home\n"
        finally:
            await box.close()

    run(go())
