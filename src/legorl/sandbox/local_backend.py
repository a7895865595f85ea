"""The ``local`` sandbox backend: bubblewrap, no Docker.

    backend = make_backend("local")
    box = await backend.start(task, "fixtures/tasks", run_id="r1")
    print((await box.exec("python -m pytest -q")).output)
    await box.close()

Each sandbox is a private copy of the instance repository at /testbed, a private /tmp and
HOME (/root), and a read-only view of the host's system folders (``/usr``, ``/etc``, the lib folders
and the Python the env layer runs on), never the user's home, the task files or the cache.
A grading sandbox's judged commands see none of those: their root is a copy on tmpfs of what
a test run needs (``memory_root.py``), through overlays of the sandbox's own (``view.py``), so
that no file their code can open (and lock, or time) is one another sandbox opens too; root's
own grading steps, which run none of the patch's code, keep the host's view.
Every command runs in a fresh ``bwrap`` with its own PID, IPC, UTS and network namespaces (no
network; a proxy is reached through the relay, as with Docker) and all capabilities dropped;
files persist between commands, processes do not. Where this process may create cgroups (root,
or a delegated cgroup v2 tree) the sandbox's CPU, memory and PIDs are limited and a killed
command is classified; elsewhere only wall time, timeouts and output size are enforced
(``LocalSandbox.limits_enforced`` says which).

Layers live under the cache folder: ``local/env-<key>/`` (a venv built inside bubblewrap, seen
at /opt/legorl-env) and ``local/instance-<key>/`` (the one-commit repository); keys are the
same kind of content hash as the Docker tags, with the host's Python as the base.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from legorl.protocols import READ_LIMIT, ExecResult, FileTooLarge, Limits, SandboxError
from legorl.sandbox import cgroups, memory_root, seccomp, tree_probe
from legorl.sandbox.common import (
    BASE_PATH,
    ENV_DIR,
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
    BuildError,
    Deadline,
    ImageMissingError,
    OutputCap,
    build_lock,
    cache_root,
    classify,
    in_thread,
    judged_env,
    judged_uid,
    owner_alive,
    remove_folder,
    state_root,
    touch_usage,
    write_owner,
)
from legorl.sandbox.docker_images import LayerReport
from legorl.sandbox.layers import Layer, env_layer, instance_layer, keep_up_to
from legorl.sandbox.relay import FORWARDER, Relay, inside_port, open_relay, split_proxy_url
from legorl.sandbox.repo import scrubbed_repo
from legorl.sandbox.runtime import RuntimeSources, local_layout, runtime_layer
from legorl.sandbox.view import View, mount_view


@functools.cache
def _command_filter() -> str:
    """The commands' seccomp filter for this machine, in hex (`seccomp.py`)."""
    try:
        return seccomp.command_filter(os.uname().machine).hex()
    except ValueError as exc:
        raise SandboxError(f"the local backend cannot confine a command: {exc}") from None


def _filter_fd() -> int:
    """A file holding the filter's program, for bubblewrap's ``--seccomp FD`` (read once: one
    file per command)."""
    fd = os.memfd_create("legorl-seccomp", os.MFD_CLOEXEC)
    os.write(fd, bytes.fromhex(_command_filter()))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


#: Host folders every sandbox sees read-only (merged-/usr symlinks are recreated as links).
HOST_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: The name of the sandbox's own user, as an agent's commands see it (run by root).
AGENT_USER = "agent"
#: The sandbox's folders its commands write and keep between commands (HOME, /tmp, the
#: repository): bwrap, which runs as the host's root, never makes a folder inside one.
WRITABLE = ("/root", "/tmp", WORKDIR)

#: How a command becomes the sandbox's user (a judged command always; run by root, an agent's
#: too), run by the host's Python (``-I -S``: nothing
#: from the repository or the environment is read) as root in a bubblewrap without a user
#: namespace, holding only CAP_SETUID, CAP_SETGID and CAP_SETPCAP: the bounding set emptied,
#: groups dropped, uid and gid set (which clears the permitted, effective and ambient sets),
#: the inheritable set cleared, the seccomp filter of ``seccomp.py`` installed (argv[2], its
#: instructions in hex: the kernel keyring and new user namespaces out of reach), then the
#: command. bwrap's own ``--uid`` needs a user namespace, and there it maps the judged uid onto
#: the caller's: run by root, the judged command would own every root-owned file (a 0700
#: folder of the grader's in /tmp included).
_BECOME_JUDGED = r"""
import ctypes, os, sys
uid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
with open("/proc/sys/kernel/cap_last_cap") as fh:
    last = int(fh.read())
for cap in range(last + 1):
    if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        sys.exit(f"legorl: cannot drop capability {cap} from the bounding set")
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
    sys.exit("legorl: cannot clear the capability sets")
code = bytes.fromhex(sys.argv[2])
program = ctypes.create_string_buffer(code, len(code))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    sys.exit("legorl: cannot set no_new_privs")
if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    sys.exit("legorl: cannot install the seccomp filter")
exe = sys.argv[3]
if "/" not in exe:  # looked up here: os.execvp would import modules lazily
    found = [f"{d}/{exe}" for d in os.environ.get("PATH", "").split(":") if d]
    exe = next((p for p in found if os.path.isfile(p) and os.access(p, os.X_OK)), exe)
try:
    os.execv(exe, sys.argv[3:])
except OSError as exc:
    print(f"legorl: {sys.argv[3]}: {exc.strerror}", file=sys.stderr)
    sys.exit(127)
"""


@dataclass(slots=True, kw_only=True)
class LocalConfig:
    build: bool = True  # False: a layer that is not built yet is an error (--no-build)
    bwrap: str = "bwrap"
    host_paths: tuple[str, ...] = HOST_PATHS
    step_timeout_s: float = 1800.0


def _layer_dir(layer: Layer) -> Path:
    return cache_root() / "local" / f"{layer.kind}-{layer.key}"


def host_python(version: str) -> dict[str, str]:
    """The host interpreter for ``version`` (e.g. "3.11"): its real path and prefix."""
    exe = shutil.which(f"python{version}")
    if exe is None:
        raise SandboxError(
            f"the local backend needs python{version} on PATH for this task's env layer"
        )
    probe = "import sys, platform; print(sys.executable); print(sys.base_prefix); print(platform.python_version())"
    proc = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SandboxError(f"python{version} does not run: {proc.stderr.strip()[:200]}")
    real, prefix, full = proc.stdout.split()
    # A venv made by this interpreter links to it; resolve shims (pyenv) to the real binary.
    return {"interpreter": str(Path(real).resolve()), "prefix": prefix, "version": full}


class LocalCache:
    """Env venvs and instance repositories for the local backend, keyed by content hash."""

    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        self._pythons: dict[str, dict[str, str]] = {}

    def plan(self, task: Any) -> list[Layer]:
        if task.image:
            raise SandboxError(
                f"{task.instance_id}: names the image {task.image}; the local backend builds "
                "from env recipes only (use --backend docker)"
            )
        if task.env is None:
            raise SandboxError(
                f"{task.instance_id}: the task names neither an image nor an env recipe"
            )
        if not task.source:
            raise SandboxError(f"{task.instance_id}: the task names no source repository")
        py = self._pythons.get(task.env.python)
        if py is None:
            py = self._pythons[task.env.python] = host_python(task.env.python)
        base = Layer("base", f"host-python{py['version']}", {"builder": "host", **py})
        env = env_layer(task, base)
        return [base, env, instance_layer(task, env)]

    def ensure(
        self, task: Any, tasks_dir: Path, *, level: str = "instance", build: bool | None = None
    ) -> list[LayerReport]:
        build = self.config.build if build is None else build
        reports = []
        for layer in keep_up_to(self.plan(task), level):
            if layer.kind == "base":
                reports.append(LayerReport("base", layer.key, layer.name, "cached"))
                continue
            reports.append(self._ensure(layer, task, Path(tasks_dir), build))
        return reports

    def _ensure(self, layer: Layer, task: Any, tasks_dir: Path, build: bool) -> LayerReport:
        path = _layer_dir(layer)
        tag = f"local/{layer.kind}:{layer.key}"
        if (path / "layer.json").is_file():
            touch_usage(tag)
            return LayerReport(layer.kind, tag, layer.name, "cached")
        if not build:
            raise ImageMissingError(
                f"{layer.kind} layer {tag} ({layer.name}) is not built and building is off "
                f"(--no-build); build it with `legorl sandbox build --backend local --tasks …`"
            )
        started = time.monotonic()
        with build_lock(tag):
            if (path / "layer.json").is_file():
                return LayerReport(layer.kind, tag, layer.name, "waited")
            partial = path.with_name(path.name + f".partial-{secrets.token_hex(4)}")
            partial.mkdir(parents=True)
            try:
                meta: dict[str, Any] = {
                    "kind": layer.kind,
                    "recipe": layer.recipe,
                    "name": layer.name,
                }
                if layer.kind == "env":
                    self._build_env(layer, partial, tag)
                else:
                    (partial / "repo").mkdir()
                    try:
                        meta["base_sha"] = scrubbed_repo(task, tasks_dir, partial / "repo")
                    except SandboxError as err:
                        raise BuildError(
                            f"instance layer {tag} ({layer.name}) failed at step 1/1 `checkout`: {err}",
                            step="checkout",
                        ) from None
                (partial / "layer.json").write_text(json.dumps(meta, indent=2))
                partial.rename(path)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
        touch_usage(tag)
        return LayerReport(layer.kind, tag, layer.name, "built", time.monotonic() - started)

    def _build_env(self, layer: Layer, folder: Path, tag: str) -> None:
        assert layer.parent is not None
        base = layer.parent.recipe
        venv_dir = folder / "venv"
        venv_dir.mkdir()
        log_path = cache_root() / "logs" / f"local-env-{layer.key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        steps: list[tuple[str, list[str]]] = [
            (
                f"python{layer.recipe['python']} -m venv {ENV_DIR}",
                [base["interpreter"], "-m", "venv", ENV_DIR],
            )
        ]
        if layer.recipe["packages"]:
            pkgs = layer.recipe["packages"]
            steps.append(
                (
                    f"pip install {' '.join(pkgs)}",
                    [f"{ENV_DIR}/bin/python", "-m", "pip", "install", "-q", *pkgs],
                )
            )
        steps += [(cmd, ["/bin/sh", "-c", cmd]) for cmd in layer.recipe["setup"]]
        # Build steps share the host's network (pip needs the registry) but not its files.
        bw = [
            self.config.bwrap,
            "--die-with-parent",
            "--unshare-pid",
            "--unshare-ipc",
            *_host_view(self.config.host_paths),
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--tmpfs", "/root",
            "--ro-bind", base["prefix"], base["prefix"],  # after /root: it may live there
            "--bind", str(venv_dir), ENV_DIR,
            "--chdir", "/",
        ]  # fmt: skip
        env = {"PATH": BASE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PIP_NO_CACHE_DIR": "1"}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        n = len(steps)
        for i, (name, argv) in enumerate(steps, start=1):
            with open(log_path, "ab") as log:
                log.write(f"$ {name}\n".encode())
                log.flush()
                try:
                    proc = subprocess.run(
                        [*bw, "--", *argv],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        timeout=self.config.step_timeout_s,
                    )
                    code = proc.returncode
                except subprocess.TimeoutExpired:
                    code = 124
                except FileNotFoundError:
                    raise BuildError(
                        f"env layer {tag}: bubblewrap ({self.config.bwrap}) is not installed "
                        "(apt-get install bubblewrap)",
                        step=name,
                    ) from None
            if code != 0:
                text = log_path.read_text(errors="replace")
                last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
                raise BuildError(
                    f"env layer {tag} ({layer.name}) failed at step {i}/{n} `{name}` "
                    f"(exit {code}): {last.strip()[:300]} (log: {log_path})",
                    step=name,
                    log_tail="\n".join(text.splitlines()[-20:]),
                    log_path=str(log_path),
                )

    def layer_meta(self, layer: Layer) -> dict[str, Any]:
        return json.loads((_layer_dir(layer) / "layer.json").read_text())

    def runtime(self, *, build: bool | None = None) -> tuple[Path, list[Path], LayerReport]:
        """The runtime layout folder and the host paths it points into."""
        build = self.config.build if build is None else build
        src = RuntimeSources.find()
        layer = runtime_layer(src)
        path = _layer_dir(layer)
        tag = f"local/runtime:{layer.key}"
        if (path / "binds.json").is_file():
            binds = [Path(p) for p in json.loads((path / "binds.json").read_text())]
            if _runtime_still_points_at(path, binds, src):
                touch_usage(tag)
                return path, binds, LayerReport("runtime", tag, layer.name, "cached")
            # The layout is symlinks into this host's installs: the same versions installed
            # elsewhere (another checkout's .venv-openhands) need a new layout, not a stale one.
            with build_lock(tag):
                if (path / "binds.json").is_file():
                    path.rename(path.with_name(path.name + f".stale-{secrets.token_hex(4)}"))
        if not build:
            raise ImageMissingError(
                f"runtime layer {tag} is not built and building is off (--no-build)"
            )
        with build_lock(tag):
            if not (path / "binds.json").is_file():
                partial = path.with_name(path.name + f".partial-{secrets.token_hex(4)}")
                partial.mkdir(parents=True)
                (partial / "root").mkdir()
                binds = local_layout(src, partial / "root", layer.recipe)
                (partial / "binds.json").write_text(json.dumps([str(b) for b in binds]))
                partial.rename(path)
        binds = [Path(p) for p in json.loads((path / "binds.json").read_text())]
        return path, binds, LayerReport("runtime", tag, layer.name, "built")


def _runtime_still_points_at(path: Path, binds: list[Path], src: RuntimeSources) -> bool:
    """Whether a built local runtime layout still leads to the host installs found now."""
    if not all(b.exists() for b in binds):
        return False
    link = path / "root" / "openhands"
    if src.openhands_venv is not None:
        return link.is_symlink() and Path(os.readlink(link)) == src.openhands_venv
    return not link.is_symlink()


def _host_view(paths: tuple[str, ...]) -> list[str]:
    """bwrap arguments for a read-only view of the host's system folders."""
    args: list[str] = []
    for path in paths:
        p = Path(path)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), path]
        elif p.is_dir():
            args += ["--ro-bind", path, path]
    return args


#: The size of a local judged command's own /dev/shm (Docker's default is the same).
JUDGED_SHM_BYTES = 64 << 20


def _tree_view(tree: Path, view: View, prefix: str, mounts: list[str]) -> list[str]:
    """bwrap arguments for a judged command's root: ``tree``'s top-level entries (through
    ``view``), then ``mounts`` (the sandbox's own), then the Python below them, if it lives in
    /root or /tmp."""
    args = ["--hostname", "sandbox"]
    below = ("root", "tmp")
    for entry in sorted(tree.iterdir()):
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), f"/{entry.name}"]
        elif entry.name not in below:
            args += view.ro_bind(str(entry), f"/{entry.name}")
    args += mounts
    if prefix.strip("/").split("/")[0] in below:
        args += _ro_binds([(str(tree / prefix.lstrip("/")), prefix)], (), view.ro_bind)
    return args


def _ro_binds(
    binds: list[tuple[str, str]],
    host_paths: tuple[str, ...],
    bind: Callable[[str, str], list[str]] = lambda source, dest: ["--ro-bind", source, dest],
) -> list[str]:
    """bwrap arguments binding each ``(source, destination)`` read-only, after the sandbox's
    own folders are mounted, with the folders on the way made here (mode 0755: bwrap makes
    them 0700, which would keep a judged user from a Python below /root).

    A folder directly below one the sandbox writes and keeps (``WRITABLE``) is a fresh tmpfs,
    and the rest are made on it: bwrap runs as the host's root and follows links, so a folder
    it made inside HOME would follow whatever a command left there (round 71: ``~/.pyenv``
    replaced by a link to a host folder, and the next command's bwrap made folders in the
    host's). A destination inside a host folder the view binds is already there."""
    args: list[str] = []
    made: set[str] = set()
    for source, dest in binds:
        if not any(dest == h or dest.startswith(h.rstrip("/") + "/") for h in host_paths):
            parts = Path(dest).parts[1:-1]
            for i in range(1, len(parts) + 1):
                folder = "/" + "/".join(parts[:i])
                if folder in WRITABLE or folder in made:
                    continue
                made.add(folder)
                kind = "--tmpfs" if str(Path(folder).parent) in WRITABLE else "--dir"
                args += ["--perms", "0755", kind, folder]
        args += bind(source, dest)
    return args


def _chown_tree(path: Path, uid: int) -> None:
    """``path`` and everything below it made over to ``uid`` (symlinks changed themselves,
    never followed). The walk keeps its own stack and names each entry relative to ``path``, so
    a patch's tree of any depth is walked (``os.walk`` recurses once per level here and raises
    ``RecursionError`` past about a thousand; round 74)."""
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.chown(top, uid, uid)
        folders = [""]  # relative names with no "./" before them: a 4,095-byte path fits
        while folders:
            folder = folders.pop()
            fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        name = f"{folder}/{entry.name}" if folder else entry.name
                        os.chown(name, uid, uid, dir_fd=top, follow_symlinks=False)
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(name)
            finally:
                os.close(fd)
    finally:
        os.close(top)


def _give_to_user(root: Path, uid: int) -> None:
    """A sandbox's folders (its repository, /tmp and HOME) made over to its own user, and the
    /etc/passwd and /etc/group its commands see: the host's, with that user added."""
    _chown_tree(root / "repo", uid)
    for folder in ("tmp", "home"):
        os.lchown(root / folder, uid, uid)
    (root / "etc").mkdir()
    for name, line in (
        ("passwd", f"{AGENT_USER}:x:{uid}:{uid}::/root:/bin/sh\n"),
        ("group", f"{AGENT_USER}:x:{uid}:\n"),
    ):
        text = Path(f"/etc/{name}").read_text(errors="replace")
        (root / "etc" / name).write_text(text + ("" if text.endswith("\n") else "\n") + line)


def _cap_args(caps: tuple[str, ...]) -> list[str]:
    return [arg for cap in caps for arg in ("--cap-add", f"CAP_{cap}")]


class LocalSandbox:
    """One bubblewrap sandbox: a private folder plus the flags every command runs with."""

    def __init__(
        self,
        backend: LocalBackend,
        name: str,
        root: Path,
        *,
        limits: Limits,
        base_sha: str,
        env_dir: Path,
        python_prefix: str,
        relay: Relay | None,
        runtime: tuple[Path, list[Path]] | None,
        cgroup: cgroups.CgroupSet | None,
        pristine_git: Path,
        interpreter: str = "python3",
        grading: bool = False,
        view: View | None = None,
        judged_tree: Path | None = None,
    ) -> None:
        self.backend = backend
        self.grading = grading
        self._interpreter = interpreter  # the host's Python, bound read-only inside
        self._judged_ready = False  # the repository is chowned to the judged user
        self.judged_uid = judged_uid()  # this sandbox's own (`common.JUDGED_UID_BASE`)
        self.id = name
        self.root = root
        self.workdir = WORKDIR
        self.proxy_url = relay.inside_url if relay else None
        self.runtime_dir = RUNTIME_DIR if runtime else None
        self.limits = limits
        self.base_sha = base_sha
        self.limits_enforced = cgroup is not None
        self._pristine_git = pristine_git
        self._relay = relay
        self.cgroup = cgroup
        self._deadline = Deadline(limits.wall_s)
        self._closed = False
        path = BASE_PATH + (f":{RUNTIME_DIR}/bin" if runtime else "")
        self._env = {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
        self._env["VIRTUAL_ENV"] = ENV_DIR
        #: What a harness adds to a command's env: PATH with the env's venv (and the runtime).
        self.runtime_env = {"PATH": path}
        #: The OpenHands SDK's Python when the runtime is attached.
        self.openhands_python = f"{RUNTIME_DIR}/openhands/bin/python" if runtime else None
        self._head = [
            backend.config.bwrap,
            "--unshare-all",  # user (where possible), pid, ipc, uts, cgroup and net
            "--unshare-user-try",
            "--die-with-parent",
            "--new-session",
            "--cap-drop", "ALL",
        ]  # fmt: skip
        # A judged command: no user namespace (see _BECOME_JUDGED), the same others.
        no_userns = [
            backend.config.bwrap,
            "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--cap-drop", "ALL",
        ]  # fmt: skip
        self._judged_head = [*no_userns, *_cap_args(("SETUID", "SETGID", "SETPCAP"))]
        #: Run by root, an agent's command runs as the sandbox's own user too, as a judged one
        #: does: in bwrap's user namespace its root would be the host's root, the owner of every
        #: root-only file of the view (round 71: /etc/shadow, the Docker daemon's key) and the
        #: user whose per-user kernel counts (inotify instances) the host's own processes draw
        #: on. Run by another user, the user namespace maps root onto that user.
        self._as_user = not grading and os.geteuid() == 0
        if self._as_user:
            self._head = self._judged_head
            _give_to_user(root, self.judged_uid)
            self._judged_ready = True  # the repository is the judged user's already
        if grading:
            # Root's own grading steps, as on Docker: the host's root with GRADING_CAPS (in a
            # user namespace it could neither chown nor write the judged user's files).
            self._head = [*no_userns, *_cap_args(GRADING_CAPS)]
        # A grading sandbox's HOME is an empty per-command tmpfs, read-only once the host's
        # Python is bound below it; the sandbox's root (bwrap's tmpfs) is made read-only last.
        home = ["--tmpfs", "/root"] if grading else ["--bind", str(root / "home"), "/root"]
        flags = [
            "--hostname", "sandbox",
            *_host_view(backend.config.host_paths),
            "--proc", "/proc",
            "--dev", "/dev",
            "--bind", str(root / "tmp"), "/tmp",
            *home,
            "--bind", str(root / "repo"), WORKDIR,
        ]  # fmt: skip
        # After /root and /tmp: the host's Python (pyenv) may live below either.
        binds = [(str(env_dir), ENV_DIR), (python_prefix, python_prefix)]
        if runtime is not None:
            layout, host_paths = runtime
            binds += [(str(layout / "root"), RUNTIME_DIR)]
            binds += [(str(path), str(path)) for path in host_paths]
        if relay is not None:
            binds += [(str(root / "run"), RELAY_DIR)]
        if self._as_user:  # its name, for the tools that look it up (git, Node, getpass)
            binds += [(str(root / "etc" / name), f"/etc/{name}") for name in ("passwd", "group")]
        flags += _ro_binds(binds, backend.config.host_paths)
        self._flags = flags
        #: A grading sandbox's judged commands see the host's files only as copied to tmpfs
        #: (`memory_root.host_files`), each folder through an overlay of the sandbox's own:
        #: no page of them another sandbox can load or drop (round 44), no inode it can lock.
        self._judged_flags = flags
        if view is not None and judged_tree is not None:
            self._judged_flags = _tree_view(judged_tree, view, python_prefix, [
                "--proc", "/proc",
                "--dev", "/dev",
                *view.devices(),
                # A shared-memory folder the judged user may write, as Docker's (bubblewrap's
                # is root's 0755): multiprocessing's locks live there. Its own, size-capped.
                "--perms", "1777", "--size", str(JUDGED_SHM_BYTES), "--tmpfs", "/dev/shm",
                "--bind", str(root / "tmp"), "/tmp",
                *home,
                "--bind", str(root / "repo"), WORKDIR,
            ])  # fmt: skip
        self._last = ["--remount-ro", "/root", "--remount-ro", "/"] if grading else []
        self._port = inside_port(relay.port) if relay else None

    # -- exec

    def _argv(
        self,
        cmd: str | list[str],
        cwd: str | None,
        extra: tuple[str, ...] = (),
        judged: bool = False,
        filter_fd: int | None = None,
    ) -> list[str]:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if self._port is not None:
            py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
            start = f'{py} {RELAY_DIR}/forwarder.py {self._port} {RELAY_DIR}/proxy.sock --daemon && exec "$@"'
            argv = ["/bin/sh", "-c", start, "sh", *argv]
        head = self._head
        if judged or self._as_user:
            head = self._judged_head
            become = [
                self._interpreter, "-I", "-S", "-c", _BECOME_JUDGED, str(self.judged_uid),
                _command_filter(),
            ]  # fmt: skip
            argv = [*become, *argv]
        flags = self._judged_flags if judged else self._flags
        if filter_fd is not None:  # a command that becomes a user installs it itself
            extra = (*extra, "--seccomp", str(filter_fd))
        full = [*head, *flags, *extra, *self._last, "--chdir", cwd or WORKDIR, "--", *argv]
        prelude = []
        if self.grading:  # soft and hard: nothing inside can raise it again
            prelude.append(f"ulimit -n {GRADING_OPEN_FILES} || exit 125")
        if self.cgroup is not None:
            files = " ".join(f"'{p}'" for p in self.cgroup.procs_files())
            prelude.append(f'for f in {files}; do echo $$ > "$f" || exit 125; done')
        if prelude:
            full = ["/bin/sh", "-c", "; ".join([*prelude, 'exec "$@"']), "sh", *full]
        return full

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
        result, _ = await self._run(
            cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, on_output=on_output, judged=judged
        )
        return result

    def _judged_folder(self) -> str:
        """On the host, as root: the repository chowned to the judged user before the first
        judged command (symlinks changed themselves, never followed), and a fresh private
        folder for this command (empty, mode 0700, its owner). /tmp becomes 1777 (sticky):
        the judged user may make files there, never remove root's."""
        if os.geteuid() != 0:
            raise SandboxError(
                f"sandbox {self.id}: a judged command needs a user of its own, and the local "
                "backend can switch users only when it runs as root (or use --backend docker)"
            )
        if not self._judged_ready:
            _chown_tree(self.root / "repo", self.judged_uid)
            os.chmod(self.root / "tmp", 0o1777)
            self._judged_ready = True
        name = f"{JUDGED_DIR_PREFIX}{secrets.token_hex(8)}"
        folder = self.root / "tmp" / name
        for path in (folder, *(folder / sub for sub in JUDGED_SUBDIRS)):
            path.mkdir(mode=0o700)
            os.lchown(path, self.judged_uid, self.judged_uid)
        return f"/tmp/{name}"

    async def _run(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        on_output: Callable[[bytes], None] | None = None,
        output_limit: int | None = None,
        extra_flags: tuple[str, ...] = (),
        judged: bool = False,
    ) -> tuple[ExecResult, bytes]:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        private = judged_env(await in_thread(self._judged_folder)) if judged else {}
        left = self._deadline.left()
        if left <= 0:
            return ExecResult(exit_code=None, timed_out=True, killed_by="wall"), b""
        wall_bound = left < timeout
        budget = min(timeout, left)
        cap = OutputCap(self.limits.output_bytes if output_limit is None else output_limit)
        before = self.cgroup.counters() if self.cgroup else None
        started = time.monotonic()
        # Every command that runs the agent's or the patch's code is filtered; root's own
        # grading steps run neither.
        filter_fd = None if judged or self._as_user or self.grading else _filter_fd()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(cmd, cwd, extra_flags, judged, filter_fd),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**self._env, **(env or {}), **private},
                start_new_session=True,
                pass_fds=() if filter_fd is None else (filter_fd,),
            )
        except FileNotFoundError:
            raise SandboxError(
                f"bubblewrap ({self.backend.config.bwrap}) is not installed (apt-get install bubblewrap)"
            ) from None
        finally:
            if filter_fd is not None:
                os.close(filter_fd)

        async def pump() -> None:
            assert proc.stdout is not None
            if stdin is not None and proc.stdin is not None:
                proc.stdin.write(stdin)
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
                proc.stdin.close()
            while chunk := await proc.stdout.read(65536):
                cap.add(chunk)
                if on_output is not None:
                    on_output(chunk)
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(pump(), budget)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        duration = time.monotonic() - started
        code = None if timed_out else proc.returncode
        if code is not None and code < 0:
            code = 128 - code  # killed by a signal, reported like a shell does
        after = self.cgroup.counters() if self.cgroup and code != 0 else before
        killed_by = classify(
            code, timed_out=timed_out, wall_hit=timed_out and wall_bound, before=before, after=after
        )
        if killed_by == "memory" and code == 137:
            code = None
        result = ExecResult(
            exit_code=code,
            data=cap.data(),
            timed_out=timed_out,
            truncated=cap.truncated,
            killed_by=killed_by,
            duration_s=duration,
        )
        return result, result.data

    # -- files (through the sandbox, so a symlink planted by the agent leads nowhere outside)

    async def write_file(self, path: str, data: bytes) -> None:
        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        result, _ = await self._run(["/bin/sh", "-c", script, "sh", full], timeout=60, stdin=data)
        if result.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: cannot write {full}: {result.output.strip()}")

    async def read_file(self, path: str, *, limit: int | None = READ_LIMIT) -> bytes:
        """Through the sandbox: a file whose size is over ``limit`` is not read at all, and
        ``head -c`` reads at most ``limit + 1`` bytes of one that grows meanwhile (one more
        than allowed tells a file over the limit from one exactly at it)."""
        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        found = 'test -f "$1" || { echo "no such file" >&2; exit 44; }; '
        if limit is None:
            script, cap = found + 'cat "$1"', 1 << 40
        else:
            size = (
                's=$(stat -L -c %s "$1") || exit 1; [ "$s" -le "$2" ] || { echo "$s"; exit 45; }; '
            )
            script, cap = found + size + 'head -c "$(($2 + 1))" "$1"', limit + 1
        result, raw = await self._run(
            ["/bin/sh", "-c", script, "sh", full, str(limit)], timeout=120, output_limit=cap
        )
        if result.exit_code == 44:
            raise FileNotFoundError(f"{full}: no such file in sandbox {self.id}")
        if result.exit_code == 45 and limit is not None:
            stated = result.output.strip()
            raise FileTooLarge(full, limit, int(stated) if stated.isdigit() else None)
        if result.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: cannot read {full}: {result.output.strip()}")
        if limit is not None and len(raw) > limit:
            raise FileTooLarge(full, limit)
        return raw

    async def diff(self) -> str:
        """The agent's changes against the base commit: ``tree_probe`` in a fresh bubblewrap
        (no agent process survives between commands) against the instance layer's pristine
        .git, bound read-only where the agent never sees it, with a clean configuration and
        a throw-away index and object store; the patch is read from a file, not a stream."""
        work = self.root / f"diff-{secrets.token_hex(4)}"
        work.mkdir()
        if self._as_user:
            os.lchown(work, self.judged_uid, self.judged_uid)
        inside = "/run/legorl-diff"
        pristine = "/run/legorl-pristine.git"
        req = {
            "mode": "diff",
            "root": WORKDIR,
            "git_dir": pristine,
            "base": self.base_sha,
            "index": f"{inside}/index",
            "objects": f"{inside}/objects",
            "alternates": f"{pristine}/objects",
            "out": f"{inside}/out",
            "skip_junk": True,
            "respect_ignores": True,
            "listing": False,
        }
        try:
            shutil.copy(tree_probe.__file__, work / "probe.py")
            (work / "req.json").write_text(json.dumps(req))
            result, _ = await self._run(
                ["python3", "-I", "-S", f"{inside}/probe.py", f"{inside}/req.json"],
                timeout=300,
                cwd="/",
                extra_flags=(
                    *("--perms", "0755", "--dir", "/run"),  # bwrap's own would be 0700
                    "--ro-bind",
                    str(self._pristine_git),
                    pristine,
                    "--bind",
                    str(work),
                    inside,
                ),
            )
            try:
                if (work / "out").stat().st_size > 1 << 20:  # the patch goes to its own file
                    raise ValueError("the probe's result is past 1 MiB")
                out = json.loads((work / "out").read_text())
            except (OSError, ValueError):
                tail = result.output.strip().splitlines()[-1:] or ["(no output)"]
                raise SandboxError(f"sandbox {self.id}: git diff failed: {tail[0]}") from None
            if "error" in out:
                raise SandboxError(f"sandbox {self.id}: git diff failed: {out['error']}")
            if out.get("too_large"):
                raise SandboxError(
                    f"sandbox {self.id}: git diff failed: {tree_probe.too_large(out)}"
                )
            return (work / "out.patch").read_bytes().decode("utf-8", "replace")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def alive(self) -> bool | None:
        """True when a command runs. Each command is a fresh bubblewrap over this sandbox's
        folders, which only its own commands change; so when none runs while its folders are
        there and a bubblewrap with nothing of this sandbox's runs, what its commands left
        broke it (a mount point in its HOME replaced, say): False. None when the backend
        itself cannot run a command, or the folders are gone (not the agent's doing)."""
        with contextlib.suppress(SandboxError):
            if (await self.exec(["true"], timeout=60, cwd="/")).exit_code == 0:
                return True
        if not (self.root / "repo").is_dir():
            return None
        probe = [
            self.backend.config.bwrap, "--unshare-all", "--unshare-user-try",
            "--die-with-parent", *_host_view(self.backend.config.host_paths),
            "--proc", "/proc", "--dev", "/dev", "true",
        ]  # fmt: skip
        try:
            done = await asyncio.to_thread(
                subprocess.run, probe, capture_output=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return False if done.returncode == 0 else None

    async def close(self) -> None:
        # Off the event loop: a sandbox's tree may hold any number of files (removing 500,000
        # held a loop 6.7 s), and other sandboxes' work goes on meanwhile.
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._relay is not None:
            self._relay.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        remove_folder(self.root)


class LocalBackend:
    """``SandboxBackend`` on bubblewrap; ``config_class`` is ``LocalConfig``."""

    name = "local"
    config_class: ClassVar[type] = LocalConfig

    def __init__(self, config: LocalConfig | None = None) -> None:
        self.config = config or LocalConfig()
        self.cache = LocalCache(self.config)
        self._reaped = False
        self._runtime: tuple[Path, list[Path]] | None = None

    def check(self) -> None:
        if shutil.which(self.config.bwrap) is None:
            raise SandboxError(
                f"bubblewrap ({self.config.bwrap}) is not installed (apt-get install bubblewrap)"
            )

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
    ) -> LocalSandbox:
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
    ) -> LocalSandbox:
        self.check()
        limits = limits or Limits()
        if grading and proxy_url:
            raise SandboxError(f"{task.instance_id}: a grading sandbox reaches no proxy")
        if not self._reaped:
            self._reaped = True
            gc_local()
        layers = self.cache.plan(task)
        self.cache.ensure(task, Path(tasks_dir))
        base, env, instance = layers
        runtime = None
        if harness_runtime:
            if self._runtime is None:
                path, binds, _ = self.cache.runtime()
                self._runtime = (path, binds)
            runtime = self._runtime
        name = f"legorl-{secrets.token_hex(6)}"
        root = state_root() / name
        root.mkdir()
        relay = None
        cg = None
        try:
            view = tree = None
            if grading:
                memory_root.need_root(task.instance_id)
                # What a judged command reads of the host, copied to tmpfs (`memory_root.py`).
                found = memory_root.host_files(
                    base.recipe["prefix"], str(_layer_dir(env) / "venv"), ENV_DIR, BASE_PATH
                )
                tree = memory_root.host_tree(found)
                _mount_grading_tmpfs(root)
            # Before any mount below it: a process killed from here on leaves a folder gc
            # knows the owner of (and so removes once that owner is dead).
            write_owner(root, run_id, task.instance_id)
            if grading:
                view = mount_view(root / "view")
            for sub in ("tmp", "home"):
                (root / sub).mkdir()
            if grading:
                (root / "repo").mkdir()
                _mount_grading_tmpfs(root, repo=True)
            shutil.copytree(
                _layer_dir(instance) / "repo", root / "repo", symlinks=True, dirs_exist_ok=True
            )
            meta = self.cache.layer_meta(instance)
            if proxy_url:
                split_proxy_url(proxy_url)
                (root / "run").mkdir()
                shutil.copy(FORWARDER, root / "run" / "forwarder.py")
                relay = open_relay(root / "run" / "proxy.sock", proxy_url)
            cg = cgroups.create(name, limits)
            touch_usage(f"local/instance:{instance.key}")
            return LocalSandbox(
                self,
                name,
                root,
                limits=limits,
                base_sha=meta["base_sha"],
                env_dir=_layer_dir(env) / "venv",
                python_prefix=base.recipe["prefix"],
                relay=relay,
                runtime=runtime,
                cgroup=cg,
                pristine_git=_layer_dir(instance) / "repo" / ".git",
                interpreter=base.recipe["interpreter"],
                grading=grading,
                view=view,
                judged_tree=tree,
            )
        except BaseException:
            if relay is not None:
                relay.close()
            if cg is not None:
                cg.remove()
            remove_folder(root)
            raise


def _mount_grading_tmpfs(root: Path, *, repo: bool = False) -> None:
    """A grading sandbox's private folder (/tmp and HOME) on a size-capped tmpfs, and with
    ``repo`` its repository on one of its own, with Docker's caps for each: what a judged
    command writes is held in memory its cgroup is charged for, never on the disk the judge
    shares, and a tree fits here exactly where it fits in a Docker grading sandbox (round 75:
    one tmpfs for both took a tree of 283,000 files that Docker's /testbed did not)."""
    if repo:
        where = root / "repo"
        opts = f"size={GRADING_REPO_MB}m,nr_inodes={GRADING_REPO_INODES},mode=0755"
    else:
        where = root  # its own few files too (the owner's, the view's and relay's folders)
        opts = f"size={GRADING_TMP_MB + 16}m,nr_inodes={GRADING_TMP_INODES + 1024},mode=0755"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"{opts},nosuid,nodev", "legorl-grading", str(where)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"cannot mount a tmpfs on {where}: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["mount failed"])[-1]
        raise SandboxError(f"cannot mount a tmpfs on {where} (grading needs root): {why}")


def gc_local(*, everything: bool = False, dry_run: bool = False) -> list[str]:
    """Remove local sandboxes (private folders, cgroups) whose owner process is dead."""
    removed: list[str] = []
    alive: set[str] = set()
    root = state_root()
    for folder in sorted(root.iterdir()):
        owner_file = folder / "owner.json"
        try:
            owner = json.loads(owner_file.read_text()).get("owner", "")
        except (OSError, ValueError):
            owner = ""
            if not folder.name.startswith("legorl-"):
                continue
            # A Docker sandbox's relay folder, or a half-made local one: judged by its age.
            try:
                age = time.time() - folder.stat().st_mtime
            except FileNotFoundError:
                continue  # closed since the listing (a sandbox of another process)
            if age < 3600 and not everything:
                alive.add(folder.name)
                continue
        if not everything and owner and owner_alive(owner) is not False:
            alive.add(folder.name)
            continue
        removed.append(folder.name)
        if not dry_run:
            remove_folder(folder)
    # The cgroups are the host's, shared by every state root (another user's, a Ray node's):
    # only those of the sandboxes judged dead here go, and an orphan whose folder is gone
    # from every root once it is a day old.
    for path in cgroups.stale(alive):
        if path.name not in removed:
            try:
                if (root / path.name).exists() or time.time() - path.stat().st_mtime < 86_400:
                    continue
            except FileNotFoundError:
                continue
        if not dry_run:
            cgroups.CgroupSet.of_folder(path).remove()
    memory_root.gc(None, dry_run=dry_run)  # the host's files copied for judged commands
    return removed
