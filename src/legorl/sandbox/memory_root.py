"""Memory-backed roots for Docker's grading containers: what a judged run reads is on tmpfs.

A file read through a container's root (an overlay of the image's layers) is read through the
lower file's page cache, which every container of the image shares and which outlives them
all. One sandbox can set which pages are cached (a read sets one, ``posix_fadvise`` drops one)
and another can time its reads: a channel between trajectories that no permission refuses
(round 44). A tmpfs file's pages are memory, neither dropped by ``posix_fadvise`` nor evicted
(with no swap), so reading it costs the same whatever any other sandbox did, and a tmpfs keeps
no negative dentries. A grading container therefore reads its image's files from a copy on
tmpfs, through a read-only overlay of its own (so that, as with its overlay root, no inode it
can lock is another container's), bound read-only (no read updates an access time) over each
of the image's top-level entries:

    tree = image_tree(api, image_id)      # unpacked once per host, then reused
    root = private_view(tree, folder)     # this container's, detached when it goes
    mounts = [Mount(f"/{name}", str(root / name), type="bind", read_only=True)
              for name in top_entries(tree)]

Each image is unpacked once into ``trees/<image id>``; its files are hard links into one store
keyed by content, mode, owner and mtime, so images built on one base share that base's memory.
What stays on the image's overlay is the root folder itself: a name looked up directly below
``/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from legorl.sandbox.common import SandboxError, build_lock
from legorl.sandbox.view import _MS_NODEV, _MS_NOSUID, _MS_RDONLY, _mount

#: The image's entries that a grading container gets elsewhere (its own tmpfs, proc, sysfs,
#: devices) and so are not copied.
SKIPPED = frozenset({"testbed", "tmp", "proc", "sys", "dev"})

#: statfs's f_type of tmpfs.
_TMPFS = "tmpfs"


def roots_dir() -> Path:
    """``$LEGORL_MEMORY_ROOTS``, else ``/dev/shm/legorl-roots-<uid>``: it must be a tmpfs that
    allows executables (the judged run's interpreter is read from it)."""
    base = os.environ.get("LEGORL_MEMORY_ROOTS") or f"/dev/shm/legorl-roots-{os.getuid()}"
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fstype, options = mount_of(path)
    if fstype != _TMPFS or "noexec" in options:
        raise SandboxError(
            f"LEGORL_MEMORY_ROOTS: {path} is on {fstype}"
            + (" mounted noexec" if "noexec" in options else "")
            + "; grading needs a tmpfs that allows executables there"
        )
    return path


def mount_of(path: str | Path) -> tuple[str, set[str]]:
    """The file system type and mount options of the mount holding ``path``."""
    target = os.path.realpath(path)
    best, found = "", ("?", set[str]())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best = point
            found = (fields[sep + 1], set(fields[5].split(",")))
    return found


def _key(image_id: str) -> str:
    key = image_id.split(":")[-1]
    if not key.isalnum():
        raise SandboxError(f"not an image id: {image_id!r}")
    return key[:32]


def image_tree(api: Any, image_id: str) -> Path:
    """The image's root unpacked on tmpfs (made on first use; concurrent callers wait)."""
    root = roots_dir()
    final = root / "trees" / _key(image_id)
    if final.is_dir():
        return final
    with build_lock(f"memory-root-{_key(image_id)}"):
        if final.is_dir():
            return final
        partial = root / "trees" / f".{_key(image_id)}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        cid = api.create_container(image_id, command=["true"], labels={"legorl.build": "1"})["Id"]
        try:
            _unpack(api.export(cid), partial, root / "store")
        except (OSError, tarfile.TarError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise SandboxError(
                f"{image_id}: cannot copy the image's root to {root}: {exc}"
            ) from None
        finally:
            with contextlib.suppress(Exception):
                api.remove_container(cid, force=True)
        os.rename(partial, final)
    return final


def private_view(tree: Path, folder: Path) -> Path:
    """A read-only overlay of ``tree`` at ``folder/root`` for one container (``folder``: a new
    folder of its own, with ``owner.json``). Its files are inodes of its own: a lock, lease or
    watch on one reaches no other container (round 43), while reads go to the tree's tmpfs
    pages. Detach it with ``common.remove_folder(folder)``."""
    empty = tree.parent.parent / "empty"  # on the tmpfs too: a missed name leaves nothing
    empty.mkdir(mode=0o755, exist_ok=True)
    target = folder / "root"
    target.mkdir()
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    _mount("legorl-root", target, "overlay", flags, f"lowerdir={tree}:{empty}")
    return target


def top_entries(tree: Path) -> list[str]:
    """The tree's top-level folders and files a grading container binds over the image's."""
    return sorted(p.name for p in tree.iterdir() if not p.is_symlink() and p.name not in SKIPPED)


class _Chunks(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the export stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _inside(tree: Path, name: str) -> Path | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] in SKIPPED:
        return None
    return tree.joinpath(*parts)


def _unpack(chunks: Iterable[bytes], tree: Path, store: Path) -> None:
    """Unpack an exported root into ``tree``, each regular file a hard link into ``store``."""
    store.mkdir(mode=0o700, exist_ok=True)
    folders: list[tuple[Path, tarfile.TarInfo]] = []
    with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks), 1 << 20), mode="r|") as tar:
        for member in tar:
            path = _inside(tree, member.name)
            if path is None:
                continue
            if member.isdir():
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                folders.append((path, member))
            elif member.isreg():
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                os.link(_stored(source, member, store), path)
            elif member.issym():
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.symlink(member.linkname, path)
                os.lchown(path, member.uid, member.gid)
            elif member.islnk():
                target = _inside(tree, member.linkname)
                if target is not None and target.exists():
                    os.link(target, path)
            # Devices and pipes outside /dev are left out: a judged run has no use for them.
    # Folders last, deepest first: a read-only folder's mode would refuse its own entries.
    for path, member in sorted(folders, key=lambda f: -len(f[0].parts)):
        os.chown(path, member.uid, member.gid)
        os.chmod(path, member.mode & 0o7777)
        os.utime(path, (member.mtime, member.mtime))


def _stored(source: Any, member: tarfile.TarInfo, store: Path) -> Path:
    """The store's file for this content, mode, owner and mtime (written if new)."""
    digest = hashlib.blake2b(digest_size=20)
    spool = store / f".in.{os.getpid()}.{threading.get_ident()}"
    with open(spool, "wb") as out:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
    name = f"{digest.hexdigest()}-{member.mode & 0o7777:o}-{member.uid}-{member.gid}-{member.mtime}"
    path = store / name
    if path.exists():
        spool.unlink()
        return path
    os.chown(spool, member.uid, member.gid)
    os.chmod(spool, member.mode & 0o7777)
    os.utime(spool, (member.mtime, member.mtime))
    os.rename(spool, path)
    return path


def gc(keep: set[str], *, dry_run: bool = False) -> list[str]:
    """Remove the trees of images not in ``keep`` (image ids) and the store's files no tree
    links to any more; the removed trees' keys."""
    base = os.environ.get("LEGORL_MEMORY_ROOTS") or f"/dev/shm/legorl-roots-{os.getuid()}"
    root = Path(base)
    trees = root / "trees"
    if not trees.is_dir():
        return []
    wanted = {_key(i) for i in keep}
    removed = []
    for tree in trees.iterdir():
        stale = tree.name.startswith(".") and time.time() - tree.stat().st_mtime > 3600
        if (tree.name not in wanted and not tree.name.startswith(".")) or stale:
            removed.append(tree.name)
            if not dry_run:
                _remove_tree(tree)
    if not dry_run:
        for path in _store_files(root / "store"):
            with contextlib.suppress(OSError):
                if path.stat().st_nlink == 1:
                    path.unlink()
    return removed


def _remove_tree(tree: Path) -> None:
    for folder, _, _ in os.walk(tree):
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
    shutil.rmtree(tree, ignore_errors=True)


def _store_files(store: Path) -> Iterator[Path]:
    if store.is_dir():
        yield from store.iterdir()
