"""A local grading sandbox's own view of the host's folders: no inode shared with another.

A bind mount keeps the inode it binds, and the kernel keeps state per inode that any process
able to open the file reaches, whatever its namespaces and uid: POSIX and ``flock`` locks
(a read lock needs only a file opened for reading), leases, inotify watches. When every
sandbox bound the host's ``/usr`` read-only, one judged run held read locks on
``/usr/lib/os-release`` whose offsets spelled the right answers, and another trajectory's
judged run read them back with ``F_GETLK`` (round 43). Docker's containers never shared that:
each has an overlay root of its own, and a file opened through an overlay is the overlay's
inode.

So a grading sandbox of the local backend sees each host folder through a read-only overlay
of its own, which the backend (root) mounts on the sandbox's private tmpfs before its first
command: one superblock per folder per sandbox. A mount below a folder (a file Docker binds
into ``/etc``, a folder mounted into ``/usr``) gets the same, an overlay or a private copy.
The device nodes a sandbox's ``/dev`` holds are its own too, made on a tmpfs of its own.
Every mount lives below the sandbox's folder and goes when it is detached
(``common.remove_folder``).

    view = mount_view(root / "view")
    flags = view.ro_bind("/usr", "/usr") + view.devices()
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from legorl.protocols import SandboxError
from legorl.sandbox.common import mount_points

#: The device nodes bubblewrap's ``--dev`` binds from the host, each replaced by a node of
#: the sandbox's own.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

#: A file mounted below a host folder is copied into the view when no larger than this.
COPY_LIMIT = 16 << 20

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    done = _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, data.encode())
    if done != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"cannot mount {fstype} on {target} ({source}): {os.strerror(err)}")


@dataclass
class View:
    """The private sources of one sandbox's host folders, by host path, mounted as they are
    first bound."""

    root: Path
    points: list[str]  # the host's mount points when the view was made
    _folders: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    _count: int = 0

    def _next(self) -> Path:
        self._count += 1
        return self.root / str(self._count)

    def _add(self, path: str) -> None:
        """Mount (or copy) ``path`` and every mount below it into the view."""
        below = sorted(p for p in self.points if p.startswith(path.rstrip("/") + "/"))
        pairs = []
        for point in [path, *below]:
            rel = os.path.relpath(point, path)
            if os.path.isdir(point):
                pairs.append((str(self._overlay(point)), rel))
            elif os.path.isfile(point):
                pairs.append((str(self._copy(point)), rel))
            # anything else mounted there (a socket, a device) is left out of the view
        self._folders[path] = pairs

    def _overlay(self, folder: str) -> Path:
        if any(c in folder for c in ":,\\\n"):
            raise SandboxError(
                f"cannot give a grading sandbox a view of {folder}: an overlay's lower folder "
                "cannot name ':', ',' or '\\' (leave it out of LocalConfig.host_paths)"
            )
        target = self._next()
        target.mkdir()
        # Two lower folders and no upper one: a read-only overlay (one lower needs an upper).
        data = f"lowerdir={folder}:{self.root / 'empty'}"
        _mount("legorl-view", target, "overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, data)
        return target

    def _copy(self, file: str) -> Path:
        size = os.stat(file).st_size
        if size > COPY_LIMIT:
            raise SandboxError(
                f"cannot give a grading sandbox a view of {file}: a file mounted below a host "
                f"folder is copied, and this one is {size} bytes (at most {COPY_LIMIT})"
            )
        target = self._next()
        shutil.copy(file, target)  # with its mode bits
        return target

    def ro_bind(self, path: str, dest: str) -> list[str]:
        """bubblewrap arguments binding ``path``'s private view at ``dest``, read-only."""
        if path not in self._folders:
            self._add(path)
        out = []
        for source, rel in self._folders[path]:
            out += ["--ro-bind", source, os.path.normpath(os.path.join(dest, rel))]
        return out

    def devices(self) -> list[str]:
        """bubblewrap arguments, after ``--dev``: each of ``DEVICES`` replaced by this
        sandbox's own node."""
        out = []
        for name in DEVICES:
            out += ["--dev-bind", str(self.root / "dev" / name), f"/dev/{name}"]
        return out


def mount_view(root: Path) -> View:
    """Make ``root`` (a new folder on the sandbox's private tmpfs) a view: its devices now,
    each host folder as ``View.ro_bind`` first names it."""
    root.mkdir(mode=0o755)
    (root / "empty").mkdir()
    view = View(root, mount_points())
    dev = root / "dev"
    dev.mkdir()
    # A tmpfs of its own: the sandbox's tmpfs is nodev, and a device node there would not open.
    _mount("legorl-dev", dev, "tmpfs", _MS_NOSUID, "size=16k,nr_inodes=16,mode=0755")
    for name in DEVICES:
        host = os.stat(f"/dev/{name}")
        if not stat.S_ISCHR(host.st_mode):
            raise SandboxError(
                f"cannot give a grading sandbox /dev/{name}: the host's is no device"
            )
        try:
            os.mknod(dev / name, stat.S_IFCHR | 0o666, host.st_rdev)
        except OSError as exc:
            raise SandboxError(f"cannot make /dev/{name} for a grading sandbox: {exc}") from None
        os.chmod(dev / name, 0o666)  # past the umask
    return view
