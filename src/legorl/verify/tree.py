"""Grading's apply-and-judge phase: the model's patch is applied in the grading sandbox, and
every rule is decided on the tree it produced, as the file system holds it (``tree_probe``),
never on what the patch text says. Run by ``legorl verify`` through ``grade()``:

    judged = await apply_model_patch(sandbox, task, patch, defences_off=frozenset())
    judged.reverted   # [{"path": "conftest.py", "reason": "runner_config_touched", ...}]
    judged.changed, judged.diff   # the real changed paths and patch of the judged tree
    applied, error = await apply_test_patch(sandbox, task)

A path that breaks a rule (an existing test file, runner configuration, the hidden
test_patch's paths, anything under a ``.git``, ``.gitattributes``, compiled code, a new
top-level name that shadows a module the environment has) is put back as it was at the base
commit and named, and the patch does not pass: the tree graded is then not the tree the patch
makes, and code that reads the difference would be fixed only here (round 61). A new test file
that breaks no other rule and that no import can take for another module is kept, and the
rest. Every
git command runs through ``tree_probe.clean_git`` against a copy of the pristine ``.git``
taken before the patch, so nothing the patch writes (hooks, config, attributes) runs.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import re
import secrets
import shlex
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.protocols import Sandbox, SandboxError
from legorl.records import Task
from legorl.sandbox import tree_probe
from legorl.sandbox.common import GRADING_REPO_INODES, GRADING_REPO_MB, WORKDIR
from legorl.sandbox.tree_probe import PATCH_BYTES, clean_git
from legorl.verify.patches import FileDiff, PatchError, parse_strict, sanitize, split_diff
from legorl.verify.tree_rules import (
    CONFIG_BUDGET,
    CONFIG_BYTES,
    PYTEST_SECTIONS,
    TEST_ADDED,
    import_roots,
    judge,
    runner_folders,
)

GRADE_DIR = "/tmp/legorl-grade"  # inside the grading sandbox, outside the repository
GIT_DIR = f"{GRADE_DIR}/git"  # grading's working copy of the pristine .git
ORIG_GIT = f"{GRADE_DIR}/orig.git"  # the pristine .git, only ever compared with
PROBE = f"{GRADE_DIR}/tree_probe.py"
SNAPSHOT = f"{GRADE_DIR}/judged.tar"
#: The most of a probe's result file grading reads (its listing and the judged tree's patch).
PROBE_LIMIT = 64 << 20
#: The longest model patch grading reads (characters), and the longest patch of the judged
#: tree (bytes): reading one costs the judge about 40 bytes of memory per character of many
#: short lines. Patches that fix an issue are kilobytes.
MAX_PATCH = PATCH_BYTES

#: The patch phase's switches (``VerifyConfig.defences_off``), for the red team's controls.
DEFENCES = frozenset(
    {"judge_tree", "strict_patch", "neutral_git", "put_back_fails", "mentions_through_links"}
)


@dataclass(slots=True)
class Judged:
    """What applying the model's patch did."""

    method: str | None = "empty"  # git_apply | git_apply_3way | patch_fuzz | empty | None
    error: str = ""  # why it did not apply (method None)
    refused: str | None = None  # a flag when the patch text was refused before applying
    #: {path, reason, action}: each a change the grader put back, so the tree it grades is not
    #: the one the patch makes, and the patch does not pass (`grade`)
    reverted: list[dict[str, str]] = field(default_factory=list)
    added_tests: list[str] = field(default_factory=list)  # new test files, kept
    changed: list[str] = field(default_factory=list)  # real changed paths after reverts
    diff: str = ""  # the judged tree's real patch against the base commit

    @property
    def flags(self) -> set[str]:
        out = {r["reason"] for r in self.reverted}
        if self.refused:
            out.add(self.refused)
        return out


def git(*args: str, work_tree: str | None = None, index: str | None = None) -> list[str]:
    """``clean_git`` on grading's copy of the pristine .git and /testbed."""
    return clean_git(*args, git_dir=GIT_DIR, work_tree=work_tree or WORKDIR, index=index)


async def _sh(
    sandbox: Sandbox, argv: list[str], what: str, timeout: float = 120, stdin: bytes | None = None
) -> str:
    result = await sandbox.exec(argv, timeout=timeout, cwd=sandbox.workdir, stdin=stdin)
    if result.exit_code != 0:
        raise SandboxError(f"grading: {what} failed: {result.output.strip()[-300:]}")
    return result.output


#: Written into grading's git dir, whose ``info/attributes`` outranks every ``.gitattributes``
#: in the tree: each attribute git consults is declared unspecified for every path, the state
#: of a repository with no attribute files at all. A tree's file (or macro) cannot set what a
#: higher-ranked file already determined, so no filter, encoding, eol, ident, diff or merge
#: driver of the patch's choosing reaches grading's apply, checkout, refresh or diff.
NO_ATTRIBUTES = (
    "* "
    + " ".join(
        f"!{name}"
        for name in (
            "text",
            "crlf",
            "eol",
            "ident",
            "filter",
            "working-tree-encoding",
            "encoding",
            "diff",
            "merge",
            "conflict-marker-size",
            "whitespace",
            "export-ignore",
            "export-subst",
            "delta",
            "binary",
        )
    )
    + "\n"
)
#: Grading's git dir keeps none of the repository's configuration: only the format version
#: and the extensions its objects need to be read.
_BARE_CONFIG = (
    'g={git}; v=$(git config --file "$g/config.orig" core.repositoryformatversion || echo 0); '
    'printf "[core]\\n\\trepositoryformatversion = %s\\n\\tbare = false\\n" "$v" '
    '> "$g/config" && git config --file "$g/config.orig" --get-regexp "^extensions\\." | '
    'while read -r k val; do git config --file "$g/config" "$k" "$val" || exit 1; done'
)


def _neutral_git_dir(git_dir: str) -> str:
    """Shell that strips ``git_dir`` of the repository's configuration and attributes."""
    return (
        f"mv {git_dir}/config {git_dir}/config.orig && "
        f"({_BARE_CONFIG.format(git=git_dir)}) && rm -f {git_dir}/config.orig && "
        f"mkdir -p {git_dir}/info && printf '%s' {shlex.quote(NO_ATTRIBUTES)} "
        f"> {git_dir}/info/attributes"
    )


async def prepare(sandbox: Sandbox, files: dict[str, str], *, neutral_git: bool = True) -> None:
    """The grading folder with the probe and ``files`` (name: text), and two copies of the
    pristine .git taken before any patch, in one command; grading's copy stripped of the
    repository's configuration and of every attribute (``NO_ATTRIBUTES``) unless
    ``neutral_git`` is off (a control)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        items = {"tree_probe.py": Path(tree_probe.__file__).read_bytes()}
        items.update(
            {k: v.encode() if v.endswith("\n") else (v + "\n").encode() for k, v in files.items()}
        )
        for name, data in items.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    wd = sandbox.workdir
    script = (
        f"mkdir -p {GRADE_DIR} && tar -x -C {GRADE_DIR} -f - && "
        f"cp -a {wd}/.git {GIT_DIR} && cp -a {wd}/.git {ORIG_GIT}"
    )
    if neutral_git:
        script += " && " + _neutral_git_dir(GIT_DIR)
    result = await sandbox.exec(["sh", "-c", script], timeout=120, stdin=buf.getvalue())
    if result.exit_code != 0:
        raise SandboxError(f"grading: preparing the grading folder failed: {result.output[-300:]}")


async def probe(sandbox: Sandbox, mode: str, python: str = "python3", **req: Any) -> dict[str, Any]:
    """Run ``tree_probe`` in the sandbox (isolated interpreter: no site, no cwd, no env); the
    request goes in on stdin, the result comes back on stdout (from its file when too long)."""
    name = f"{GRADE_DIR}/probe-{secrets.token_hex(4)}"
    body: dict[str, Any] = {"mode": mode, "out": f"{name}.out", "root": sandbox.workdir}
    body.update(git_dir=GIT_DIR, print=True, **req)
    run = await sandbox.exec(
        ["sh", "-c", f"cd / && {python} -I -S {PROBE} -"],
        timeout=300,
        cwd="/",
        stdin=json.dumps(body).encode(),
    )
    try:
        out = json.loads(run.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        try:
            text = await sandbox.read_file(f"{name}.out", limit=PROBE_LIMIT)
            out = await asyncio.to_thread(json.loads, text)  # up to 64 MiB: off the loop
        except (OSError, SandboxError, ValueError):
            why = run.output[-300:]
            raise SandboxError(f"grading: the tree probe ({mode}) failed: {why}") from None
    if "error" in out:
        raise SandboxError(f"grading: the tree probe ({mode}) failed: {out['error']}")
    for part in (out if mode == "diff" else None, out.get("diff")):
        if part is not None and "too_large" in part:
            part["patch"] = ""  # never read: the caller refuses the tree
        elif part is not None and "patch" not in part:
            try:
                patch = await sandbox.read_file(str(part["patch_file"]), limit=PROBE_LIMIT)
            except (OSError, KeyError) as exc:
                raise SandboxError(f"grading: the judged tree's patch: {exc}") from None
            part["patch"] = patch.decode("utf-8", "replace")
    return out


def _refuse(patch: str) -> tuple[str, str] | None:
    try:
        size = len(patch.encode("utf-8"))  # bytes, as the judged tree's patch
    except UnicodeEncodeError as err:  # a lone surrogate (JSON allows one): no file holds it
        return "malformed_patch", f"the patch text is refused: no UTF-8 at character {err.start}"
    if size > MAX_PATCH:
        return "patch_too_large", (
            f"the patch text is refused: {size:,} bytes, past the {MAX_PATCH:,} a patch may have"
        )
    try:
        sections = parse_strict(patch)
    except PatchError as err:
        return err.flag, f"the patch text is refused: {err}"
    paths, written = _tree_cost(sections)
    if paths > MAX_NEW_PATHS or written > MAX_BINARY_BYTES:
        return "patch_too_large", (
            f"the patch's tree is refused: {paths:,} new files and folders and {written:,} bytes "
            f"of binary files, past the {MAX_NEW_PATHS:,} and {MAX_BINARY_BYTES:,} a patch may "
            f"add"
        )
    return None


#: What a patch may add to its judged tree: half of a grading sandbox's repository tmpfs, in
#: inodes and in bytes (binary files come compressed: the size they are written at counts),
#: the other half the repository's own. A tree that could not fit is refused before any sandbox
#: is made, the same on both backends, rather than found out by a full tmpfs (round 75: 283,000
#: new files failed after 135 s; the backends' caps disagreed).
MAX_NEW_PATHS = GRADING_REPO_INODES // 2
MAX_BINARY_BYTES = (GRADING_REPO_MB << 20) // 2


def _tree_cost(sections: list[FileDiff]) -> tuple[int, int]:
    """(new files and the folders they need, an upper bound; bytes of binary files as they are
    written) of a patch's sections. A rename or copy makes its new path as a new file does.
    Folders are counted as (parent, name) pairs, linear in the paths' length (round 77: every
    prefix of a deep path, kept as a string, took memory quadratic in it)."""
    folders: dict[tuple[int, str], int] = {}
    files = written = 0
    for section in sections:
        if section.creates or section.new_path not in (section.old_path, "/dev/null"):
            files += 1
            node = 0
            for part in section.path.split("/")[:-1]:
                node = folders.setdefault((node, part), len(folders) + 1)
        written += _binary_size(section.text)
    return files + len(folders), written


_BINARY = re.compile(r"\nGIT binary patch\n(literal|delta) 0*(\d*)\n")


def _binary_size(text: str) -> int:
    """The size of the file a section's binary hunk writes: a ``literal`` block says it; a
    ``delta`` block (a few copy instructions can make gigabytes of a base) holds it at the
    start of its compressed data, after the base's size."""
    found = _BINARY.search(text)
    if found is None:
        return 0
    if len(found[2]) > 18:  # git reads the size with strtoul: zeros before it count nothing
        return MAX_BINARY_BYTES + 1
    if found[1] == "literal":
        return int(found[2] or 0)
    data = bytearray()
    for line in text[found.end() :].split("\n", 8)[:8]:
        if not line:
            break
        width = ord(line[0]) - (ord("A") - 1 if line[0] <= "Z" else ord("a") - 27)
        try:
            data += base64.b85decode(line[1:])[:width]
        except ValueError:
            break
    try:
        head = zlib.decompressobj().decompress(bytes(data), 32)
    except zlib.error:
        return MAX_BINARY_BYTES + 1  # git cannot apply it either
    sizes, value, shift = [], 0, 0
    for byte in head:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            sizes.append(value)
            value = shift = 0
            if len(sizes) == 2:
                return sizes[1]
    return MAX_BINARY_BYTES + 1  # a delta whose sizes cannot be read: not applied here


#: One method's time to apply a patch: an 8 MiB patch whose hunks sit where their headers say
#: applies in seconds; one whose hunks git must search a long file for (round 19: 53,000 of
#: them, 220 s a method) fails here, and the next method is not tried.
APPLY_SECONDS = 30


def _attempts(path: str, *, fuzz: bool) -> list[tuple[str, list[str]]]:
    out = [
        ("git_apply", git("apply", "--whitespace=nowarn", path)),
        ("git_apply_3way", git("apply", "--3way", "--whitespace=nowarn", path)),
    ]
    if fuzz:
        # GNU patch follows symlinks, writes inside .git and reads non-git hunks its own way;
        # only the task's own test_patch (trusted text) may need it.
        out.append(("patch_fuzz", ["patch", "--batch", "--forward", "--fuzz=5", "-p1", "-i", path]))
    return out


async def _snapshot(sandbox: Sandbox, restore: bool) -> None:
    """The judged tree saved (or put back) byte for byte, .git aside."""
    wd = sandbox.workdir
    if restore:
        cmd = (
            f"find {wd} -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {{}} + && "
            f"tar -C {wd} -xpf {SNAPSHOT}"
        )
    else:
        cmd = f"tar -C {wd} --exclude=./.git -cpf {SNAPSHOT} ."
    await _sh(sandbox, ["sh", "-c", cmd], "restoring the judged tree" if restore else "a snapshot")


async def _apply(sandbox: Sandbox, path: str, *, fuzz: bool) -> tuple[str | None, str]:
    """Try each method; between tries the tree goes back to the snapshot taken before the
    first one (``git apply`` itself changes nothing when it fails)."""
    errors = []
    snapped = False
    for method, argv in _attempts(path, fuzz=fuzz):
        if snapped:
            await _snapshot(sandbox, restore=True)
        if method == "git_apply_3way":  # the index must see the tree's files as they are
            await sandbox.exec(git("update-index", "-q", "--refresh"), timeout=120)
        result = await sandbox.exec(argv, timeout=APPLY_SECONDS, cwd=sandbox.workdir)
        if result.exit_code == 0:
            return method, ""
        errors.append(f"{method}: {result.output.strip()[-300:]}")
        if result.timed_out or result.killed_by is not None:
            # The patch's own cost: the next method reads the same hunks.
            errors[-1] = f"{method}: stopped after {result.duration_s:.0f} s"
            if snapped:
                await _snapshot(sandbox, restore=True)
            break
        if not snapped:
            await _snapshot(sandbox, restore=False)
            snapped = True
    else:
        await _snapshot(sandbox, restore=True)
    return None, "; ".join(errors)


async def _legacy_apply(sandbox: Sandbox, path: str) -> tuple[str | None, str]:
    """The old way (``strict_patch`` off, a control): the repository's own git, hooks and all,
    fuzz included, and a cleanup that wipes everything between tries."""
    attempts = [
        ("git_apply", f"git apply --whitespace=nowarn {path}"),
        ("git_apply_3way", f"git apply --3way --whitespace=nowarn {path}"),
        ("patch_fuzz", f"patch --batch --forward --fuzz=5 -p1 -i {path}"),
    ]
    error = ""
    for method, cmd in attempts:
        result = await sandbox.exec(["sh", "-c", cmd], timeout=120, cwd=sandbox.workdir)
        if result.exit_code == 0:
            return method, ""
        error = result.output.strip()[-500:]
        await sandbox.exec(
            ["sh", "-c", "git checkout -q -- . && git clean -fdq"], timeout=120, cwd=sandbox.workdir
        )
    return None, error


def put_back(judged: Judged, defences_off: frozenset[str]) -> bool:
    """Whether the grader put back a change of the patch's, so that the tree it would grade is
    not the tree the patch makes: such a patch does not pass, and its tests need not run."""
    return bool(judged.reverted) and not defences_off & {"judge_tree", "put_back_fails"}


async def apply_model_patch(
    sandbox: Sandbox,
    task: Task,
    patch: str,
    *,
    defences_off: frozenset[str] = frozenset(),
    runners: frozenset[str] = frozenset(),
) -> Judged:
    """Apply the model's patch and judge the tree; see the module docstring."""
    strict = "strict_patch" not in defences_off
    judged = Judged()
    if "judge_tree" in defences_off:
        patch, dropped = sanitize(patch, task.test_patch)
        judged.reverted = [{"path": p, "reason": r, "action": "dropped"} for p, r in dropped]
    if strict:
        refused = await asyncio.to_thread(_refuse, patch)
        if refused:
            judged.refused, judged.error = refused
            judged.method = None
            return judged
    await prepare(
        sandbox,
        {"model.patch": patch, "test.patch": task.test_patch},
        neutral_git="neutral_git" not in defences_off,
    )
    if patch.strip():
        path = f"{GRADE_DIR}/model.patch"
        if strict:
            judged.method, judged.error = await _apply(sandbox, path, fuzz=False)
        else:
            judged.method, judged.error = await _legacy_apply(sandbox, path)
        if judged.method is None:
            return judged
    if "judge_tree" not in defences_off:
        whole = "put_back_fails" not in defences_off
        links = "mentions_through_links" not in defences_off
        await _judge_tree(sandbox, task, judged, runners, whole_tree=whole, links=links)
    else:
        judged.diff = patch
    return judged


async def _judge_tree(
    sandbox: Sandbox,
    task: Task,
    judged: Judged,
    runners: frozenset[str] = frozenset(),
    *,
    whole_tree: bool = True,
    links: bool = True,
) -> None:
    base = await _base_sha(sandbox)
    # The environment's own interpreter, isolated: it knows what the environment can import.
    found = await probe(
        sandbox,
        "survey",
        python=_python(),
        base=base,
        texts=sorted(PYTEST_SECTIONS),
        # No more text than the judge would parse crosses (round 55: thirty 1 MiB setup.cfg
        # files grew the judge by 400 MB); one it was not given is a changed configuration.
        text_bytes=CONFIG_BYTES,
        text_budget=CONFIG_BUDGET,
        extra_dirs=[GRADE_DIR],
        gitdir=[f"{sandbox.workdir}/.git", ORIG_GIT],
        diff_index=f"{GRADE_DIR}/judged.idx",
    )
    base_paths = set(found["base_paths"])
    after = (base_paths - {r["path"] for r in found["changes"] if r["after"] is None}) | {
        r["path"] for r in found["changes"] if r["after"] is not None
    }
    rules = functools.partial(
        judge,
        hidden={d.path for d in split_diff(task.test_patch)},
        names=set(found["names"]) - {"tree_probe"},
        roots=sorted({*import_roots(task, after), *runner_folders(runners, base_paths)}),
        base_paths=base_paths,
        runners=runners,
        whole_tree=whole_tree,
    )
    # off the event loop: the other trajectories' gradings go on meanwhile
    asked: set[str] = set()
    flagged = await asyncio.to_thread(functools.partial(rules, asked=asked), found["changes"])
    if asked and whole_tree and len(asked) <= MAX_ASKED:
        # New names that are no test's: refused only where a text the patch did not write
        # names them as an import (a runner can try only a name it knows: round 100's new
        # module `page_window.py` was refused beside round 64's `ipdb.py`).
        changed = [r["path"] for r in found["changes"]]
        mentioned = await _mentioned(sandbox, task, asked, base, changed, links=links)
        rules = functools.partial(rules, mentioned=mentioned)
        flagged = await asyncio.to_thread(rules, found["changes"])
    bad = [(p, why) for p, why in flagged if why != TEST_ADDED]
    judged.added_tests = [p for p, why in flagged if why == TEST_ADDED]
    rows = {r["path"]: r for r in found["changes"]}
    for path in found["odd"]:
        bad.append((path, "odd_file"))
        rows[path] = {"path": path, "before": None, "after": ["0", ""]}
    await _revert(sandbox, base, [(rows[p], why) for p, why in bad], judged)
    if found["gitdir_differ"]:
        wd = sandbox.workdir
        await _sh(
            sandbox,
            ["sh", "-c", f"rm -rf {wd}/.git && cp -a {ORIG_GIT} {wd}/.git"],
            "restoring .git",
        )
        judged.reverted += [
            {"path": f".git/{p}", "reason": "git_dir_touched", "action": "restored"}
            for p in found["gitdir_differ"]
        ]
    if not bad and not found["gitdir_differ"]:
        diff = found["diff"]  # nothing was reverted: the survey's diff is the tree's
    else:
        diff = await real_changes(sandbox, base)
    still = await asyncio.to_thread(rules, diff["changes"])
    left = [(p, why) for p, why in still if why != TEST_ADDED]
    if left or diff["odd"]:
        raise SandboxError(f"grading: reverting left rule-breaking paths: {left[:3]}")
    if diff.get("too_large"):
        judged.refused, judged.method = "patch_too_large", None
        judged.error = (
            f"the judged tree's patch is {diff['too_large']:,} bytes, past the {MAX_PATCH:,} a "
            "patch may have (a binary hunk is compressed; the tree it makes is judged as text)"
        )
        return
    judged.changed = diff["paths"]
    judged.diff = diff["patch"]


#: The most new module names a patch may add for `_mentioned` to look for; past it, every one
#: that is no test's is refused, as if each were named somewhere.
MAX_ASKED = 16


async def _mentioned(
    sandbox: Sandbox,
    task: Task,
    asked: set[str],
    base: str,
    changed: list[str],
    *,
    links: bool = True,
) -> set[str]:
    """The names of ``asked`` that code other than the patch's could import by name: named as
    an import in the environment's files, the repository's base files, the hidden tests or
    the task's test command and test ids (`tree_probe.mentions`). ``links`` off (a control
    only): the environment's symlinked files are not read, as before round 104."""
    names = sorted(asked)
    found = await probe(
        sandbox,
        "mentions",
        python=_python(),
        names=names,
        base=base,
        extra_dirs=[GRADE_DIR],
        changed=changed,
        links=links,
    )
    texts = "\n".join([task.test_patch, task.test_cmd, *task.FAIL_TO_PASS, *task.PASS_TO_PASS])
    return set(found["mentioned"]) | tree_probe.mentioned_in(names, texts.encode())


async def real_changes(sandbox: Sandbox, base: str | None = None) -> dict[str, Any]:
    """The grading tree against the base commit as it really is: ``paths`` (changed paths),
    ``patch`` (their binary-safe unified diff, made with no attributes or drivers) and
    ``changes`` (each path's mode and blob before and after). Needs ``prepare`` first."""
    base = base or await _base_sha(sandbox)
    return await probe(sandbox, "diff", base=base, index=f"{GRADE_DIR}/judged.idx")


async def _revert(
    sandbox: Sandbox, base: str, bad: list[tuple[dict[str, Any], str]], judged: Judged
) -> None:
    """Put each path back as it was at ``base``: added ones deleted (a nested .git folder
    whole), the others restored from the base commit."""
    wd = sandbox.workdir
    gone: list[str] = []
    restore: list[str] = []
    for row, why in bad:
        path = row["path"]
        parts = path.split("/")
        git_at = next((i for i, p in enumerate(parts) if p.casefold() == ".git"), None)
        if git_at is not None:
            gone.append("/".join(parts[: git_at + 1]))
        elif row["after"] is not None:
            gone.append(path)
        if row["before"] is not None:
            restore.append(path)
        action = "restored" if row["before"] is not None else "deleted"
        judged.reverted.append({"path": path, "reason": why, "action": action})
    # The paths go on stdin, NUL-separated: any number of them fits (as arguments, 6,000
    # added files overflowed the command line and failed an honest fix's grading).
    if gone:
        # Deepest first; each path is removed itself, never followed through a symlink.
        names = b"".join(
            f"{wd}/{p}".encode() + b"\0" for p in sorted(set(gone), key=len, reverse=True)
        )
        await _sh(sandbox, ["xargs", "-0", "rm", "-rf", "--"], "reverting added paths", stdin=names)
    if restore:
        listed = b"".join(p.encode() + b"\0" for p in restore)
        argv = git("checkout", "-f", base, "--pathspec-from-file=-", "--pathspec-file-nul")
        await _sh(sandbox, argv, "restoring paths", stdin=listed)


async def _base_sha(sandbox: Sandbox) -> str:
    sha = getattr(sandbox, "base_sha", None)
    if sha and sha != "HEAD":
        return str(sha)
    return (await _sh(sandbox, git("rev-parse", "HEAD"), "rev-parse")).strip()


def _python() -> str:
    return "$(command -v python || command -v python3)"


async def reset_hidden(sandbox: Sandbox, task: Task, *, legacy: bool = False) -> None:
    """The hidden test_patch's paths as at the base commit, whatever the patch did there."""
    hidden = [d.path for d in split_diff(task.test_patch)]
    if not hidden:
        return
    quoted = " ".join(shlex.quote(p) for p in hidden)
    if legacy:
        listing = await sandbox.exec(
            ["sh", "-c", f"git ls-files -- {quoted}"], timeout=60, cwd=sandbox.workdir
        )
        tracked = listing.output.split()
        if tracked:
            await sandbox.exec(
                ["git", "checkout", "-q", "HEAD", "--", *tracked], timeout=60, cwd=sandbox.workdir
            )
    else:
        base = await _base_sha(sandbox)
        out = await _sh(
            sandbox, git("ls-tree", "-r", "--name-only", "-z", base, "--", *hidden), "ls-tree"
        )
        tracked = [p for p in out.split("\0") if p]
        if tracked:
            await _sh(
                sandbox, git("checkout", "-f", base, "--", *tracked), "resetting hidden tests"
            )
    for path in hidden:
        if path not in tracked:
            await sandbox.exec(["rm", "-f", "--", path], timeout=30, cwd=sandbox.workdir)


async def apply_test_patch(
    sandbox: Sandbox, task: Task, *, defences_off: frozenset[str] = frozenset()
) -> tuple[str | None, str]:
    """Reset the hidden tests' paths, then apply the task's test_patch (git apply, 3-way, then
    fuzz: it is the task's own text), restoring the judged tree between tries."""
    legacy = "strict_patch" in defences_off
    if legacy or "judge_tree" in defences_off:  # else the judge has put them back already
        await reset_hidden(sandbox, task, legacy=legacy)
    if legacy:
        return await _legacy_apply(sandbox, f"{GRADE_DIR}/test.patch")
    return await _apply(sandbox, f"{GRADE_DIR}/test.patch", fuzz=True)
