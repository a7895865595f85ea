"""Reading and (for the local backend) creating the cgroups that hold a sandbox's limits.

Both cgroup v1 (one tree per controller) and v2 (one unified tree) are handled. The counters
that classify a killed command are the kernel's own: ``oom_kill`` in ``memory.oom_control``
(v1) or ``memory.events`` (v2), and ``max`` in ``pids.events`` (refused forks).

Killing a sandbox's processes must not race with them forking: on v2 (or the v2 tree a hybrid
v1 host mounts at ``unified``) one write to ``cgroup.kill`` kills the whole cgroup in the kernel;
on plain v1 the freezer stops every process before the per-pid signals go out. The per-pid loop
alone is the last resort, repeated until the cgroup is empty.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from legorl.protocols import Limits
from legorl.sandbox.common import Counters, parse_counters

ROOT = Path("/sys/fs/cgroup")
UNIFIED = ROOT / "unified"  # where a hybrid (v1) host mounts its v2 tree


def is_v2() -> bool:
    return (ROOT / "cgroup.controllers").is_file()


def v2_root() -> Path | None:
    """The v2 tree: the root itself on v2, ``unified`` on a hybrid v1 host, else None."""
    if is_v2():
        return ROOT
    return UNIFIED if (UNIFIED / "cgroup.controllers").is_file() else None


@dataclass(slots=True)
class CgroupSet:
    """The cgroups of one sandbox: one folder on v2, one per controller on v1 (plus, where the
    host has them, a v2 folder to kill through and a freezer folder)."""

    memory: Path | None = None
    pids: Path | None = None
    cpu: Path | None = None
    unified: Path | None = None  # a v2 folder: its cgroup.kill kills every process at once
    freezer: Path | None = None  # a v1 freezer folder: stops forks while the loop kills
    created: list[Path] = field(default_factory=list)  # folders we made (removed on close)

    @classmethod
    def of_folder(cls, path: Path) -> CgroupSet:
        """The set around one existing folder of any hierarchy (gc of a stale sandbox)."""
        cg = cls(created=[path])
        if (path / "cgroup.kill").is_file():
            cg.unified = path
        elif (path / "freezer.state").is_file():
            cg.freezer = path
        else:
            cg.memory = cg.pids = cg.cpu = path
        return cg

    def counters(self) -> Counters | None:
        if self.memory is None and self.pids is None:
            return None
        oom = ""
        if self.memory is not None:
            name = "memory.events" if is_v2() else "memory.oom_control"
            with contextlib.suppress(OSError):
                oom = (self.memory / name).read_text()
        pids = ""
        if self.pids is not None:
            with contextlib.suppress(OSError):
                pids = (self.pids / "pids.events").read_text()
        return parse_counters(oom, pids)

    def procs_files(self) -> list[Path]:
        dirs = {p for p in (self.memory, self.pids, self.cpu, self.unified, self.freezer) if p}
        return sorted(d / "cgroup.procs" for d in dirs)

    def pids_inside(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                found.update(int(line) for line in procs.read_text().split())
        return found

    def kill_each(self) -> None:
        """One pass of SIGKILL to every listed pid: a process forking meanwhile escapes it."""
        for pid in self.pids_inside():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def kill_in_one_step(self, timeout: float = 5.0) -> bool:
        """Kill every process so that none can fork away: ``cgroup.kill``, else freeze, kill,
        thaw. False when the host offers neither."""
        if self.unified is not None:
            with contextlib.suppress(OSError):
                (self.unified / "cgroup.kill").write_text("1")
                return True
        if self.freezer is not None:
            frozen = self._freeze("FROZEN", timeout)
            if frozen:
                self.kill_each()  # frozen processes cannot fork; they die when thawed
            self._freeze("THAWED", timeout)
            return frozen
        return False

    def kill_all(self, timeout: float = 5.0) -> bool:
        """Kill every process in the sandbox's cgroups; True when none is left."""
        self.kill_in_one_step(timeout)
        deadline = time.monotonic() + timeout
        while self.pids_inside():
            if time.monotonic() > deadline:
                return False
            self.kill_each()
            time.sleep(0.01)
        return True

    def _freeze(self, state: str, timeout: float) -> bool:
        assert self.freezer is not None
        state_file = self.freezer / "freezer.state"
        deadline = time.monotonic() + timeout
        try:
            state_file.write_text(state)
            while state_file.read_text().strip() != state:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        except OSError:
            return False
        return True

    def remove(self) -> None:
        self.kill_all()
        for path in reversed(self.created):
            with contextlib.suppress(OSError):
                path.rmdir()
        self.created.clear()


def of_pid(pid: int) -> CgroupSet:
    """The cgroups a (host) process is in, e.g. a container's init: for reading counters."""
    found = CgroupSet()
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "" and is_v2():
            found.memory = found.pids = found.cpu = ROOT / rel
        for ctl in controllers.split(","):
            if ctl == "memory":
                found.memory = ROOT / "memory" / rel
            elif ctl == "pids":
                found.pids = ROOT / "pids" / rel
    return found


def create(name: str, limits: Limits) -> CgroupSet | None:
    """Make ``legorl/<name>`` cgroups with the limits; None when we may not (not root, no
    delegation). The caller moves processes in by writing their pid to ``procs_files()``."""
    cg = CgroupSet()
    try:
        if is_v2():
            parent = ROOT / "legorl"
            if not parent.is_dir():
                parent.mkdir()
                cg.created.append(parent)  # pragma: no cover - first use on a v2 host
            with contextlib.suppress(OSError):
                (ROOT / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            path = parent / name
            path.mkdir()
            cg.created = [path]
            cg.memory = cg.pids = cg.cpu = cg.unified = path
            (path / "memory.max").write_text(str(limits.memory_mb * 1024 * 1024))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
            (path / "pids.max").write_text(str(limits.pids))
            period = 100_000
            (path / "cpu.max").write_text(f"{int(limits.cpus * period)} {period}")
        else:
            for ctl in ("memory", "pids", "cpu"):
                base = ROOT / ctl
                if not base.is_dir():
                    raise OSError(f"no {ctl} controller")
                parent = base / "legorl"
                parent.mkdir(exist_ok=True)
                path = parent / name
                path.mkdir()
                cg.created.append(path)
                setattr(cg, ctl, path)
            assert cg.memory and cg.pids and cg.cpu
            (cg.memory / "memory.limit_in_bytes").write_text(str(limits.memory_mb * 1024 * 1024))
            (cg.pids / "pids.max").write_text(str(limits.pids))
            (cg.cpu / "cpu.cfs_period_us").write_text("100000")
            (cg.cpu / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * 100_000)))
            # Optional on v1: without them, killing falls back to the per-pid loop.
            optional: list[tuple[Path | None, str]] = [
                (v2_root(), "unified"),
                (ROOT / "freezer", "freezer"),
            ]
            for tree, attr in optional:
                if tree is None or not (tree / "cgroup.procs").is_file():
                    continue
                with contextlib.suppress(OSError):
                    (tree / "legorl").mkdir(exist_ok=True)
                    (tree / "legorl" / name).mkdir()
                    cg.created.append(tree / "legorl" / name)
                    setattr(cg, attr, tree / "legorl" / name)
    except OSError:
        cg.remove()
        return None
    return cg


def stale(names_alive: set[str]) -> list[Path]:
    """legorl cgroup folders whose sandbox is not in ``names_alive`` (for gc), those that kill
    in one step (v2, then the v1 freezer) first."""
    parents = [ROOT / "legorl"]
    if not is_v2():
        unified = v2_root()
        parents = [unified / "legorl"] if unified is not None else []
        parents += [ROOT / c / "legorl" for c in ("freezer", "memory", "pids", "cpu")]
    out: list[Path] = []
    for parent in parents:
        if parent.is_dir():
            out += [p for p in parent.iterdir() if p.is_dir() and p.name not in names_alive]
    return out
