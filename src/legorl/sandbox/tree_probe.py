"""What a working tree really holds against a base commit, read from the file system itself
and never through the tree's own git configuration, attributes or hooks. Standard library
only: it is copied into a sandbox and run there by a trusted interpreter,

    python3 -I -S tree_probe.py REQUEST.json   # or "-": the request on stdin
    python3 -I -S - '{"mode": …}' < tree_probe.py

where the request names a mode (``survey`` or ``diff``) and the output file (with ``print``
the result goes to stdout too). Grading (``legorl.verify.tree``) and both sandbox backends' ``diff()`` use it; its
``clean_git`` builds every git command line they run.

Files are hashed as git would store them with no filter at all (``blob <size>\\0<bytes>``), so
an attribute (``eol``, ``ident``, ``working-tree-encoding``, ``filter``) in the tree cannot make
a changed file look unchanged, and a nested ``.git`` cannot hide a folder from the listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Any

#: git configuration forced on every command: no hooks, no fsmonitor, no external diff or
#: textconv, no attributes beyond the repository's own files, no system or user config.
_CONFIG = (
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.untrackedCache=false",
    "core.attributesFile=/dev/null",
    "core.excludesFile=/dev/null",
    "core.quotePath=false",
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.symlinks=true",
    "core.fileMode=true",
    "diff.noprefix=false",
    "diff.relative=false",
    "diff.mnemonicPrefix=false",
    "diff.renames=false",
    "color.ui=false",
    "safe.directory=*",
    "protocol.allow=never",
)
_ENV = (
    "GIT_CONFIG_NOSYSTEM=1",
    "GIT_CONFIG_GLOBAL=/dev/null",
    "GIT_ATTR_NOSYSTEM=1",
    "HOME=/nonexistent",
    "XDG_CONFIG_HOME=/nonexistent",
    "GIT_TERMINAL_PROMPT=0",
    "GIT_OPTIONAL_LOCKS=0",
)
_UNSET = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_EXTERNAL_DIFF",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_NAMESPACE",
    "GIT_CEILING_DIRECTORIES",
    "GIT_ATTR_SOURCE",
)

#: The largest patch a diff hands on, in bytes (grading refuses a longer patch text, and a
#: tree whose patch is longer; the rollout's diff of such a tree fails, the agent's doing).
#: A binary hunk is compressed: 214 KB of patch made a judged diff of 51 MB (round 8).
PATCH_BYTES = 8 << 20

JUNK_DIRS = ("__pycache__", ".pytest_cache")
JUNK_SUFFIXES = (".pyc", ".pyo")


def clean_git(
    *args: str,
    git_dir: str,
    work_tree: str | None = None,
    index: str | None = None,
    objects: str | None = None,
    alternates: str | None = None,
) -> list[str]:
    """The one git command line of grading and of the rollout diff: ``env`` with a clean
    configuration, an explicit git dir (and work tree, index, object store), then ``args``."""
    env = ["env", *(f"-u{name}" for name in _UNSET), *_ENV]
    if index is not None:
        env.append(f"GIT_INDEX_FILE={index}")
    if objects is not None:
        env.append(f"GIT_OBJECT_DIRECTORY={objects}")
    if alternates is not None:
        env.append(f"GIT_ALTERNATE_OBJECT_DIRECTORIES={alternates}")
    argv = [*env, "git", f"--git-dir={git_dir}"]
    argv.append(f"--work-tree={work_tree}" if work_tree is not None else "--bare")
    for item in _CONFIG:
        argv += ["-c", item]
    return [*argv, *args]


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(full: str) -> tuple[str, str, bytes] | None:
    """(git mode, blob sha, bytes) of a regular file or symlink; None for anything else."""
    st = os.lstat(full)
    if stat.S_ISLNK(st.st_mode):
        data = os.fsencode(os.readlink(full))
        return "120000", blob_sha(data), data
    if stat.S_ISREG(st.st_mode):
        with open(full, "rb") as fh:
            data = fh.read()
        return ("100755" if st.st_mode & stat.S_IXUSR else "100644"), blob_sha(data), data
    return None


def _at(root: str, path: str) -> str:
    """``path`` below ``root`` as the probe opens it. ``main`` runs in the tree (``root`` is
    ``"."``), so a path git made relative opens at its own length: with ``/testbed/`` before
    it, a path of 4,090 bytes was past the kernel's limit (round 75)."""
    return path if root == "." else os.path.join(root, path)


def _junk(path: str) -> bool:
    *folders, name = path.split("/")
    return name.endswith(JUNK_SUFFIXES) or any(f in JUNK_DIRS for f in folders)


def walk(root: str, *, skip_junk: bool = False) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """({path: (mode, sha)} of every file and symlink under ``root`` except its own ``.git``,
    [paths of other kinds: fifos, sockets, devices])."""
    found: dict[str, tuple[str, str]] = {}
    odd: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(_at(root, rel) if rel else root) as it:
            entries = list(it)
        for de in entries:
            path = f"{rel}/{de.name}" if rel else de.name
            if path == ".git":
                continue
            if de.is_dir(follow_symlinks=False):
                if skip_junk and de.name in JUNK_DIRS:
                    continue
                stack.append(path)
                continue
            if skip_junk and de.name.endswith(JUNK_SUFFIXES):
                continue
            got = _entry(_at(root, path))
            if got is None:
                odd.append(path)
            else:
                found[path] = (got[0], got[1])
    return found, odd


def _run(argv: list[str], data: bytes | None = None) -> bytes:
    proc = subprocess.run(argv, input=data, capture_output=True, check=False)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(argv[-3:])}: {err[0]}")
    return proc.stdout


def base_tree(git: dict[str, str], base: str) -> dict[str, tuple[str, str]]:
    out = _run(clean_git("ls-tree", "-r", "-z", "--full-tree", base, **git))
    tree: dict[str, tuple[str, str]] = {}
    for item in out.split(b"\0"):
        if not item:
            continue
        meta, _, path = item.partition(b"\t")
        mode, _kind, sha = meta.decode().split()
        tree[os.fsdecode(path)] = (mode, sha)
    return tree


def changes(
    root: str, git: dict[str, str], base: str, *, skip_junk: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every path whose mode or bytes differ from ``base``: {path, before, after} with
    [mode, sha] or None, sorted by path; and the odd (non-file) paths."""
    now, odd = walk(root, skip_junk=skip_junk)
    then = base_tree(git, base)
    if skip_junk:  # junk the base tracks is left as it is, never shown deleted
        then = {path: v for path, v in then.items() if not _junk(path)}
    out = []
    for path in sorted(set(now) | set(then)):
        before, after = then.get(path), now.get(path)
        if before != after:
            out.append(
                {
                    "path": path,
                    "before": list(before) if before else None,
                    "after": list(after) if after else None,
                }
            )
    return out, odd


def ignored(root: str, git: dict[str, str], paths: list[str]) -> set[str]:
    """Which untracked ``paths`` the tree's own ignore rules exclude (as ``git add -A`` would)."""
    if not paths:
        return set()
    proc = subprocess.run(
        clean_git("check-ignore", "-z", "--stdin", **{**git, "work_tree": root}),
        input=b"\0".join(os.fsencode(p) for p in paths) + b"\0",
        capture_output=True,
        cwd=root,
        check=False,
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"check-ignore: {proc.stderr.decode(errors='replace').strip()}")
    return {os.fsdecode(p) for p in proc.stdout.split(b"\0") if p}


def write_tree(root: str, git: dict[str, str], base: str, rows: list[dict[str, Any]]) -> str:
    """A tree object: ``base`` with ``rows`` (from ``changes``) applied, blobs stored as the
    raw bytes on disk. Needs ``git['index']`` (a throw-away index) and a writable store. The
    blobs are stored by one git process (a tree of 70,000 new files took one process a file,
    16 minutes of a grading, round 8; 66,000 symlinks, round 19): a symlink's target, and a
    file whose path git cannot read by line, are copied to a scratch file of a plain name
    first. Each must hash as the walk saw it."""
    _run(clean_git("read-tree", base, **git))
    info = []
    batch: list[tuple[str, str, str]] = []  # (path, mode, sha) of regular files
    scratch = tempfile.mkdtemp(prefix="blobs-", dir=os.path.dirname(git["index"]) or None)
    copies: dict[str, str] = {}  # path -> the scratch file holding its blob's bytes
    for row in rows:
        path = row["path"]
        if row["after"] is None:
            info.append(b"0 " + b"0" * 40 + b"\t" + os.fsencode(path))
            continue
        full = _at(root, path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and "\n" not in full:
            batch.append((path, *row["after"]))
            continue
        got = _entry(full)  # a symlink (its target is its blob), or a path git reads by line
        if got is None:
            continue
        mode, sha, data = got
        copies[path] = os.path.join(scratch, str(len(copies)))
        with open(copies[path], "wb") as fh:
            fh.write(data)
        batch.append((path, mode, sha))
    try:
        if batch:
            names = "".join(
                (copies[p] if p in copies else _at(root, p)) + "\n" for p, _, _ in batch
            )
            argv = clean_git("hash-object", "-w", "--no-filters", "--stdin-paths", **git)
            stored = _run(argv, os.fsencode(names)).decode().split()
            if len(stored) != len(batch):
                raise RuntimeError(f"hash-object stored {len(stored)} of {len(batch)} files")
            for (path, mode, sha), got_sha in zip(batch, stored, strict=True):
                if got_sha != sha:
                    raise RuntimeError(f"{path}: git stored another hash than the bytes' own")
                info.append(f"{mode} {sha}".encode() + b"\t" + os.fsencode(path))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if info:
        _run(clean_git("update-index", "-z", "--index-info", **git), b"\0".join(info) + b"\0")
    return _run(clean_git("write-tree", **git)).decode().strip()


def too_large(result: dict[str, Any]) -> str:
    """Why a diff whose patch is past ``PATCH_BYTES`` is not handed on."""
    return f"the tree's patch is {result['too_large']:,} bytes, past the {PATCH_BYTES:,} allowed"


def tree_diff(git: dict[str, str], base: str, tree: str) -> bytes:
    """The binary-safe patch from ``base`` to ``tree``, with no attributes (no work tree, an
    empty index) and no external diff or textconv."""
    plain = {k: v for k, v in git.items() if k != "work_tree"}
    plain["index"] = git["index"] + ".none"  # a missing index reads as an empty one
    if os.path.lexists(plain["index"]):
        os.unlink(plain["index"])
    return _run(
        clean_git(
            "diff-tree",
            "-r",
            "-p",
            "--binary",
            "--no-ext-diff",
            "--no-textconv",
            "--no-renames",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            base,
            tree,
            **plain,
        )
    )


def _env_dirs(extra_dirs: list[str], repo: str) -> list[str]:
    """The folders this interpreter imports from without the repository (real paths, each
    once): ``sys.path``, the site-packages, the standard library, and ``extra_dirs``."""
    import site
    import sysconfig

    dirs = [p for p in sys.path if p]
    dirs += site.getsitepackages() + [sysconfig.get_paths()["stdlib"], *extra_dirs]
    # Run with -S, a virtualenv's own site-packages is not on sys.path: find it as site would,
    # without running its .pth files.
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        for lib in ("lib", "lib64"):
            dirs.append(os.path.join(venv, lib, version, "site-packages"))
    repo_real = os.path.realpath(repo)
    out: list[str] = []
    for folder in dirs:
        real = os.path.realpath(folder)
        inside = real == repo_real or real.startswith(repo_real + os.sep)
        if not inside and os.path.isdir(real) and real not in out:
            out.append(real)
    return out


def shadowable(extra_dirs: list[str], repo: str) -> list[str]:
    """Top-level module names this interpreter can import without the repository: builtins,
    the standard library, every installed distribution, and ``extra_dirs`` (grading's own)."""
    import importlib.machinery

    names = set(sys.builtin_module_names)
    names.update(getattr(sys, "stdlib_module_names", ()))
    suffixes = tuple(importlib.machinery.all_suffixes())
    for real in _env_dirs(extra_dirs, repo):
        for name in os.listdir(real):
            full = os.path.join(real, name)
            # Any name, identifier or not: ``import_module`` takes one with a hyphen (round 103)
            if os.path.isdir(full):
                if "." not in name:
                    names.add(name)
                continue
            for suffix in suffixes:
                if name.endswith(suffix) and name[: -len(suffix)]:
                    names.add(name[: -len(suffix)])
                    break
            else:
                mod = name.split(".", 1)[0]
                if name.endswith((".so", ".pyd")) and mod:
                    names.add(mod)
    return sorted(names)


def mention_pattern(names: list[str]) -> re.Pattern[bytes]:
    """Each of ``names`` as a word; `_mentions_in` keeps the ones named as code imports."""
    alternatives = b"|".join(re.escape(n.encode()) for n in names)
    return re.compile(rb"(?<![A-Za-z0-9_])(" + alternatives + rb")(?![A-Za-z0-9_])")


_IMPORT_BEFORE = re.compile(rb"\bimport\b|\bfrom[ \t]+$")


def _as_import(data: bytes, at: int) -> bool:
    """Whether the word at ``at`` is named as code could import it: on a line after ``import``,
    right after ``from``, or at the start of a quoted string (``__import__("ipdb")``,
    ``"tblib.pickling_support"``, an app in a settings list)."""
    if at > 0 and data[at - 1 : at] in (b'"', b"'"):
        return True
    newline = data.rfind(b"\n", max(0, at - 400), at)
    start = newline + 1 if newline >= 0 else max(0, at - 400)
    return _IMPORT_BEFORE.search(data, start, at) is not None


def _mentions_in(pattern: re.Pattern[bytes], read: Any, found: set[str]) -> None:
    """The names ``pattern`` finds named as imports in one file, read a chunk at a time."""
    tail = b""
    while True:
        chunk = read(8 << 20)
        if not chunk:
            return
        data = tail + chunk
        for m in pattern.finditer(data):
            if _as_import(data, m.start()):
                found.add(m.group(1).decode())
        tail = data[-512:]


#: The environment's files `mentions` reads: sources, site hooks and configuration texts.
_READ_FOR_NAMES = (".py", ".pyw", ".pth", ".cfg", ".ini", ".toml")


def mentioned_in(names: list[str], data: bytes) -> set[str]:
    """The ``names`` that ``data`` names as imports (the judge's side of `mentions`)."""
    found: set[str] = set()
    _mentions_in(mention_pattern(names), _reader(data), found)
    return found


def mentions(
    names: list[str],
    repo: str,
    git: dict[str, str],
    base: str,
    extra_dirs: list[str],
    changed: set[str],
    links: bool = True,
) -> list[str]:
    """The ``names`` that some file the patch did not write names as code could import them:
    the environment's Python sources, ``.pth`` files and configuration (`_READ_FOR_NAMES`) in
    every folder the interpreter imports from (grading's own ``extra_dirs`` aside), and every
    file of the repository as the base commit has it. Compiled files are not read: a name a
    compiled module tries stays unseen. ``changed``: the paths the patch changed (the survey's),
    read from the base commit."""
    pattern, found = mention_pattern(names), set[str]()
    seen: set[str] = set()
    grading = {os.path.realpath(d) for d in extra_dirs}
    for real in _env_dirs([], repo):
        if real in grading:
            continue
        for folder, _, files in os.walk(real):
            for name in files:
                full = os.path.join(folder, name)
                # A symlink is read where it leads (round 104: Debian's sitecustomize.py, a
                # link into /etc, imports apport_python_hook at every interpreter's start).
                target = os.path.realpath(full)
                if not name.endswith(_READ_FOR_NAMES) or target in seen:
                    continue
                if not links and os.path.islink(full):  # a control only
                    continue
                seen.add(target)
                if not os.path.isfile(target):
                    continue
                try:
                    with open(target, "rb") as fh:
                        _mentions_in(pattern, fh.read, found)
                except OSError:
                    continue
    for path, (mode, sha) in sorted(base_tree(git, base).items()):
        if mode in ("160000", "120000"):  # a submodule, a symlink: no text of code
            continue
        if path in changed:
            data = _run(clean_git("cat-file", "blob", sha, **git))
            _mentions_in(pattern, _reader(data), found)
            continue
        try:
            with open(_at(repo, path), "rb") as fh:
                _mentions_in(pattern, fh.read, found)
        except OSError:
            continue
    return sorted(found)


def _reader(data: bytes) -> Any:
    """``read(n)`` over ``data`` in memory."""
    import io

    return io.BytesIO(data).read


def _text(
    git: dict[str, str], root: str, row: dict[str, Any], budget: list[int]
) -> dict[str, str | None]:
    """A changed file's texts before and after, each at most ``budget[1]`` bytes and all of
    them at most ``budget[0]`` (spent here); past either, None: the judge reads a text it was
    not given as changed, as it does one past its own parse limits."""

    def cut(data: bytes) -> str | None:
        if len(data) > min(budget):
            return None
        budget[0] -= len(data)
        return data.decode("utf-8", "replace")

    before = after = None
    if row["before"]:
        before = cut(_run(clean_git("cat-file", "blob", row["before"][1], **git)))
    if row["after"] and row["after"][0] != "120000":
        with open(_at(root, row["path"]), "rb") as fh:
            after = cut(fh.read(min(budget) + 1))
    return {"before_text": before, "after_text": after}


def _diff(
    root: str, git: dict[str, str], req: dict[str, Any], rows: list[dict[str, Any]], odd: list[str]
) -> dict[str, Any]:
    """The tree as it is against ``base``: its changes (unless the request says ``listing``
    false: the rollout's diff wants the patch alone, and a tree of a million ignored files
    made a listing of gigabytes, round 9), and its patch written beside ``out``."""
    listing = req.get("listing", True)
    result: dict[str, Any] = {"changes": rows, "odd": odd} if listing else {}
    if req.get("respect_ignores"):
        fresh = [r["path"] for r in rows if r["before"] is None]
        drop = ignored(root, git, fresh)
        rows = [r for r in rows if r["path"] not in drop]
    rows = [r for r in rows if ".git" not in r["path"].casefold().split("/")]
    tree = write_tree(root, git, req["base"], rows)
    patch_file = req["out"] + (".patch" if req["mode"] == "diff" else ".diff.patch")
    with open(patch_file, "wb") as fh:
        fh.write(tree_diff(git, req["base"], tree))
    result.update(tree=tree, patch_file=patch_file)
    if listing:
        result["paths"] = [r["path"] for r in rows]
    size = os.path.getsize(patch_file)
    if size > PATCH_BYTES:
        result["too_large"] = size  # the patch stays in its file, unread
    return result


def main(request_path: str) -> int:
    if request_path == "-":
        req = json.load(sys.stdin)
    elif request_path.startswith("{"):  # the request itself (the script came on stdin)
        req = json.loads(request_path)
    else:
        with open(request_path) as fh:
            req = json.load(fh)
    # Every path of the request absolute: the probe reads the tree from inside it (``_at``).
    mode, root = req["mode"], os.path.abspath(req.get("root", "/testbed"))
    out = req["out"] = os.path.abspath(req["out"])
    git = {
        k: os.path.abspath(req[k])
        for k in ("git_dir", "index", "objects", "alternates")
        if req.get(k)
    }
    git["work_tree"] = root
    gitdirs = [os.path.abspath(p) for p in req.get("gitdir", ())]
    diff_index = os.path.abspath(req["diff_index"]) if req.get("diff_index") else None
    if git.get("objects"):
        os.makedirs(git["objects"], exist_ok=True)
    result: dict[str, Any] = {}
    try:  # the folder to go back to (a test calls main in its own process)
        back: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a cwd this user cannot read: nothing to go back to
        back = None
    try:
        if os.path.islink(root) or not os.path.isdir(root):
            raise RuntimeError(f"{root} is not a folder")
        os.chdir(root)
        if mode == "survey":  # grading, after the patch: what changed, and what it may shadow
            rows, odd = changes(".", git, req["base"])
            texts = set(req.get("texts", ()))
            budget = [req.get("text_budget", 1 << 20), req.get("text_bytes", 1 << 20)]
            for row in rows:
                if os.path.basename(row["path"]) in texts:
                    row.update(_text(git, ".", row, budget))
            now, _ = walk(gitdirs[0])
            then, _ = walk(gitdirs[1])
            result = {
                "changes": rows,
                "odd": odd,
                "base_paths": sorted(base_tree(git, req["base"])),
                "names": shadowable(req.get("extra_dirs", []), root),
                "gitdir_differ": sorted(
                    p for p in set(now) | set(then) if now.get(p) != then.get(p)
                ),
            }
            if diff_index:  # the judged diff too, for when nothing is reverted
                result["diff"] = _diff(".", dict(git, index=diff_index), req, rows, odd)
        elif mode == "mentions":  # grading: which new names some text a runner reads imports
            found = mentions(
                req["names"],
                ".",
                git,
                req["base"],
                req.get("extra_dirs", []),
                set(req["changed"]),
                links=req.get("links", True),
            )
            result = {"mentioned": found}
        elif mode == "diff":
            rows, odd = changes(".", git, req["base"], skip_junk=req.get("skip_junk", False))
            result = _diff(".", git, req, rows, odd)
        else:
            raise RuntimeError(f"unknown mode {mode!r}")
    except (OSError, RuntimeError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if back is not None:
            os.fchdir(back)
            os.close(back)
    with open(out, "w") as fh:
        json.dump(result, fh)
    if req.get("print"):
        for part in (result, result.get("diff")):
            if part and "patch_file" in part and "too_large" not in part:
                with open(part["patch_file"], "rb") as fh:
                    part["patch"] = fh.read().decode("utf-8", "replace")
        sys.stdout.write(json.dumps(result) + "\n")
    return 0 if "error" not in result else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
