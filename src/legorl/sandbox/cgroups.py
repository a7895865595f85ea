"""Reading and (for the local backend) creating the cgroups that hold a sandbox's limits.

Both cgroup v1 (one tree per controller) and v2 (one unified tree) are handled. The counters
that classify a killed command are the kernel's own: ``oom_kill`` in ``memory.oom_control``
(v1) or ``memory.events`` (v2), and ``max`` in ``pids.events`` (refused forks).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from legorl.protocols import Limits
from legorl.sandbox.common import Counters, parse_counters

ROOT = Path("/sys/fs/cgroup")


def is_v2() -> bool:
    return (ROOT / "cgroup.controllers").is_file()


@dataclass(slots=True)
class CgroupSet:
    """The memory and pids cgroups of one sandbox (the same folder on v2)."""

    memory: Path | None = None
    pids: Path | None = None
    cpu: Path | None = None
    created: list[Path] = field(default_factory=list)  # folders we made (removed on close)

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
        dirs = {p for p in (self.memory, self.pids, self.cpu) if p is not None}
        return sorted(d / "cgroup.procs" for d in dirs)

    def kill_all(self) -> None:
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                for line in procs.read_text().split():
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(line), 9)

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
            cg.memory = cg.pids = cg.cpu = path
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
    except OSError:
        cg.remove()
        return None
    return cg


def stale(names_alive: set[str]) -> list[Path]:
    """legorl cgroup folders whose sandbox is not in ``names_alive`` (for gc)."""
    parents = (
        [ROOT / "legorl"] if is_v2() else [ROOT / c / "legorl" for c in ("memory", "pids", "cpu")]
    )
    out: list[Path] = []
    for parent in parents:
        if parent.is_dir():
            out += [p for p in parent.iterdir() if p.is_dir() and p.name not in names_alive]
    return out
