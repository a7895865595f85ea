"""A local grading sandbox's own view of its judged root: no inode shared with another.

A bind mount keeps the inode it binds, and the kernel keeps state per inode that any process
able to open the file reaches, whatever its namespaces and uid: POSIX and ``flock`` locks
(a read lock needs only a file opened for reading), leases, inotify watches. When every
sandbox bound the host's ``/usr`` read-only, one judged run held read locks on
``/usr/lib/os-release`` whose offsets spelled the right answers, and another trajectory's
judged run read them back with ``F_GETLK`` (round 43).

So a judged command of a local grading sandbox sees each folder of its root (the host's files
copied to tmpfs, `memory_root.host_tree`) through a read-only overlay of its own, which the
backend (root) mounts on the sandbox's private tmpfs: one superblock per folder per sandbox.
The device nodes its ``/dev`` holds are its own too, made on a tmpfs of its own. Every mount
lives below the sandbox's folder and goes when it is removed (``common.remove_folder``).

    view = mount_view(root / "view")
    flags = view.ro_bind(f"{tree}/usr", "/usr") + view.devices()
"""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from legorl.protocols import SandboxError

#: The device nodes bubblewrap's ``--dev`` binds from the host, each replaced by a node of
#: the sandbox's own.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    done = _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, data.encode())
    if done != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"cannot mount {fstype} on {target} ({source}): {os.strerror(err)}")


@dataclass
class View:
    """The overlays of one sandbox's folders, by folder, mounted as they are first bound."""

    root: Path
    _overlays: dict[str, Path] = field(default_factory=dict)

    def _overlay(self, folder: str) -> Path:
        if any(c in folder for c in ":,\\\n"):
            raise SandboxError(
                f"cannot give a grading sandbox a view of {folder}: an overlay's lower folder "
                "cannot name ':', ',' or '\\' (move LEGORL_MEMORY_ROOTS)"
            )
        target = self.root / str(len(self._overlays) + 1)
        target.mkdir()
        # Two lower folders and no upper one: a read-only overlay (one lower needs an upper).
        data = f"lowerdir={folder}:{self.root / 'empty'}"
        _mount("legorl-view", target, "overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, data)
        return target

    def ro_bind(self, folder: str, dest: str) -> list[str]:
        """bubblewrap arguments binding this sandbox's overlay of ``folder`` at ``dest``."""
        if folder not in self._overlays:
            self._overlays[folder] = self._overlay(folder)
        return ["--ro-bind", str(self._overlays[folder]), dest]

    def devices(self) -> list[str]:
        """bubblewrap arguments, after ``--dev``: each of ``DEVICES`` replaced by this
        sandbox's own node."""
        out = []
        for name in DEVICES:
            out += ["--dev-bind", str(self.root / "dev" / name), f"/dev/{name}"]
        return out


def mount_view(root: Path) -> View:
    """Make ``root`` (a new folder on the sandbox's private tmpfs) a view: its devices now,
    each folder as ``View.ro_bind`` first names it."""
    root.mkdir(mode=0o755)
    (root / "empty").mkdir()
    view = View(root)
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
