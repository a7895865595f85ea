"""Nothing outlives its run: kill -9 of a process holding sandboxes, then gc; reaping at the
next start; many sandboxes started at once on two cores."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    IN_CI,
    TASKS_DIR,
    TRAIN,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.sandbox import cgroups
from legorl.sandbox.common import state_root

HOLDER = r"""
import asyncio, json, sys
from legorl.records import Task, read_jsonl
from legorl.sandbox import make_backend

name, tasks_file, task_id, run_id, n, tasks_dir, marker = sys.argv[1:8]
task = next(t for t in read_jsonl(tasks_file, Task) if t.instance_id == task_id)
backend = make_backend(name)

async def main():
    boxes = await asyncio.gather(*[
        backend.start(task, tasks_dir, run_id=run_id) for _ in range(int(n))
    ])
    # Each sandbox is busy, as during a rollout; "ready" once every command has really started.
    # (Docker calls on_output from a worker thread.)
    loop = asyncio.get_running_loop()
    started = [asyncio.Event() for _ in boxes]
    busy = [
        asyncio.create_task(b.exec(f"echo up; exec sleep {marker}", timeout=600,
                                   on_output=lambda _c, e=e: loop.call_soon_threadsafe(e.set)))
        for b, e in zip(boxes, started)
    ]
    await asyncio.gather(*(e.wait() for e in started))
    enforced = [getattr(b, "limits_enforced", None) for b in boxes]
    print("ready " + json.dumps(enforced), flush=True)
    await asyncio.gather(*busy)

asyncio.run(main())
"""


def _hold(name: str, rid: str, n: int, marker: str = "300") -> tuple[subprocess.Popen, list[Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, str(TRAIN), task().instance_id, rid, str(n),
         str(TASKS_DIR), marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"ready "), proc.stderr.read().decode() if proc.stderr else ""
    return proc, json.loads(line[6:])


def _busy_pids(marker: str) -> list[int]:
    """Host pids of the holder's busy commands (``sleep <marker>``), found through /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", marker.encode()]:
                found.append(int(entry.name))
    return found


def _containers(api: Any, rid: str) -> list[dict[str, Any]]:
    return list(api.containers(all=True, filters={"label": f"legorl.run={rid}"}))


def _local_boxes(rid: str) -> list[Path]:
    out = []
    for folder in state_root().iterdir():
        try:
            owner = json.loads((folder / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if owner.get("run") == rid:
            out.append(folder)
    return out


def _cgroup_folders(names: list[str]) -> list[Path]:
    """Every legorl cgroup folder of these sandboxes, in every hierarchy this host has."""
    return [p for p in cgroups.stale(set()) if p.name in names]


def legorl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args], capture_output=True, timeout=300
    )


def test_kill_9_then_gc_leaves_nothing(backend: Any) -> None:
    rid = run_id()
    marker = f"300.{secrets.randbelow(10**6):06d}"
    holder, enforced = _hold(backend.name, rid, 8, marker)
    if backend.name == "docker":
        assert len(_containers(backend.api, rid)) == 8
    else:
        deadline = time.monotonic() + 60  # "up" is printed just before each shell execs sleep
        while len(_busy_pids(marker)) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_busy_pids(marker)) == 8
        boxes = _local_boxes(rid)
        names = [b.name for b in boxes]
        assert len(boxes) == 8
        if all(enforced):  # the busy commands are inside their sandboxes' cgroups
            folders = _cgroup_folders(names)
            held = {int(x) for f in folders for x in (f / "cgroup.procs").read_text().split()}
            assert {n for n in names if any(f.name == n for f in folders)} == set(names)
            assert set(_busy_pids(marker)) <= held
        else:
            # Not root, no delegated v2 tree: only the processes can be checked.
            assert not any(enforced), enforced
            assert not IN_CI, "cgroups the sandboxes may create are required under CI=true"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()

    result = legorl("sandbox", "gc", "-b", backend.name)
    assert result.returncode == 0, result.stderr.decode()
    if backend.name == "docker":
        assert _containers(backend.api, rid) == []
    else:
        assert _busy_pids(marker) == []  # the busy commands died with their holder
        assert _local_boxes(rid) == []
        assert _cgroup_folders(names) == []


def test_the_next_start_reaps_a_dead_runs_containers(docker_backend: Any) -> None:
    from legorl.sandbox import make_backend

    rid = run_id()
    holder, _ = _hold("docker", rid, 2)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert len(_containers(docker_backend.api, rid)) == 2
    fresh = make_backend("docker")
    box = fresh.start_sync(task(), TASKS_DIR, run_id=run_id())  # type: ignore[attr-defined]
    try:
        assert _containers(docker_backend.api, rid) == []
    finally:
        box.close_sync()


def test_sixteen_sandboxes_at_once_all_start_and_all_go(backend: Any) -> None:
    rid = run_id()

    async def go() -> list[Any]:
        async def one(i: int) -> Any:
            box = await backend.start(task(), str(TASKS_DIR), run_id=rid)
            try:
                return (await box.exec(f"echo {i}")).output
            finally:
                await box.close()

        return await asyncio.gather(*[one(i) for i in range(16)], return_exceptions=True)

    results = run(go())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == []
    assert sorted(results) == sorted(f"{i}\n" for i in range(16))
    if backend.name == "docker":
        assert _containers(backend.api, rid) == []
    else:
        assert _local_boxes(rid) == []


def test_more_busy_sandboxes_than_default_threads_all_run_at_once(backend: Any) -> None:
    """A busy exec holds a thread for as long as its command runs. More sandboxes than the
    loop's default pool has threads (cpu_count + 4) must still all be running at once; with the
    default pool the last ones waited for the first commands to end."""
    n = (os.cpu_count() or 1) + 5
    rid = run_id()

    async def go() -> int:
        boxes = await asyncio.gather(
            *[backend.start(task(), str(TASKS_DIR), run_id=rid) for _ in range(n)]
        )
        loop = asyncio.get_running_loop()
        up = [asyncio.Event() for _ in boxes]
        busy = [
            asyncio.create_task(
                b.exec(
                    "echo up; exec sleep 120",
                    timeout=120,
                    on_output=lambda _c, e=e: loop.call_soon_threadsafe(e.set),
                )
            )
            for b, e in zip(boxes, up, strict=True)
        ]
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in up)), 60)
            return sum(e.is_set() for e in up)
        finally:
            await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
            await asyncio.gather(*busy, return_exceptions=True)

    assert run(go()) == n
    if backend.name == "docker":
        assert _containers(backend.api, rid) == []
    else:
        assert _local_boxes(rid) == []
