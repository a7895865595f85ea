"""A judged run reads its files from a copy on tmpfs (`memory_root.py`: the image's root on
Docker, the host's files it needs on the local backend): no page another sandbox can drop or
load carries state into it (round 44)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.protocols import SandboxError
from legorl.sandbox import memory_root

# The file system of every file the interpreter mapped (itself, libc, extension modules) or
# imported (the standard library, the env's packages), and of each mount.
_WHERE = r"""
import json, os, sys, pytest
def lower(path):
    best, found = "", "?"
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        point, sep = f[4], f.index("-")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            opts = dict(o.partition("=")[::2] for o in f[sep + 3].split(","))
            best, found = point, f[sep + 1] + ":" + opts.get("lowerdir", "")
    return found
files = {os.path.realpath(l.split()[-1]) for l in open("/proc/self/maps") if l.split()[-1].startswith("/")}
files |= {os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
print(json.dumps({p: lower(p) for p in sorted(files)}))
"""


async def _where(backend: Any, grading: bool) -> dict[str, str]:
    """Each file the interpreter mapped or imported: ``kind:lower:lower...``, each lower
    folder (on the host) as ``folder=its file system``, read while the sandbox lives."""
    box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), grading=grading)
    try:
        r = await box.exec(["python", "-c", _WHERE], judged=grading)
        assert r.exit_code == 0, r.output
        seen = dict(json.loads(r.output.strip().splitlines()[-1]))
        out = {}
        for path, where in seen.items():
            kind, _, lowers = where.partition(":")
            folders = [f"{f}={memory_root.mount_of(f)[0]}" for f in lowers.split(":") if f]
            out[path] = ":".join([kind, *folders])
        return out
    finally:
        await box.close()


def test_a_judged_run_reads_only_files_on_tmpfs(backend: Any) -> None:
    # Round 44: a right trajectory set which pages of a large read-only image file were cached
    # (read one, or drop it with posix_fadvise), and a wrong one, graded later, timed its reads
    # of them to learn the answers. Page cache belongs to a file, and an overlay reads its
    # lower file's; a tmpfs file's pages are memory no reader can drop.
    seen = run(_where(backend, grading=True))
    assert any("libc" in p for p in seen) and any(p.endswith("/pytest/__init__.py") for p in seen)
    # Each file is read through an overlay of the sandbox's own (inodes of its own, round 43)
    # whose lower folders are on tmpfs: the image's or the host's files copied there, and an
    # empty folder.
    assert {where.split(":")[0] for where in seen.values()} == {"overlay"}, seen
    lowers = {lower for where in seen.values() for lower in where.split(":")[1:]}
    assert all(lower.endswith("=tmpfs") for lower in lowers), lowers
    assert any(lower.startswith(str(memory_root.roots_dir())) for lower in lowers), lowers
    # The control: an agent's sandbox reads the same files from the disk's file system (the
    # image's layers below its overlay root, or the host's folders bound).
    seen = run(_where(backend, grading=False))
    disk = {
        path
        for path, where in seen.items()
        if (where.startswith("overlay:") and "=tmpfs" not in where)
        or not where.startswith(("overlay:", "tmpfs"))
    }
    assert any("libc" in p for p in disk), seen


def _export(entries: list[tuple[str, bytes | None, int]]) -> list[bytes]:
    """An exported root as tar chunks: (name, content or None for a folder, mode)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = out.getvalue()
    return [raw[i : i + 700] for i in range(0, len(raw), 700)]  # chunks cut mid-header


def test_two_images_share_the_store_and_gc_frees_what_no_tree_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEGORL_MEMORY_ROOTS", str(tmp_path))
    monkeypatch.setattr(memory_root, "mount_of", lambda path: ("tmpfs", {"rw"}))
    root = memory_root.roots_dir()
    base = [("usr", None, 0o755), ("usr/lib", None, 0o555), ("usr/lib/libc.so", b"elf", 0o755)]
    for key, extra in (("a" * 12, b"one"), ("b" * 12, b"two")):
        memory_root._unpack(
            _export([*base, ("etc", None, 0o755), ("etc/os", extra, 0o644),
                     ("testbed", None, 0o755), ("testbed/x.py", b"no", 0o644)]),
            root / "trees" / key,
            root / "store",
        )  # fmt: skip
    a, b = root / "trees" / ("a" * 12), root / "trees" / ("b" * 12)
    assert os.path.samefile(a / "usr/lib/libc.so", b / "usr/lib/libc.so")  # one copy in memory
    assert (a / "etc/os").read_bytes() == b"one" and (b / "etc/os").read_bytes() == b"two"
    assert oct((a / "usr/lib").stat().st_mode & 0o777) == "0o555"
    assert memory_root.top_entries(a) == ["etc", "usr"]  # its own repository is not copied
    assert len(list((root / "store").iterdir())) == 3
    assert memory_root.gc({"sha256:" + "b" * 12}) == ["a" * 12]
    assert not a.exists() and b.exists()
    # A store file linked by no tree stays while it may be a build's about to be linked...
    assert len(list((root / "store").iterdir())) == 3
    # ...and goes once that is an hour past ("one" went with its tree).
    later = time.time() + 3700
    monkeypatch.setattr(memory_root.time, "time", lambda: later)
    memory_root.gc({"sha256:" + "b" * 12})
    assert len(list((root / "store").iterdir())) == 2


def test_an_image_s_link_does_not_lead_the_unpacking_out_of_its_tree(tmp_path: Path) -> None:
    # Round 56 (reasoned): the judge unpacks an image's root as root; an image whose export
    # holds a link `usr/lib -> <outside>` and then `usr/lib/evil` would have had it written
    # where the link led. Entries below a link are left out.
    outside = tmp_path / "outside"
    outside.mkdir()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, kind in (("usr", tarfile.DIRTYPE), ("usr/lib", tarfile.SYMTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname = kind, 0o755, str(outside)
            tar.addfile(info)
        info = tarfile.TarInfo("usr/lib/evil")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    memory_root._unpack([raw.getvalue()], tmp_path / "tree", tmp_path / "store")
    assert not list(outside.iterdir())
    assert (tmp_path / "tree" / "usr" / "lib").is_symlink()


def test_grading_as_another_user_than_root_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The copies keep their files' owners and each sandbox's overlay is a mount: both need
    # root, which is said before anything is made.
    monkeypatch.setattr(memory_root.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="sha256:abc: a grading sandbox needs root"):
        memory_root.image_tree(None, "sha256:abc")


def test_a_memory_root_folder_that_is_not_an_executable_tmpfs_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEGORL_MEMORY_ROOTS", str(tmp_path / "roots"))
    kind, _ = memory_root.mount_of(tmp_path)
    if kind != "tmpfs":
        with pytest.raises(
            SandboxError, match=f"LEGORL_MEMORY_ROOTS: {tmp_path}/roots is on {kind}"
        ):
            memory_root.roots_dir()
    monkeypatch.setattr(memory_root, "mount_of", lambda path: ("tmpfs", {"rw", "noexec"}))
    with pytest.raises(SandboxError, match="roots is on tmpfs mounted noexec"):
        memory_root.roots_dir()


def test_the_local_judged_files_are_the_python_its_env_etc_and_what_they_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import sysconfig

    from legorl.sandbox.common import BASE_PATH

    env = tmp_path / "venv"
    (env / "lib" / "pkg").mkdir(parents=True)
    (env / "lib" / "pkg" / "mod.py").write_text("x = 1\n")
    (env / "lib" / "pkg" / "__pycache__").mkdir()
    (env / "lib" / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"cached")
    found = memory_root.host_files(sys.base_prefix, str(env), "/opt/legorl-env", BASE_PATH)
    assert found["/opt/legorl-env/lib/pkg/mod.py"] == str(env / "lib" / "pkg" / "mod.py")
    assert found["/opt/legorl-env/lib/pkg/__pycache__/mod.pyc"]  # the env's caches too
    assert os.path.realpath("/bin/sh") in found.values() and "/etc/passwd" in found
    stdlib = sysconfig.get_paths(vars={"installed_base": sys.base_prefix})["stdlib"]
    assert os.path.join(stdlib, "os.py") in found
    assert not any(dest.startswith(os.path.join(stdlib, "site-packages") + "/") for dest in found)
    assert any(os.path.basename(dest).startswith("libc.so") for dest in found)  # by ldd
    # Copied once; a tree unused for a day goes at the next gc, and its files with it.
    monkeypatch.setenv("LEGORL_MEMORY_ROOTS", str(tmp_path / "roots"))
    monkeypatch.setattr(memory_root, "mount_of", lambda path: ("tmpfs", {"rw"}))
    small = {d: h for d, h in found.items() if d.startswith(("/opt/", "/etc/passwd"))}
    tree = memory_root.host_tree(small)
    assert (tree / "opt/legorl-env/lib/pkg/mod.py").read_text() == "x = 1\n"
    assert memory_root.host_tree(small) == tree
    assert memory_root.gc(None) == []
    old = time.time() - memory_root.HOST_TREE_IDLE_S - 60
    os.utime(tree, (old, old))
    later = time.time() + 3700  # past the store's grace for a build about to link its file
    monkeypatch.setattr(memory_root.time, "time", lambda: later)
    assert memory_root.gc(None) == [tree.name] and not tree.exists()
    assert not list((tmp_path / "roots" / "store").iterdir())


_USES = (
    "import multiprocessing, zoneinfo\n"
    "out = []\n"
    "try:\n"
    "    zoneinfo.ZoneInfo('America/Chicago'); out.append('zones')\n"
    "except Exception as exc:\n"
    "    out.append(type(exc).__name__)\n"
    "try:\n"
    "    multiprocessing.Lock(); out.append('shm')\n"
    "except Exception as exc:\n"
    "    out.append(type(exc).__name__)\n"
    "print(' '.join(out))\n"
)


def test_a_judged_run_has_the_time_zones_and_shared_memory_the_sandbox_has(backend: Any) -> None:
    # Round 56: the local judged root had no time-zone files (Django's default settings name
    # America/Chicago and failed to load, so no Django gold graded there), and bubblewrap's
    # /dev/shm was root's, so multiprocessing's locks failed for the judged user.
    async def go() -> tuple[str, str]:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), grading=True)
        try:
            judged = await box.exec(["python", "-c", _USES], judged=True)
            root = await box.exec(["python", "-c", _USES])
            return judged.output.strip(), root.output.strip()
        finally:
            await box.close()

    judged, root = run(go())
    assert judged == root, (judged, root)  # root's steps see the image's or host's own files
    if backend.name == "local":
        assert judged == "zones shm", judged


def test_a_grading_sandbox_with_a_proxy_is_refused_before_anything_is_made(backend: Any) -> None:
    # A grading sandbox reaches no network; its judged root has no room for the relay.
    with pytest.raises(SandboxError, match="a grading sandbox reaches no proxy"):
        run(
            backend.start(
                task(), str(TASKS_DIR), run_id=run_id(), grading=True,
                proxy_url="http://127.0.0.1:9/v1",
            )
        )  # fmt: skip
