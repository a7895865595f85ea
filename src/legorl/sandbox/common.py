"""What both sandbox backends share: errors, the cache folder, run ownership, cross-process
locks, the output cap, the limit classification of a finished command, and the threads that
their blocking calls run on.

Nothing here talks to Docker or bubblewrap; see ``docker_backend.py`` and ``local_backend.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import ctypes
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from legorl.protocols import SandboxError

#: Where the repository sits inside every sandbox (as in SWE-bench images).
WORKDIR = "/testbed"
#: The environment layer's virtualenv inside every sandbox; its bin/ leads PATH.
ENV_DIR = "/opt/legorl-env"
#: The shared harness-runtime layer, attached read-only.
RUNTIME_DIR = "/opt/legorl-runtime"
#: The relay's socket and forwarder inside a sandbox that was given a proxy.
RELAY_DIR = "/run/legorl"
#: PATH inside a sandbox (the runtime's bin/ is appended when it is attached).
BASE_PATH = f"{ENV_DIR}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The unprivileged users (and groups) of judged commands (``Sandbox.exec(judged=True)``): each
#: sandbox draws its own from this range (``judged_uid``), which no image or host names. The
#: kernel keeps per-user state no namespace separates (the keyring, the counts of inotify
#: instances, processes, pipe buffers and message-queue bytes): one uid for every sandbox was a
#: channel between sandboxes alive at once (round 42: a passing trajectory's ordinary run, which
#: holds the tests as written, signalled their expected values to another trajectory's judged
#: run through the count of inotify instances). A uid of its own leaves a sandbox nothing to
#: share; the cost is that ``pwd`` knows no name for it (``getpass.getuser()`` reads ``USER``).
JUDGED_UID_BASE = 1 << 30
JUDGED_UID_SPAN = 1 << 24


def judged_uid() -> int:
    """A fresh sandbox's judged uid (and gid): drawn at random, so two sandboxes alive at once
    share one with odds of one in ``JUDGED_UID_SPAN``, which nothing inside either can raise."""
    return JUDGED_UID_BASE + secrets.randbelow(JUDGED_UID_SPAN)


#: The size cap of a grading sandbox's /tmp (a tmpfs).
GRADING_TMP_MB = 512
#: The size cap of a grading sandbox's /testbed (a tmpfs the repository is copied into), so
#: that what a judged command writes there is held in memory its sandbox is charged for, never
#: on the disk the judge and the other gradings share.
GRADING_REPO_MB = 1024
#: The inode caps of those two tmpfs mounts: a file costs kernel memory however small, and a
#: repository of SWE-bench's has a few thousand to some tens of thousands of them.
GRADING_TMP_INODES = 65_536
GRADING_REPO_INODES = 262_144
#: The open files of one process in a grading sandbox (soft and hard): with ``Limits.pids``
#: processes, a sandbox holds at most pids × this of the host's one open-file table
#: (``fs.file-max``), which every sandbox and the judge share (round 35: 8 processes of 19,000
#: files each took 150,000 of it, and 124 would have filled it, failing every other grading and
#: its control at once).
GRADING_OPEN_FILES = 1024
#: The capabilities root keeps in a grading sandbox, for its own grading steps (git apply, the
#: chown before the judged run, writing into the judged user's tree); judged commands hold none.
GRADING_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL")
#: The private folders of one judged command sit in a fresh ``/tmp/<prefix><random>``.
JUDGED_DIR_PREFIX = "legorl-judged-"


def judged_env(folder: str) -> dict[str, str]:
    """What a judged command's environment gets from its private ``folder`` (under /tmp)."""
    return {
        "HOME": f"{folder}/home",
        "TMPDIR": f"{folder}/tmp",
        "PYTHONPYCACHEPREFIX": f"{folder}/pycache",
    }


#: The subfolders of a judged command's private folder, each mode 0700.
JUDGED_SUBDIRS = ("home", "tmp", "pycache")

_T = TypeVar("_T")
_threads: concurrent.futures.ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


async def in_thread(fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    """``asyncio.to_thread`` on the sandboxes' own threads. A sandbox's exec holds a thread for
    as long as its command runs (a harness: minutes), and the loop's default pool has only
    cpu_count + 4 threads: on two cores the seventh busy sandbox's exec, start or close waited
    for one of the first six commands to end. Threads are made as calls need them."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=1024, thread_name_prefix="legorl-sandbox"
            )
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_threads, call)


class DaemonDownError(SandboxError):
    """The Docker daemon does not answer."""


class ImageMissingError(SandboxError):
    """A layer is not built and building was not allowed (``--no-build``)."""


class BuildError(SandboxError):
    """A build step failed; ``step`` names it and ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, *, step: str = "", log_tail: str = "", log_path: str = ""):
        super().__init__(message)
        self.step = step
        self.log_tail = log_tail
        self.log_path = log_path


def cache_root() -> Path:
    """``$LEGORL_CACHE/sandbox``, else ``~/.cache/legorl/sandbox``: locks, logs, usage, local layers."""
    base = os.environ.get("LEGORL_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "legorl"
    return root / "sandbox"


def state_root() -> Path:
    """Per-sandbox scratch (relay sockets, local private copies), short enough for socket paths."""
    base = os.environ.get("LEGORL_SANDBOX_STATE") or f"/tmp/legorl-sandbox-{os.getuid()}"
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def short_hash(data: Any, n: int = 16) -> str:
    """Stable content hash of a JSON-able value (sorted keys)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:n]


# ---- run ownership -------------------------------------------------------------------------


def _proc_start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: tells a live pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; fields restart after the last ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def owner_tag(pid: int | None = None) -> str:
    """``host:pid:start`` of the (current) process; labelled on everything it starts."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_proc_start_ticks(pid) or '?'}"


def write_owner(folder: Path, run_id: str, task_id: str) -> None:
    """``folder/owner.json``: who made the sandbox, for ``legorl sandbox gc``; written whole
    (a reader never sees half of it)."""
    tmp = folder / f".owner.json.{os.getpid()}"
    tmp.write_text(json.dumps({"owner": owner_tag(), "run": run_id, "task": task_id}))
    os.replace(tmp, folder / "owner.json")


def owner_alive(tag: str) -> bool | None:
    """True/False for an owner on this host; None when it lives on another host (unknown)."""
    host, _, rest = tag.partition(":")
    pid_s, _, start = rest.partition(":")
    if host != socket.gethostname():
        return None
    try:
        pid = int(pid_s)
    except ValueError:
        return False
    ticks = _proc_start_ticks(pid)
    return ticks is not None and (start in ("?", "") or ticks == start)


# ---- streams ---------------------------------------------------------------------------------


class StreamOver(Exception):
    """A stream went past what its reader may take."""


class ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (a daemon's stream) that refuses to read
    past ``cap`` bytes (None: no cap)."""

    def __init__(self, chunks: Any, cap: int | None) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")
        self._cap = cap
        self._taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._taken += len(chunk)
            if self._cap is not None and self._taken > self._cap:
                raise StreamOver
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


# ---- mounts ----------------------------------------------------------------------------------


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


def mounts() -> list[tuple[str, str, set[str]]]:
    """This process's mounts from /proc/self/mountinfo: (mount point, file system type, mount
    options), the point's octal escapes undone."""
    unescape = functools.partial(re.sub, rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]))
    out = []
    with open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            fields = line.split()
            kind = fields[fields.index(b"-") + 1]
            point = os.fsdecode(unescape(fields[4]))
            out.append((point, os.fsdecode(kind), set(os.fsdecode(fields[5]).split(","))))
    return out


def mount_points() -> list[str]:
    """This process's mount points (octal escapes undone)."""
    return [point for point, _, _ in mounts()]


def remove_folder(folder: Path) -> None:
    """Remove a sandbox's private folder, whatever a judged command left in it: every mount at
    or below it detached first, then ``rm -rf``, which walks a tree of any depth (Python's
    ``rmtree`` recurses once per level and raises ``RecursionError`` on a deep one). Never
    raises."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        inside = str(folder).rstrip("/")
        points = [p for p in mount_points() if p == inside or p.startswith(inside + "/")]
        detached: list[str] = []
        for point in sorted(set(points), key=len):  # a detached mount takes those below it
            if not any(point.startswith(d + "/") for d in detached):
                _libc.umount2(os.fsencode(point), _MNT_DETACH)
                detached.append(point)
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(folder)],
            capture_output=True,
            timeout=3600,
        )


# ---- locks and usage -----------------------------------------------------------------------

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Exclusive across threads and processes: concurrent builds of one layer wait for one."""
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(name, threading.Lock())
    path = cache_root() / "locks" / (name.replace("/", "_").replace(":", "_") + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tlock, open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def touch_usage(key: str) -> None:
    """Record that a layer was just used (its usage file's mtime is the last use)."""
    path = cache_root() / "usage" / key.replace("/", "_").replace(":", "_")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass  # usage is advisory (LRU order); never fail a start for it


def last_used(key: str) -> float | None:
    path = cache_root() / "usage" / key.replace("/", "_").replace(":", "_")
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def set_last_used(key: str, when: float) -> None:
    touch_usage(key)
    path = cache_root() / "usage" / key.replace("/", "_").replace(":", "_")
    os.utime(path, (when, when))


# ---- output and limits ---------------------------------------------------------------------

TRUNCATION_MARK = "\n[… legorl: {n} bytes of output cut …]\n"


class OutputCap:
    """Keeps the first and last halves of at most ``limit`` bytes; the middle is counted."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        half = self.limit // 2
        room = half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            keep = self.limit - half
            if len(self.tail) > keep:
                del self.tail[: len(self.tail) - keep]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def data(self) -> bytes:
        """What was kept, as one copy (the mark of the cut between its halves)."""
        if not self.truncated:
            return b"".join((self.head, self.tail))
        mark = TRUNCATION_MARK.format(n=self.total - len(self.head) - len(self.tail))
        return b"".join((self.head, mark.encode(), self.tail))


@dataclass(slots=True)
class Counters:
    """Monotonic kernel counters of a sandbox's cgroup: OOM kills and refused forks."""

    oom_kills: int = 0
    pids_max_hits: int = 0


def parse_counters(oom_text: str, pids_text: str) -> Counters:
    """From ``memory.oom_control`` / ``memory.events`` and ``pids.events`` contents."""
    c = Counters()
    for line in oom_text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            c.oom_kills = int(value)
    for line in pids_text.splitlines():
        key, _, value = line.partition(" ")
        if key == "max" and value.strip().isdigit():
            c.pids_max_hits = int(value)
    return c


def classify(
    exit_code: int | None,
    *,
    timed_out: bool,
    wall_hit: bool,
    before: Counters | None,
    after: Counters | None,
) -> str | None:
    """Which limit ended (or crippled) a command, most specific first."""
    if before is not None and after is not None:
        if after.oom_kills > before.oom_kills:
            return "memory"
        if after.pids_max_hits > before.pids_max_hits:
            return "pids"
    if wall_hit:
        return "wall"
    if timed_out:
        return "timeout"
    return None


class Deadline:
    """A sandbox's wall-time budget (``Limits.wall_s``) shared by its commands."""

    def __init__(self, wall_s: float) -> None:
        self.end = time.monotonic() + wall_s

    def left(self) -> float:
        return self.end - time.monotonic()
