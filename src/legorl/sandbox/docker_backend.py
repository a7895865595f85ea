"""The ``docker`` sandbox backend: the real Docker engine through the ``docker`` SDK.

    from legorl.sandbox import make_backend
    backend = make_backend("docker")
    box = await backend.start(task, "fixtures/tasks", run_id="r1", proxy_url="http://127.0.0.1:8000/s/x")
    result = await box.exec("python -m pytest -q", timeout=120)
    patch = await box.diff()
    await box.close()

Containers run on the images of the layered cache (``docker_images.py``). The harness runtime
is a named volume ``legorl-runtime-<key>`` mounted read-only. Containers run with
``--network none``; a proxy is reached through the relay (``relay.py``). Every container
carries ``legorl.run`` and ``legorl.owner`` labels; a backend's first start removes containers
whose owner process is dead, and ``legorl sandbox gc`` removes the rest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from legorl.protocols import READ_LIMIT, ExecResult, FileTooLarge, Limits, SandboxError
from legorl.sandbox import cgroups, memory_root, tree_probe
from legorl.sandbox.common import (
    BASE_PATH,
    GRADING_CAPS,
    GRADING_OPEN_FILES,
    GRADING_REPO_INODES,
    GRADING_REPO_MB,
    GRADING_TMP_INODES,
    GRADING_TMP_MB,
    JUDGED_DIR_PREFIX,
    JUDGED_SUBDIRS,
    RELAY_DIR,
    RUNTIME_DIR,
    WORKDIR,
    ChunkReader,
    Counters,
    Deadline,
    OutputCap,
    StreamOver,
    classify,
    in_thread,
    judged_env,
    judged_uid,
    last_used,
    owner_alive,
    owner_tag,
    parse_counters,
    remove_folder,
    state_root,
    touch_usage,
    write_owner,
)
from legorl.sandbox.docker_images import (
    LABEL,
    DockerCache,
    DockerConfig,
    connect,
    docker_host,
    last_line,
)
from legorl.sandbox.layers import plan
from legorl.sandbox.relay import FORWARDER, Relay, inside_port, open_relay, split_proxy_url

TREE_LIMIT = 4 << 30  # bytes of /testbed copied out for diff()
#: Tar framing around one file in the daemon's archive: headers (pax ones too) and padding.
_TAR_SLACK = 1 << 16


# ---- containers ------------------------------------------------------------------------------


#: A grading container's first process (pid 1), run by the image's own Python as root: it
#: reaps the orphans the judged commands leave, as an init would, and ends the container after
#: argv[1] seconds (or on SIGTERM).
_REAPER = [
    "python3", "-I", "-S", "-c",
    "import os, signal, sys, time\n"
    "for sig in (signal.SIGALRM, signal.SIGTERM):\n"
    "    signal.signal(sig, lambda *_: os._exit(0))\n"
    "signal.alarm(int(sys.argv[1]))\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        time.sleep(1)\n",
]  # fmt: skip

#: How long an ended command's stream must stay quiet before its output is taken as complete.
_DRAIN_S = 1.0


def _frames(buf: bytearray) -> list[tuple[int, bytes]]:
    """Pop complete multiplexed frames (8-byte header: stream, 0, 0, 0, size) from ``buf``."""
    out = []
    while len(buf) >= 8:
        stream, size = buf[0], struct.unpack(">I", bytes(buf[4:8]))[0]
        if len(buf) < 8 + size:
            break
        out.append((stream, bytes(buf[8 : 8 + size])))
        del buf[: 8 + size]
    return out


class DockerSandbox:
    """One running container; see ``legorl.protocols.Sandbox``."""

    def __init__(
        self,
        backend: DockerBackend,
        container_id: str,
        name: str,
        *,
        limits: Limits,
        base_sha: str,
        relay: Relay | None,
        folder: Path | None,
        runtime: bool,
        image: str = "",
        env_path: str = BASE_PATH,
        env_vars: dict[str, str] | None = None,
        grading: bool = False,
    ) -> None:
        self.backend = backend
        self.grading = grading
        self._judged_ready = False  # the repository is chowned to the judged user
        self.judged_uid = judged_uid()  # this sandbox's own (`common.JUDGED_UID_BASE`)
        self.api = backend.api
        self.id = name
        self.container_id = container_id
        self.workdir = WORKDIR
        self.proxy_url = relay.inside_url if relay else None
        self.runtime_dir = RUNTIME_DIR if runtime else None
        self.limits = limits
        self.base_sha = base_sha
        self.image = image
        self._relay = relay
        self._folder = folder  # its relay's socket, its private view (`memory_root.py`)
        self._deadline = Deadline(limits.wall_s)
        self._cgroups: cgroups.CgroupSet | None = None
        self._closed = False
        self.env_path = env_path + (f":{RUNTIME_DIR}/bin" if runtime else "")
        #: What the image's env's activation sets (``images.probe_script``), for every command.
        self.env_vars = dict(env_vars or {})
        #: What a harness adds to a command's env: the activated env, PATH with the env's
        #: folder (and the runtime).
        self.runtime_env = {**self.env_vars, "PATH": self.env_path}
        #: The OpenHands SDK's Python when the runtime is attached.
        self.openhands_python = f"{RUNTIME_DIR}/openhands/bin/python" if runtime else None

    # -- exec

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        on_output: Callable[[bytes], None] | None = None,
        judged: bool = False,
    ) -> ExecResult:
        return await in_thread(
            self.exec_sync,
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            on_output=on_output,
            judged=judged,
        )

    def _judged_folder(self) -> str:
        """As root: the repository chowned to the judged user (before the first judged
        command; ``-h``: a symlink in the tree is changed itself, never what it points at),
        and a fresh private folder for this judged command, empty, mode 0700, its owner."""
        folder = f"/tmp/{JUDGED_DIR_PREFIX}{secrets.token_hex(8)}"
        dirs = [folder, *(f"{folder}/{sub}" for sub in JUDGED_SUBDIRS)]
        owner = f"{self.judged_uid}:{self.judged_uid}"
        steps = [] if self._judged_ready else [["chown", "-R", "-h", "-P", owner, WORKDIR]]
        steps += [["mkdir", "-m", "0700", *dirs], ["chown", owner, *dirs]]
        script = " && ".join(" ".join(step) for step in steps)
        made = self.exec_sync(["/bin/sh", "-c", script], timeout=300, cwd="/")
        if made.exit_code != 0:
            raise SandboxError(
                f"sandbox {self.id}: cannot prepare the judged run: {_last(made.output)}"
            )
        self._judged_ready = True
        return folder

    def exec_sync(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | Iterable[bytes] | None = None,
        on_output: Callable[[bytes], None] | None = None,
        output_limit: int | None = None,
        judged: bool = False,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        private = judged_env(self._judged_folder()) if judged else {}
        left = self._deadline.left()
        if left <= 0:
            return ExecResult(exit_code=None, timed_out=True, killed_by="wall")
        wall_bound = left < timeout
        budget = min(timeout, left)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        environment = {**self.env_vars, "PATH": self.env_path, **(env or {}), **private}
        started = time.monotonic()
        before = self._counters()
        try:
            ex = self.api.exec_create(
                self.container_id,
                # One pipe for both streams keeps their interleaving exact.
                [
                    "timeout",
                    "-s",
                    "KILL",
                    f"{budget:.3f}",
                    "/bin/sh",
                    "-c",
                    'exec "$@" 2>&1',
                    "sh",
                    *argv,
                ],
                stdout=True,
                stderr=True,
                stdin=stdin is not None,
                environment=environment,
                workdir=cwd or WORKDIR,
                user=f"{self.judged_uid}:{self.judged_uid}" if judged else "",
            )
        except Exception as exc:
            raise SandboxError(f"sandbox {self.id}: exec failed: {_short(exc)}") from None
        cap = OutputCap(self.limits.output_bytes if output_limit is None else output_limit)
        self._stream(ex["Id"], stdin, cap, on_output, started + budget + 5.0)
        info = self.api.exec_inspect(ex["Id"])
        duration = time.monotonic() - started
        code = info.get("ExitCode")
        if info.get("Running"):
            code = None  # outlived even the kill (only a process that left its group can)
        timed_out = code is None or (code in (124, 137) and duration >= budget - 0.05)
        after = self._counters() if code != 0 else before
        killed_by = classify(
            code,
            timed_out=timed_out,
            wall_hit=timed_out and wall_bound,
            before=before,
            after=after,
        )
        if killed_by == "pids":
            with contextlib.suppress(TypeError, ValueError):
                self._end_group(int(info.get("Pid") or 0))
        if killed_by in ("timeout", "wall") or (killed_by == "memory" and code == 137):
            code = None
        return ExecResult(
            exit_code=code,
            data=cap.data(),
            timed_out=timed_out,
            truncated=cap.truncated,
            killed_by=killed_by,
            duration_s=duration,
        )

    def _stream(
        self,
        exec_id: str,
        stdin: bytes | Iterable[bytes] | None,
        cap: OutputCap,
        on_output: Callable[[bytes], None] | None,
        hard_deadline: float,
    ) -> None:
        sock, pending = self.backend.exec_socket(exec_id)
        buf = bytearray(pending)
        try:
            if stdin is not None:
                for chunk in [stdin] if isinstance(stdin, bytes) else stdin:
                    sock.sendall(chunk)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            idle_since = time.monotonic()
            ended = False
            while True:
                for _, data in _frames(buf):
                    cap.add(data)
                    if on_output is not None:
                        on_output(data)
                now = time.monotonic()
                if now > hard_deadline:
                    return
                ready, _, _ = select.select([sock], [], [], 0.25)
                if ready:
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        for _, frame in _frames(buf):
                            cap.add(frame)
                            if on_output is not None:
                                on_output(frame)
                        return
                    buf += data
                    idle_since = now
                elif ended and now - idle_since > _DRAIN_S:
                    return  # ended, and no more output came: a background child holds the stream
                elif not ended and now - idle_since > 0.5:
                    # The command may have ended while a background child keeps the stream open.
                    # Docker answers the start before the process runs (not yet started reads as
                    # not running, with no exit code), and copies the output to this socket after
                    # the process has ended: both can lag on a busy host, so the stream is read
                    # until it has been quiet for _DRAIN_S after the end.
                    idle_since = now
                    info = self.api.exec_inspect(exec_id)
                    ended = not info.get("Running") and info.get("ExitCode") is not None
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _end_group(self, leader: int) -> None:
        """SIGKILL to the command's leftovers, which still hold the PIDs, so the sandbox stays
        usable: the processes of its group (``timeout`` made one, led by the exec's pid) that
        are in this container's cgroups. Each is held by a pidfd while it is checked, so a pid
        the host gave to another process after the group ended (another trajectory's command,
        the grader) is never signalled; a remote daemon's pids are not this host's, and nothing
        is."""
        if leader <= 0 or self._cgroups is None:
            return
        for pid in self._cgroups.pids_inside():
            try:
                handle = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if os.getpgid(pid) == leader and pid in self._cgroups.pids_inside():
                    signal.pidfd_send_signal(handle, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(handle)

    def _counters(self) -> Counters | None:
        if self._cgroups is None:
            try:
                pid = self.api.inspect_container(self.container_id)["State"]["Pid"]
            except Exception:
                return None
            self._cgroups = cgroups.of_pid(pid)
        counters = self._cgroups.counters()
        if counters is not None:
            return counters
        # A remote daemon: ask inside (fails when the pids limit is still exhausted).
        v1 = "/sys/fs/cgroup/memory/memory.oom_control"
        try:
            oom = self._read_inside(v1) or self._read_inside("/sys/fs/cgroup/memory.events")
            pids = self._read_inside("/sys/fs/cgroup/pids/pids.events") or self._read_inside(
                "/sys/fs/cgroup/pids.events"
            )
        except Exception:
            return None
        return parse_counters(oom.decode(), pids.decode())

    def _read_inside(self, path: str) -> bytes:
        try:
            return self.read_file_sync(path, 1 << 20)
        except FileNotFoundError:
            return b""

    # -- files

    async def write_file(self, path: str, data: bytes) -> None:
        await in_thread(self.write_file_sync, path, data)

    def write_file_sync(self, path: str, data: bytes) -> None:
        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        folder, _, name = full.rstrip("/").rpartition("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        import docker.errors

        if self.grading:
            # The archive API sees the image's layers, not a grading sandbox's tmpfs mounts
            # (/testbed, /tmp): the tar goes in on a command's stdin instead.
            put = self.exec_sync(
                ["sh", "-c", 'mkdir -p "$1" && tar -x -C "$1"', "sh", folder or "/"],
                stdin=buf.getvalue(),
                timeout=120,
            )
            if put.exit_code != 0:
                raise SandboxError(f"sandbox {self.id}: cannot write {full}: {_last(put.output)}")
            return
        try:
            self.api.put_archive(self.container_id, folder or "/", buf.getvalue())
        except docker.errors.NotFound:
            made = self.exec_sync(["mkdir", "-p", folder], timeout=30)
            if made.exit_code != 0:
                raise SandboxError(
                    f"sandbox {self.id}: cannot create {folder}: {made.output}"
                ) from None
            self.api.put_archive(self.container_id, folder, buf.getvalue())

    async def read_file(self, path: str, *, limit: int | None = READ_LIMIT) -> bytes:
        return await in_thread(self.read_file_sync, path, limit)

    def read_file_sync(self, path: str, limit: int | None = READ_LIMIT) -> bytes:
        """The daemon's tar stream of ``path``, read chunk by chunk: the size the daemon
        states is checked before any byte is read, and the stream is never read past
        ``limit`` plus the tar framing (a file may grow after the daemon stats it)."""
        import docker.errors

        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        if self.grading:
            return self._read_by_tar(full, limit)
        try:
            stream, stat = self.api.get_archive(self.container_id, full)
        except docker.errors.NotFound:
            raise FileNotFoundError(f"{full}: no such file in sandbox {self.id}") from None
        try:
            size = (stat or {}).get("size")
            if limit is not None and isinstance(size, int) and size > limit:
                raise FileTooLarge(full, limit, size)
            reader = ChunkReader(stream, None if limit is None else limit + _TAR_SLACK)
            try:
                return self._only_file(reader, full, limit)
            except StreamOver:
                raise FileTooLarge(full, limit or 0) from None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def _only_file(self, stream: Any, full: str, limit: int | None) -> bytes:
        """The one member of a tar stream of ``full``: a regular file within ``limit``."""
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise IsADirectoryError(f"{full}: not a regular file in sandbox {self.id}")
            if limit is not None and member.size > limit:
                raise FileTooLarge(full, limit, member.size)
            fh = tar.extractfile(member)
            assert fh is not None
            return fh.read()

    def _read_by_tar(self, full: str, limit: int | None) -> bytes:
        """A grading sandbox's file, as a tar stream from a command in it (the archive API
        would read below its tmpfs mounts), cut at ``limit`` plus the tar framing: tar neither
        follows a link nor opens anything but a regular file's contents."""
        folder, _, name = full.rstrip("/").rpartition("/")
        cap = None if limit is None else limit + _TAR_SLACK
        got = bytearray()

        def keep(chunk: bytes) -> None:
            if cap is None or len(got) <= cap:
                got.extend(chunk)

        script = 'test -e "$1/$2" || test -L "$1/$2" || exit 3; tar -c -C "$1" -- "$2" 2>/dev/null'
        if cap is not None:
            script += f" | head -c {cap + 1}"
        run = self.exec_sync(
            ["sh", "-c", script, "sh", folder or "/", name],
            timeout=120,
            on_output=keep,
            output_limit=4096,
        )
        if run.exit_code == 3:
            raise FileNotFoundError(f"{full}: no such file in sandbox {self.id}")
        if run.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: cannot read {full}: {_last(run.output)}")
        if cap is not None and len(got) > cap:
            raise FileTooLarge(full, limit or 0)
        try:
            return self._only_file(io.BytesIO(bytes(got)), full, limit)
        except tarfile.TarError as exc:
            raise SandboxError(f"sandbox {self.id}: cannot read {full}: {exc}") from None

    async def diff(self) -> str:
        return await in_thread(self.diff_sync)

    def diff_sync(self) -> str:
        """The agent's changes against the base commit, computed outside the agent's reach: the
        daemon copies /testbed into a fresh container of the pristine instance image (its own
        git, shell and .git, which the agent never touched) and ``tree_probe`` diffs it there
        with a clean configuration; the patch is read from a file, never from a merged stream."""
        import docker.errors

        with tempfile.TemporaryFile(prefix="legorl-tree-") as tmp:
            self._archive_into(tmp, WORKDIR, "cannot copy the tree")
            helper = self.backend.helper_box(self.image, base_sha=self.base_sha)
            try:
                # The daemon refuses some trees (round 9: a symlink that leaves the tree is
                # an "invalid symlink"): a failure of this diff, never an error of the stage.
                if not self.api.put_archive(helper.container_id, "/tmp", tmp):
                    raise SandboxError(f"sandbox {self.id}: copying the tree for the diff failed")
                return helper.probe_diff("/tmp/testbed", f"{WORKDIR}/.git")
            except docker.errors.APIError as exc:
                raise SandboxError(
                    f"sandbox {self.id}: copying the tree for the diff failed: {_short(exc)}"
                ) from None
            finally:
                helper.close_sync()

    def probe_diff(self, root: str, git_dir: str) -> str:
        """Run ``tree_probe``'s diff of ``root`` in this (trusted) container: the script on
        stdin, the request as its argument, the result (patch included) as its last line."""
        work = f"/tmp/legorl-diff-{secrets.token_hex(4)}"
        req = {
            "mode": "diff",
            "root": root,
            "git_dir": git_dir,
            "base": self.base_sha,
            "index": f"{work}-index",
            "out": f"{work}-out",
            "skip_junk": True,
            "respect_ignores": True,
            "listing": False,
            "print": True,
        }
        run = self.exec_sync(
            ["python3", "-I", "-S", "-", json.dumps(req)],
            timeout=300,
            cwd="/",
            stdin=Path(tree_probe.__file__).read_bytes(),
            output_limit=256 << 20,
        )
        try:
            out = json.loads(run.output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise SandboxError(f"sandbox {self.id}: git diff failed: {_last(run.output)}") from None
        if "error" in out or run.truncated:
            why = out.get("error", "the patch is larger than 256 MiB")
            raise SandboxError(f"sandbox {self.id}: git diff failed: {why}")
        if out.get("too_large"):
            raise SandboxError(f"sandbox {self.id}: git diff failed: {tree_probe.too_large(out)}")
        return str(out["patch"])

    async def alive(self) -> bool | None:
        return await in_thread(self.alive_sync)

    def alive_sync(self) -> bool | None:
        """The daemon's view, never a command in the container (the agent, root there, may
        have replaced ``true`` or ``timeout``): True while the container runs; False when
        the daemon answers and the container has stopped or is gone (what ran in it ended
        it: its first process exits with its child, or a grading container's reaper at its
        deadline, and the container is removed on exit); None when the daemon does not
        answer."""
        import docker.errors

        try:
            self.api.ping()
            state = self.api.inspect_container(self.container_id).get("State", {})
        except docker.errors.NotFound:
            return False
        except Exception:
            return None
        return bool(state.get("Running"))

    # -- close

    def _archive_into(self, out: Any, path: str, failure: str) -> None:
        """The daemon's tar stream of ``path`` written to the file ``out`` (rewound after),
        at most ``TREE_LIMIT`` of it."""
        import docker.errors

        try:
            stream, _ = self.api.get_archive(self.container_id, path)
            for chunk in stream:
                if out.tell() + len(chunk) > TREE_LIMIT:
                    raise SandboxError(
                        f"sandbox {self.id}: {path} is larger than {TREE_LIMIT >> 30} GiB"
                    )
                out.write(chunk)
        except docker.errors.APIError as exc:
            raise SandboxError(f"sandbox {self.id}: {failure}: {_short(exc)}") from None
        out.seek(0)

    def fill_repo(self) -> None:
        """Copy the image's repository into this grading sandbox's /testbed tmpfs.

        The archive API reads the container's image layers, below its tmpfs mounts, so it
        yields the pristine repository the tmpfs hides; tar, as root, keeps owners and modes.
        The archive is spooled to a file first (the daemon holds the container while it
        streams one, so a command in it would wait), and goes in from there in chunks.
        """

        with tempfile.SpooledTemporaryFile(max_size=8 << 20, prefix="legorl-repo-") as spool:
            self._archive_into(spool, f"{WORKDIR}/.", "cannot read the image's repository")
            put = self.exec_sync(
                ["sh", "-c", f"tar -x -C {WORKDIR} --strip-components=1 && test -d {WORKDIR}/.git"],
                stdin=iter(lambda: spool.read(1 << 20), b""),
                timeout=600,
            )
        if put.exit_code != 0:
            raise SandboxError(
                f"sandbox {self.id}: cannot copy the repository into {WORKDIR}: {_last(put.output)}"
            )

    async def close(self) -> None:
        await in_thread(self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.remove_container(self.container_id)
        if self._relay is not None:
            self._relay.close()
        if self._folder is not None and self._folder.exists():
            remove_folder(self._folder)


def _short(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    return re.sub(r"\s+", " ", str(text))[:300]


def _last(text: str) -> str:
    return last_line(text)


# ---- the backend -----------------------------------------------------------------------------


class DockerBackend:
    """``SandboxBackend`` on the Docker engine; ``config_class`` is ``DockerConfig``."""

    name = "docker"
    config_class: ClassVar[type] = DockerConfig

    def __init__(self, config: DockerConfig | None = None) -> None:
        self.config = config or DockerConfig()
        self._api: Any = None
        self._cache: DockerCache | None = None
        self._reaped = False  # containers of dead runs are removed at the first start
        self._lock = threading.Lock()

    @property
    def api(self) -> Any:
        with self._lock:
            if self._api is None:
                self._api = connect(self.config)
            return self._api

    @property
    def cache(self) -> DockerCache:
        api = self.api
        with self._lock:
            if self._cache is None:
                self._cache = DockerCache(api, self.config)
            return self._cache

    def exec_socket(self, exec_id: str) -> tuple[socket.socket, bytes]:
        """Start an exec and return its hijacked stream socket plus bytes already read past the
        response headers. Over a unix socket we speak the HTTP upgrade ourselves, so no byte of
        a fast command's output can sit unseen in a client library's buffer."""
        host = docker_host(self.config)
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(host[len("unix://") :])
            body = b'{"Detach":false,"Tty":false}'
            version = self.api.api_version
            head = (
                f"POST /v{version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
                "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            sock.sendall(head + body)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise SandboxError("docker closed the exec stream before answering")
                data += chunk
            header, _, rest = data.partition(b"\r\n\r\n")
            status = header.split(b"\r\n", 1)[0]
            if b" 101 " not in status and b" 200 " not in status:
                raise SandboxError(f"docker exec start: {status.decode(errors='replace')}")
            return sock, rest
        raw = self.api.exec_start(exec_id, socket=True)
        return getattr(raw, "_sock", raw), b""

    def ensure_images(self, tasks: list[Any]) -> None:
        """Every prebuilt image the tasks name present, pulled when missing: a run's first
        check, so an image that is not here and cannot be pulled stops it in one line."""
        seen: set[str] = set()
        for task in tasks:
            if task.image and task.image not in seen:
                seen.add(task.image)
                image = plan(task, history=self.config.history)[0]
                self.cache._ensure_layer(image, task, Path("."), self.config.build)

    def helper_box(self, image: str, *, base_sha: str) -> DockerSandbox:
        """A fresh container of ``image`` (no network) for work the agent must not reach."""
        name = f"legorl-helper-{secrets.token_hex(6)}"
        host_config = self.api.create_host_config(
            network_mode="none", auto_remove=True, security_opt=["no-new-privileges"]
        )
        try:
            cid = self.api.create_container(
                image,
                command=["sleep", "900"],
                name=name,
                labels={LABEL: "1", "legorl.owner": owner_tag(), "legorl.image": image},
                host_config=host_config,
            )["Id"]
            self.api.start(cid)
        except Exception as exc:
            raise SandboxError(
                f"cannot start a helper container of {image}: {_short(exc)}"
            ) from None
        limits = Limits(wall_s=900)
        return DockerSandbox(
            self,
            cid,
            name,
            limits=limits,
            base_sha=base_sha,
            relay=None,
            folder=None,
            runtime=False,
        )

    def remove_container(self, container_id: str) -> None:
        import docker.errors

        try:
            # v: anonymous volumes go with the container; named ones (the harness runtime)
            # stay.
            self.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress (auto-remove)
                raise SandboxError(
                    f"cannot remove container {container_id[:12]}: {_short(exc)}"
                ) from None

    def remove_containers(self, ids: list[str]) -> None:
        """Remove several at once: each removal waits for a kill, so do them side by side."""
        if not ids:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(ids))) as pool:
            for future in [pool.submit(self.remove_container, cid) for cid in ids]:
                with contextlib.suppress(SandboxError):
                    future.result()

    def reap_dead(self) -> list[str]:
        """Remove containers whose owning process is dead (once per backend, at first start)."""
        removed = []
        for c in self.api.containers(all=True, filters={"label": "legorl.owner"}):
            owner = (c.get("Labels") or {}).get("legorl.owner", "")
            if owner_alive(owner) is False:
                removed.append(c["Id"])
        self.remove_containers(removed)
        return removed

    async def start(
        self,
        task: Any,
        tasks_dir: str,
        *,
        run_id: str,
        proxy_url: str | None = None,
        limits: Limits | None = None,
        harness_runtime: bool = False,
        grading: bool = False,
    ) -> DockerSandbox:
        return await in_thread(
            self.start_sync,
            task,
            tasks_dir,
            run_id=run_id,
            proxy_url=proxy_url,
            limits=limits,
            harness_runtime=harness_runtime,
            grading=grading,
        )

    def start_sync(
        self,
        task: Any,
        tasks_dir: str | Path,
        *,
        run_id: str,
        proxy_url: str | None = None,
        limits: Limits | None = None,
        harness_runtime: bool = False,
        grading: bool = False,
    ) -> DockerSandbox:
        import docker.errors
        from docker.types import Mount, Ulimit

        limits = limits or Limits()
        if grading and proxy_url:
            raise SandboxError(f"{task.instance_id}: a grading sandbox reaches no proxy")
        cache = self.cache
        with self._lock:
            first, self._reaped = not self._reaped, True
        if first:
            self.reap_dead()
        reports = cache.ensure(task, Path(tasks_dir))
        tag = reports[-1].tag
        info = cache.image(tag)
        assert info is not None
        labels_img = (info.get("Config") or {}).get("Labels") or {}
        base_sha = labels_img.get("legorl.base_sha") or "HEAD"
        env_path = labels_img.get("legorl.env_path") or BASE_PATH
        env_vars = json.loads(labels_img.get("legorl.env_activation") or "{}")
        mounts = []
        if harness_runtime:
            base_tag = reports[0].tag
            for volume, target, _ in cache.runtime_volumes(base_tag=base_tag):
                mounts.append(Mount(target, volume, type="volume", read_only=True))
        name = f"legorl-{secrets.token_hex(6)}"
        relay = None
        rundir = None
        binds = None
        if proxy_url:
            split_proxy_url(proxy_url)  # a bad URL fails before anything starts
            rundir = state_root() / name / "run"
            rundir.mkdir(parents=True)
            write_owner(rundir.parent, run_id, task.instance_id)
            shutil.copy(FORWARDER, rundir / "forwarder.py")
            relay = open_relay(rundir / "proxy.sock", proxy_url)
            binds = {str(rundir): {"bind": RELAY_DIR, "mode": "ro"}}
        lockdown: dict[str, Any] = {"cap_drop": ["NET_RAW", "MKNOD", "AUDIT_WRITE"]}
        if grading:
            # What a judged run reads comes from a copy of the image's root on tmpfs, whose
            # pages no other sandbox can drop or load (`memory_root.py`, round 44's channel).
            tree = memory_root.image_tree(self.api, info["Id"])
            folder = state_root() / name
            folder.mkdir()
            write_owner(folder, run_id, task.instance_id)
            try:
                view = memory_root.private_view(tree, folder)
            except BaseException:
                remove_folder(folder)
                raise
            for entry in memory_root.top_entries(tree):
                mounts.append(Mount(f"/{entry}", str(view / entry), type="bind", read_only=True))
            # The image's files read-only; /testbed and /tmp size-capped tmpfs, the image's
            # repository copied into /testbed once the container runs (`fill_repo`).
            lockdown = {
                "read_only": True,
                "tmpfs": {
                    "/tmp": f"rw,exec,nosuid,nodev,size={GRADING_TMP_MB}m,"
                    f"nr_inodes={GRADING_TMP_INODES},mode=1777",
                    WORKDIR: f"rw,exec,nosuid,nodev,size={GRADING_REPO_MB}m,"
                    f"nr_inodes={GRADING_REPO_INODES},mode=755",
                },
                "cap_drop": ["ALL"],
                "cap_add": list(GRADING_CAPS),
                "ulimits": [
                    Ulimit(name="nofile", soft=GRADING_OPEN_FILES, hard=GRADING_OPEN_FILES)
                ],
            }
        host_config = self.api.create_host_config(
            network_mode="none",
            # A grading container's first process is `_REAPER`, not Docker's init: that is a
            # host file bound into every container, one inode that any two containers' judged
            # code could lock and watch between them (round 43's channel).
            init=not grading,
            auto_remove=True,
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids,
            binds=binds,
            mounts=mounts or None,
            security_opt=["no-new-privileges"],
            **lockdown,
        )
        labels = {
            LABEL: "1",
            "legorl.run": run_id,
            "legorl.owner": owner_tag(),
            "legorl.task": task.instance_id,
            "legorl.image": tag,
        }
        if grading:
            labels["legorl.grading"] = "1"
        cid = ""
        try:
            for attempt in (1, 2):
                try:
                    container = self.api.create_container(
                        tag,
                        command=[
                            *(_REAPER if grading else ["sleep"]),
                            str(int(limits.wall_s) + 60),
                        ],
                        name=name if attempt == 1 else f"{name}-2",
                        labels=labels,
                        host_config=host_config,
                        working_dir=WORKDIR,
                    )
                    break
                except docker.errors.ImageNotFound:
                    # Removed behind our back (a gc elsewhere): forget it and build it again.
                    if attempt == 2:
                        raise
                    for report in reports:
                        cache.forget(report.tag)
                    cache.ensure(task, Path(tasks_dir))
            cid = container["Id"]
            self.api.start(cid)
        except Exception as exc:
            if cid:
                with contextlib.suppress(Exception):
                    self.remove_container(cid)
            if relay is not None:
                relay.close()
            remove_folder(state_root() / name)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(
                f"{task.instance_id}: cannot start a container: {_short(exc)}"
            ) from None
        box = DockerSandbox(
            self,
            cid,
            name,
            limits=limits,
            base_sha=base_sha,
            relay=relay,
            folder=state_root() / name,
            runtime=harness_runtime,
            image=tag,
            env_path=env_path,
            env_vars=env_vars,
            grading=grading,
        )
        touch_usage(tag)
        if grading:
            try:
                box.fill_repo()
            except BaseException:
                box.close_sync()
                raise
        if relay is not None:
            _, port, _ = split_proxy_url(proxy_url or "")
            ready = box.exec_sync(
                [
                    "python3",
                    f"{RELAY_DIR}/forwarder.py",
                    str(inside_port(port)),
                    f"{RELAY_DIR}/proxy.sock",
                    "--daemon",
                ],
                timeout=30,
            )
            if ready.exit_code != 0:
                box.close_sync()
                raise SandboxError(
                    f"{task.instance_id}: the proxy relay did not start: {_last(ready.output)}"
                )
        return box


def gc(
    config: DockerConfig | None = None,
    *,
    everything: bool = False,
    budget_gb: float | None = None,
    dry_run: bool = False,
) -> dict[str, list[str]]:
    """Remove legorl containers of dead processes (all with ``everything``), leftover build
    containers, dangling legorl images, runtime volumes unused for a week, and, with a budget,
    least-recently-used layers until the cache fits."""
    import docker.errors

    backend = DockerBackend(config)
    api = backend.api
    out: dict[str, list[str]] = {"containers": [], "images": [], "volumes": []}
    doomed = []
    for label in (LABEL, "legorl.build"):
        for c in api.containers(all=True, filters={"label": label}):
            owner = (c.get("Labels") or {}).get("legorl.owner", "")
            if everything or owner_alive(owner) is False:
                out["containers"].append(c["Names"][0].lstrip("/") if c.get("Names") else c["Id"])
                doomed.append(c["Id"])
    if not dry_run:
        backend.remove_containers(doomed)
    for img in api.images(filters={"dangling": True, "label": "legorl.layer"}):
        out["images"].append(img["Id"][:19])
        if not dry_run:
            with contextlib.suppress(docker.errors.APIError):
                api.remove_image(img["Id"])
    # Runtime volumes go when unused for a week (another checkout's or an older runtime), and
    # half-made ones when their builder is dead.
    week_ago = time.time() - 7 * 86400
    for vol in api.volumes(filters={"label": "legorl.layer"}).get("Volumes") or []:
        labels = vol.get("Labels") or {}
        partial = labels.get("legorl.layer") == "partial"
        if partial:
            doomed_volume = everything or owner_alive(labels.get("legorl.owner", "")) is False
        else:
            doomed_volume = everything or (last_used(vol["Name"]) or 0) < week_ago
        if not doomed_volume:
            continue
        if not dry_run:
            try:
                api.remove_volume(vol["Name"])
            except docker.errors.APIError:
                continue  # in use
        out["volumes"].append(vol["Name"])
    if budget_gb is not None and not dry_run:
        out["images"] += backend.cache.gc_budget(budget_gb)
    # The images' copies on tmpfs go with their images (`memory_root.py`).
    out["memory_roots"] = memory_root.gc({img["Id"] for img in api.images()}, dry_run=dry_run)
    return out
