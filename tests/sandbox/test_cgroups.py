"""Killing a sandbox's cgroup while its processes fork: `cgroup.kill` (v2) and the v1 freezer
leave none, where a per-pid loop is outrun (the control). Real cgroups of this host: the v2
tree (or the one a hybrid v1 host mounts at /sys/fs/cgroup/unified), the v1 freezer."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_local_backend,
    need,
    run_id,
    task,
)

from legorl.sandbox import cgroups
from legorl.sandbox.common import owner_tag, state_root

# CHAINS chains of shell processes, each forking its successor and exiting, GENERATIONS times at
# most: a bounded stand-in for a fork bomb whose pids keep changing under a killer's feet. The
# FILLERS idle processes beside them make a killer's pass long enough that the chains fork during
# it even on a loaded machine.
CHAINS, GENERATIONS, FILLERS = 8, 20000, 120
FORKER = (
    'g() { [ "$1" -gt 0 ] && { g $(($1 - 1)) & }; }; '
    'i=0; while [ $i -lt "$1" ]; do g "$2" & i=$((i + 1)); done'
)
IDLE = 'i=0; while [ $i -lt "$1" ]; do sleep 60 & i=$((i + 1)); done'


def _folder(base: Path | None, what: str) -> Iterator[Path]:
    need(base is not None and os.access(base, os.W_OK), what)
    assert base is not None
    path = base / "legorl" / f"test-cg-{secrets.token_hex(4)}"
    # Owned by this live process, as a sandbox's cgroups are: `legorl sandbox gc` (another
    # test worker's) removes only those of dead owners.
    state = state_root() / path.name
    state.mkdir(parents=True)
    (state / "owner.json").write_text(json.dumps({"owner": owner_tag()}))
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(state, ignore_errors=True)
        cg = cgroups.CgroupSet.of_folder(path)
        cg.kill_all()
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture(name="v2")
def fixture_v2() -> Iterator[Path]:
    yield from _folder(cgroups.v2_root(), "a writable cgroup v2 tree (root, or a delegated one)")


@pytest.fixture(name="freezer")
def fixture_freezer() -> Iterator[Path]:
    yield from _folder(cgroups.ROOT / "freezer", "a writable cgroup v1 freezer")


def _fork_inside(folder: Path) -> None:
    def enter() -> None:
        (folder / "cgroup.procs").write_text(str(os.getpid()))

    for script, args in ((IDLE, [FILLERS]), (FORKER, [CHAINS, GENERATIONS])):
        argv = ["/bin/sh", "-c", script, "sh", *map(str, args)]
        subprocess.run(argv, preexec_fn=enter, check=True, timeout=60)
    deadline = time.monotonic() + 10
    while len(cgroups.CgroupSet.of_folder(folder).pids_inside()) < CHAINS + FILLERS:
        assert time.monotonic() < deadline, "the forking chains did not start"
        time.sleep(0.02)
    time.sleep(0.2)  # let them fork for a while


def _alive_after(cg: cgroups.CgroupSet, wait: float = 0.3) -> set[int]:
    time.sleep(wait)
    return cg.pids_inside()


def test_cgroup_kill_leaves_no_forking_process(v2: Path) -> None:
    cg = cgroups.CgroupSet.of_folder(v2)
    assert cg.unified == v2
    for _ in range(2):
        _fork_inside(v2)
        assert cg.kill_in_one_step()  # and nothing after it: no second pass
        assert _alive_after(cg) == set()
        assert "populated 0" in (v2 / "cgroup.events").read_text()


def test_control_a_per_pid_loop_is_outrun_by_forking_processes(v2: Path) -> None:
    cg = cgroups.CgroupSet.of_folder(v2)
    escaped = []
    for _ in range(10):
        _fork_inside(v2)
        cg.kill_each()  # one pass of the per-pid loop, as kill_all was before cgroup.kill
        survivors = _alive_after(cg)
        escaped.append(len(survivors))
        assert cg.kill_all(timeout=5)  # and the one-step kill clears what escaped
        if survivors:
            break
    assert any(escaped), f"no process escaped the per-pid loop in {len(escaped)} tries"


def test_v1_freezer_then_kill_leaves_no_forking_process(freezer: Path) -> None:
    cg = cgroups.CgroupSet.of_folder(freezer)
    assert cg.freezer == freezer and cg.unified is None
    for _ in range(2):
        _fork_inside(freezer)
        assert cg.kill_in_one_step()
        assert _alive_after(cg) == set()
        assert (freezer / "freezer.state").read_text().strip() == "THAWED"


def test_a_local_sandbox_is_killed_in_one_step(local_backend: object) -> None:
    async def go() -> cgroups.CgroupSet:
        box = await local_backend.start(task(), str(TASKS_DIR), run_id=run_id())  # type: ignore[attr-defined]
        try:
            need(box.cgroup is not None, "cgroups this process may create")
            cg: cgroups.CgroupSet = box.cgroup
            assert cg.unified is not None or cg.freezer is not None, "no one-step kill here"
            command = ["/bin/sh", "-c", f"{FORKER}; sleep 60", "sh", "4", str(GENERATIONS)]
            busy = asyncio.create_task(box.exec(command, timeout=120))
            while len(cg.pids_inside()) < 4:
                assert not busy.done(), busy.result()
                await asyncio.sleep(0.02)
        finally:
            await box.close()
        result = await busy
        assert result.exit_code != 0  # killed, not finished
        return cg

    cg = asyncio.run(go())
    assert _alive_after(cg) == set()
    assert not any(p.exists() for p in cg.created)
