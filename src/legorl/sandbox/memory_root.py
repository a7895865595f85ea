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
import functools
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
import zoneinfo
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from legorl.sandbox.common import ChunkReader, SandboxError, build_lock, mounts
from legorl.sandbox.view import _MS_NODEV, _MS_NOSUID, _MS_RDONLY, _mount

#: The image's entries that a grading container gets elsewhere (its own tmpfs, proc, sysfs,
#: devices) and so are not copied.
SKIPPED = frozenset({"testbed", "tmp", "proc", "sys", "dev"})

#: statfs's f_type of tmpfs.
_TMPFS = "tmpfs"


def _roots_path() -> Path:
    return Path(os.environ.get("LEGORL_MEMORY_ROOTS") or f"/dev/shm/legorl-roots-{os.getuid()}")


def roots_dir() -> Path:
    """``$LEGORL_MEMORY_ROOTS``, else ``/dev/shm/legorl-roots-<uid>``: it must be a tmpfs that
    allows executables (the judged run's interpreter is read from it)."""
    path = _roots_path()
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
    for point, kind, options in mounts():
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, (kind, options)
    return found


def _key(image_id: str) -> str:
    key = image_id.split(":")[-1]
    if not key.isalnum():
        raise SandboxError(f"not an image id: {image_id!r}")
    return key[:32]


def need_root(what: str) -> None:
    """Grading copies files with their owners and mounts overlays: both need root."""
    if os.geteuid() != 0:
        raise SandboxError(
            f"{what}: a grading sandbox needs root on this host (its judged run reads a copy "
            "of the files on tmpfs, kept with their owners, through an overlay of its own); "
            "run verify as root"
        )


def image_tree(api: Any, image_id: str) -> Path:
    """The image's root unpacked on tmpfs (made on first use; concurrent callers wait)."""
    need_root(image_id)

    import docker.errors

    def fill(partial: Path, store: Path) -> None:
        try:
            cid = api.create_container(image_id, command=["true"], labels={"legorl.build": "1"})
        except docker.errors.APIError as exc:
            raise OSError(f"cannot create a container: {exc}") from None
        try:
            _unpack(api.export(cid["Id"]), partial, store)
        except docker.errors.APIError as exc:
            raise OSError(f"cannot export its root: {exc}") from None
        finally:
            with contextlib.suppress(Exception):
                api.remove_container(cid["Id"], force=True)

    return _tree(_key(image_id), fill, f"{image_id}: cannot copy the image's root")


def _tree(name: str, fill: Callable[[Path, Path], None], failure: str) -> Path:
    """``trees/<name>``, filled (``fill(folder, store)``) in a folder of its own and renamed
    into place whole; made once, whoever asks at the same time waits for it."""
    root = roots_dir()
    final = root / "trees" / name
    if final.is_dir():
        os.utime(final)  # its last use, for gc
        return final
    with build_lock(f"memory-root-{name}"):
        if final.is_dir():
            return final
        partial = root / "trees" / f".{name}.{os.getpid()}"
        _remove_tree(partial)
        partial.mkdir(parents=True)
        try:
            fill(partial, root / "store")
        except (OSError, tarfile.TarError) as exc:
            _remove_tree(partial)
            raise SandboxError(f"{failure} to {root}: {exc}") from None
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


def _inside(tree: Path, name: str) -> Path | None:
    """Where an exported entry goes in ``tree``; None for one that is not copied, or whose
    way there passes a link (an image's own link would lead the judge, root, out of the tree)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] in SKIPPED:
        return None
    folder = tree
    for part in parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            return None
    return tree.joinpath(*parts)


def _unpack(chunks: Iterable[bytes], tree: Path, store: Path) -> None:
    """Unpack an exported root into ``tree``, each regular file a hard link into ``store``."""
    store.mkdir(mode=0o700, exist_ok=True)
    folders: list[tuple[Path, tarfile.TarInfo]] = []
    with tarfile.open(
        fileobj=io.BufferedReader(ChunkReader(chunks, None), 1 << 20), mode="r|"
    ) as tar:
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
                owner = (member.mode, member.uid, member.gid, int(member.mtime))
                os.link(_stored(source, owner, store), path)
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


def _stored(source: Any, owner: tuple[int, int, int, int], store: Path) -> Path:
    """The store's file for this content and ``owner`` (mode, uid, gid, mtime), written if
    new."""
    mode, uid, gid, mtime = owner
    digest = hashlib.blake2b(digest_size=20)
    spool = store / f".in.{os.getpid()}.{threading.get_ident()}"
    with open(spool, "wb") as out:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
    path = store / f"{digest.hexdigest()}-{mode & 0o7777:o}-{uid}-{gid}-{mtime}"
    if path.exists():
        spool.unlink()
        return path
    os.chown(spool, uid, gid)
    os.chmod(spool, mode & 0o7777)
    os.utime(spool, (mtime, mtime))
    os.rename(spool, path)
    return path


#: A host tree unused this long goes at the next gc (its files changed, or it is no use).
HOST_TREE_IDLE_S = 86400.0


def gc(images: set[str] | None, *, dry_run: bool = False) -> list[str]:
    """Remove the trees of images not in ``images`` (ids; None: leave images' trees alone),
    host trees unused for ``HOST_TREE_IDLE_S``, half-made trees of an hour ago, and the
    store's files no tree links to any more; the removed trees' names."""
    root = _roots_path()
    trees = root / "trees"
    if not trees.is_dir():
        return []
    wanted = None if images is None else {_key(i) for i in images}
    removed = []
    now = time.time()
    for tree in trees.iterdir():
        age = now - tree.stat().st_mtime
        if tree.name.startswith("."):
            doomed = age > 3600
        elif tree.name.startswith("host-"):
            doomed = age > HOST_TREE_IDLE_S
        else:
            doomed = wanted is not None and tree.name not in wanted
        if doomed:
            removed.append(tree.name)
            if not dry_run:
                _remove_tree(tree)
    for listing in (root / "ldd").glob("*.json") if not dry_run else ():
        with contextlib.suppress(OSError):
            if now - listing.stat().st_mtime > HOST_TREE_IDLE_S:
                listing.unlink()
    if not dry_run:
        for path in _store_files(root / "store"):
            with contextlib.suppress(OSError):
                st = path.stat()
                # Linked by no tree, and not just now (a file stored a moment ago by a build
                # that has yet to link it: a link or rename sets its ctime).
                if st.st_nlink == 1 and now - st.st_ctime > 3600:
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


# ---- the local backend: the host files a judged command needs ---------------------------------

#: Folders of a Python installation a test run never reads: its own test suite, the IDE,
#: Tk, the bundled wheels, the headers (and, below, its static library). Its bytecode caches
#: stay: the judged interpreter (``-I``) reads the installation's and the env's, never the
#: repository's (`runner._python`).
_PREFIX_SKIPPED = frozenset(
    {"site-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip",
     "include", "share"}
)  # fmt: skip

#: The programs of a shell script a judged command may run besides the interpreter, found on
#: the sandbox's PATH. Any other host program is absent from a local judged run (a task whose
#: tests run one is graded with the Docker backend, whose image holds all of its own).
TOOLS = (
    "sh", "env", "cat", "ls", "touch", "mkdir", "rm", "cp", "mv", "ln", "chmod", "sleep",
    "echo", "true", "false", "test", "head", "tail", "wc", "sort", "uniq", "cut", "tr",
    "grep", "sed", "id", "uname", "date", "dirname", "basename", "readlink", "find", "xargs",
    "tee", "timeout", "kill", "ps", "awk", "printf", "stat", "which",
)  # fmt: skip


#: Where a link found in a walked folder may lead and be followed.
_SYSTEM = ("/usr/", "/etc/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/lib32/", "/libx32/")


def _data_file(path: str) -> bool:
    try:
        real = os.path.realpath(path)
        return real.startswith(_SYSTEM) and not os.stat(real).st_mode & 0o111
    except OSError:
        return False


class _Files:
    """Host paths (files, symlinks and the folders between) to copy, each at its own path
    in the tree, or at ``dest`` given (the env, seen at /opt/legorl-env)."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}  # tree path -> host path

    def add(self, host: str, dest: str | None = None, follow: bool = True) -> None:
        """``host`` and, where a component of it is a symlink, the link and its target (of
        the last component too, with ``follow``)."""
        dest = dest or host
        if dest in self.entries:
            return
        parts = host.strip("/").split("/")
        for i in range(1, len(parts)):
            above = "/" + "/".join(parts[:i])
            if dest == host and os.path.islink(above):
                self.entries.setdefault(above, above)
                target = os.path.join(os.path.dirname(above), os.readlink(above))
                self.add(os.path.normpath(os.path.join(target, *parts[i:])))
                return
        if os.path.islink(host):
            self.entries[dest] = host
            target = os.path.normpath(os.path.join(os.path.dirname(host), os.readlink(host)))
            # A walked folder's link is followed to a data file in the system's folders only
            # (/etc/os-release into /usr; never /etc/mtab into /proc, nor an alternatives
            # link to a program: the programs are `TOOLS`).
            if dest == host and (follow or _data_file(target)):
                self.add(target)
        elif os.path.isfile(host):
            self.entries[dest] = host

    def walk(self, top: str, dest: str | None = None, skip: frozenset[str] = frozenset()) -> None:
        for folder, dirs, files in os.walk(top):
            # ``skip`` names the installation's own folders (prefix/include, its stdlib's
            # test suite), not a package's below them (ctypes/test stays).
            if folder[len(top) :].count("/") < 3:
                dirs[:] = [d for d in dirs if d not in skip]
            for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
                if name.endswith(".a") or ".opt-" in name:  # no judged run is optimised
                    continue
                host = os.path.join(folder, name)
                self.add(host, None if dest is None else dest + host[len(top) :], follow=False)


def _elf_needs(paths: list[str]) -> set[str]:
    """The shared objects (and loader) the ELF files among ``paths`` load, by ``ldd``; kept
    beside the trees by the listing of those files (``ldd`` over an installation's few hundred
    extension modules takes seconds)."""
    elves = []
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            if fh.read(4) == b"\x7fELF":
                st = os.fstat(fh.fileno())
                elves.append((path, st.st_size, st.st_mtime_ns))
    key = hashlib.sha256(repr(sorted(elves)).encode()).hexdigest()[:32]
    cached = roots_dir() / "ldd" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError):
        listed = set(json.loads(cached.read_text()))
        os.utime(cached)  # its last use, for gc
        return listed
    found: set[str] = set()
    names = [path for path, _, _ in elves]
    for i in range(0, len(names), 200):
        try:
            done = subprocess.run(
                ["ldd", *names[i : i + 200]], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(
                f"cannot list the libraries a judged command loads (ldd): {exc}"
            ) from None
        for line in done.stdout.splitlines():
            words = line.split()
            if "=>" in words and len(words) > words.index("=>") + 1:
                path = words[words.index("=>") + 1]
            elif words and words[0].startswith("/") and not line.endswith(":"):
                path = words[0]
            else:
                continue
            if path.startswith("/"):
                found.add(path)
    cached.parent.mkdir(exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(sorted(found)))
    os.replace(partial, cached)
    return found


@functools.lru_cache(maxsize=16)
def host_files(prefix: str, env_dir: str, env_dest: str, path: str) -> dict[str, str]:
    """What a local judged command may read of the host: the Python installation (less what
    a test run never reads), the env (at ``env_dest``), /etc, ``TOOLS`` found on ``path``,
    the C.UTF-8 locale, the time zones, and every shared object those load."""
    files = _Files()
    files.walk(prefix, skip=_PREFIX_SKIPPED)
    files.walk(env_dir, env_dest)
    files.walk("/etc")
    # The C.UTF-8 locale the sandbox's LANG names, and the time zones Python's `zoneinfo`
    # looks for (round 56: without them Django's default settings fail to load).
    for folder in ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8", *zoneinfo.TZPATH):
        if os.path.isdir(folder):
            files.walk(folder)
    files.add("/bin/sh")  # a command given as a string runs in it (`LocalSandbox._argv`)
    for tool in TOOLS:
        found = shutil.which(tool, path=path)
        if found:
            files.add(found)
    own = [h for d, h in files.entries.items() if d == h or not d.startswith(env_dest)]
    for lib in sorted(_elf_needs([*own, *(h for h in files.entries.values() if h not in own)])):
        files.add(lib)
    return files.entries


#: The tree last made or found for a set of entries in this process, with when it was
#: checked: a host file that changes is seen within ``_RECHECK_S`` (a listing stats
#: thousands of files, 25 ms, which every grading sandbox's start paid).
_checked: dict[int, tuple[dict[str, str], Path, float]] = {}
_RECHECK_S = 60.0


def host_tree(entries: dict[str, str]) -> Path:
    """``entries`` (tree path -> host path) copied to tmpfs once per listing (paths, sizes,
    modes, mtimes), their files hard links into the store shared with the images' trees."""
    known = _checked.get(id(entries))
    fresh = known and known[0] is entries and time.monotonic() - known[2] < _RECHECK_S
    if known and fresh and known[1].is_dir():
        return known[1]
    tree = _host_tree(entries)
    _checked[id(entries)] = (entries, tree, time.monotonic())
    return tree


def _host_tree(entries: dict[str, str]) -> Path:
    listing = []
    for dest, host in sorted(entries.items()):
        st = os.lstat(host)
        listing.append((dest, host, st.st_size, st.st_mode, st.st_mtime_ns, st.st_uid, st.st_gid))
    key = hashlib.sha256(repr(listing).encode()).hexdigest()[:32]
    return _tree(
        f"host-{key}",
        lambda partial, store: _copy_host(listing, partial, store),
        "cannot copy the host's files",
    )


def _copy_host(listing: list[tuple[Any, ...]], tree: Path, store: Path) -> None:
    store.mkdir(mode=0o700, exist_ok=True)
    folders: set[str] = set()
    for dest, host, _size, mode, mtime_ns, uid, gid in listing:
        path = tree / dest.lstrip("/")
        folders.update(str(p) for p in Path(dest).parents if str(p) != "/")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(host), path)
            os.lchown(path, uid, gid)
            continue
        with open(host, "rb") as fh:
            os.link(_stored(fh, (mode, uid, gid, mtime_ns // 10**9), store), path)
    # Each folder as the host's at that path has it (0755 root where the host has none: the
    # env's folders above it), deepest first.
    for folder in sorted(folders, key=lambda f: -f.count("/")):
        try:
            st = os.stat(folder)
            owner, mode = (st.st_uid, st.st_gid), stat.S_IMODE(st.st_mode)
        except OSError:
            owner, mode = (0, 0), 0o755
        os.chown(tree / folder.lstrip("/"), *owner)
        os.chmod(tree / folder.lstrip("/"), mode)
