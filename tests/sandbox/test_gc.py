"""Nothing outlives its run: kill -9 of a process holding sandboxes, then gc; reaping at the
next start; many sandboxes started at once on two cores."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    TRAIN,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.sandbox.common import state_root

HOLDER = r"""
import asyncio, sys
from legorl.records import Task, read_jsonl
from legorl.sandbox import make_backend

name, tasks_file, task_id, run_id, n = sys.argv[1:6]
task = next(t for t in read_jsonl(tasks_file, Task) if t.instance_id == task_id)
backend = make_backend(name)

async def main():
    boxes = await asyncio.gather(*[
        backend.start(task, sys.argv[6], run_id=run_id) for _ in range(int(n))
    ])
    # Each sandbox is busy, as during a rollout.
    busy = [asyncio.create_task(b.exec("sleep 300", timeout=600)) for b in boxes]
    await asyncio.sleep(1.0)
    print("ready", flush=True)
    await asyncio.gather(*busy)

asyncio.run(main())
"""


def _hold(name: str, rid: str, n: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, str(TRAIN), task().instance_id, rid, str(n),
         str(TASKS_DIR)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == b"ready\n", proc.stderr.read().decode() if proc.stderr else ""
    return proc


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


def _cgroup_pids(names: list[str]) -> list[str]:
    pids = []
    for ctl in ("memory", "pids"):
        for n in names:
            procs = Path(f"/sys/fs/cgroup/{ctl}/legorl/{n}/cgroup.procs")
            if procs.is_file():
                pids += procs.read_text().split()
    unified = [Path(f"/sys/fs/cgroup/legorl/{n}/cgroup.procs") for n in names]
    for procs in unified:
        if procs.is_file():
            pids += procs.read_text().split()
    return pids


def legorl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args], capture_output=True, timeout=300
    )


def test_kill_9_then_gc_leaves_nothing(backend: Any) -> None:
    rid = run_id()
    holder = _hold(backend.name, rid, 8)
    if backend.name == "docker":
        assert len(_containers(backend.api, rid)) == 8
    else:
        boxes = _local_boxes(rid)
        assert len(boxes) == 8
        assert _cgroup_pids([b.name for b in boxes]) or not Path("/sys/fs/cgroup/memory").is_dir()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()

    result = legorl("sandbox", "gc", "-b", backend.name)
    assert result.returncode == 0, result.stderr.decode()
    if backend.name == "docker":
        assert _containers(backend.api, rid) == []
    else:
        names = [b.name for b in boxes]
        assert _local_boxes(rid) == []
        assert _cgroup_pids(names) == []  # the busy commands died with their holder
        assert not any(Path(f"/sys/fs/cgroup/{c}/legorl/{n}").exists()
                       for c in ("memory", "pids", "cpu") for n in names)  # fmt: skip


def test_the_next_start_reaps_a_dead_runs_containers(docker_backend: Any) -> None:
    from legorl.sandbox import make_backend

    rid = run_id()
    holder = _hold("docker", rid, 2)
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
