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
import configparser
import functools
import json
import secrets
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from legorl.protocols import Sandbox, SandboxError
from legorl.records import Task
from legorl.sandbox import tree_probe
from legorl.sandbox.common import WORKDIR
from legorl.sandbox.tree_probe import PATCH_BYTES, clean_git
from legorl.verify.patches import PatchError, is_test_file, parse_strict, sanitize, split_diff

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

#: Files the interpreter or pytest runs by their name alone, wherever they are.
#: pytest reads ``pytest.toml`` and ``.pytest.toml`` since 9.0 (round 20: not reverted, its
#: ``python_functions`` reached the judged run).
RUNNER_FILES = {
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "pytest.toml",
    ".pytest.toml",
    "tox.ini",
    "noxfile.py",
}
SITE_HOOKS = {"sitecustomize", "usercustomize"}
SYMLINK = "120000"  # git's mode of a symlink, as the tree probe reports it
#: The patch phase's switches (``VerifyConfig.defences_off``), for the red team's controls.
DEFENCES = frozenset({"judge_tree", "strict_patch", "neutral_git", "put_back_fails"})
#: ``judge``'s reason for a new test file that breaks no rule: named, and kept in the tree.
TEST_ADDED = "test_added"
#: Config files where only the pytest sections are runner configuration.
PYTEST_SECTIONS = {"pyproject.toml", "setup.cfg"}
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")


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


#: What a runner configuration may be for the judge to parse it (`_pytest_sections`).
CONFIG_BYTES = 64 * 1024
CONFIG_LINE = 1024
#: The most runner-configuration text the judge parses for one tree, before and after texts
#: together (bytes; about two seconds of the parsers' worst case). Past it a changed
#: pyproject.toml / setup.cfg is a changed configuration, unread: a fix changes one or two.
CONFIG_BUDGET = 256 * 1024


def _pytest_sections(name: str, text: str | None) -> Any:
    """The pytest configuration a pyproject.toml / setup.cfg holds (the raw text when it does
    not parse: pytest may still read it another way). A text past ``CONFIG_BYTES`` or with a
    line past ``CONFIG_LINE`` characters is not parsed (the parsers' time grows faster than
    the text there): it stays text too."""
    if text is None:
        return None
    if len(text) > CONFIG_BYTES or any(len(line) > CONFIG_LINE for line in text.splitlines()):
        return text
    if text.splitlines() != text.split("\n")[: len(text.splitlines())] or "\r" in text:
        # A line break configparser does not split on (a form feed, U+2028, a carriage
        # return) and pytest's ini reader does (round 22: ``# x\fpythonpath = etc`` was a
        # comment to one and a key to the other): the text, unparsed.
        return text
    try:
        if name == "pyproject.toml":
            tool = tomllib.loads(text).get("tool", {})
            return tool.get("pytest") if isinstance(tool, dict) else tool
        cfg = configparser.RawConfigParser()
        cfg.read_string(text)
        return {s: dict(cfg[s]) for s in cfg.sections() if s in ("tool:pytest", "pytest")}
    except (tomllib.TOMLDecodeError, configparser.Error, RecursionError, ValueError):
        return text


def _config_changed(name: str, row: dict[str, Any], budget: list[int]) -> bool:
    """Whether the pytest configuration of a changed pyproject.toml / setup.cfg changed, its
    texts parsed from ``budget`` (bytes left, spent here); past it, unread, it did."""
    before, after = row.get("before_text"), row.get("after_text")
    if (row["after"] is not None and after is None) or (
        row["before"] is not None and before is None
    ):
        # not a text the judge reads (a symlink, round 22): pytest still reads what it leads to
        return True
    if before == after:
        return False
    cost = len(before or "") + len(after or "")
    if cost > budget[0]:
        return True
    budget[0] -= cost
    if name == "setup.cfg" and _headers(before) != _headers(after):
        # pytest reads setup.cfg with its own ini parser, which ends a header where
        # configparser does not (round 21: ``[tool:pytest] #]`` is pytest's section and
        # configparser's ``tool:pytest] #``): a section header added, removed or changed is a
        # change of the runner's configuration, whoever's reading is right.
        return True
    return _pytest_sections(name, before) != _pytest_sections(name, after)


def _headers(text: str | None) -> list[str]:
    """The lines of an ini text that any reader may take for a section header."""
    return [ln.strip() for ln in (text or "").splitlines() if ln.lstrip().startswith("[")]


def _module_name(rest: str, *, link: bool = False) -> str | None:
    """The top-level import name a path below an import root provides. ``link``: the path is a
    symlink, which stands for whatever it leads to, a folder too (round 66: ``tests/ipdb``,
    led to a package, was data by its name and a package to the import system)."""
    top, sep, _ = rest.partition("/")
    if sep or (link and top.isidentifier()):
        return top if top.isidentifier() else None
    for suffix in MODULE_SUFFIXES:
        if top.endswith(suffix):
            stem = top[: -len(suffix)].split(".", 1)[0]
            return stem if stem.isidentifier() else None
    return None


def import_roots(task: Task, paths: set[str]) -> list[str]:
    """Folders the runner puts on sys.path: the repository root, ``src/``, and the rootdir of
    each test file under pytest's default import mode (its first folder without __init__.py)."""
    roots = {"", "src/"}
    for test in task.FAIL_TO_PASS + task.PASS_TO_PASS:
        folder = PurePosixPath(test.split("::", 1)[0]).parent
        while str(folder) != "." and f"{folder}/__init__.py" in paths:
            folder = folder.parent
        roots.add("" if str(folder) == "." else f"{folder}/")
    return sorted(roots)


def _runner_folders(runners: frozenset[str], base_paths: set[str]) -> set[str]:
    """The folders of the scripts a task's command runs, which Python puts first on sys.path
    (Django's ``tests/runtests.py``: ``tests/``). A runner in a package's folder is library
    code the script imports (sympy's ``sympy/testing/runtests.py``), its folder no path entry."""
    out = set()
    for script in runners:
        folder = str(PurePosixPath(script).parent)
        prefix = "" if folder == "." else f"{folder}/"
        if f"{prefix}__init__.py" not in base_paths:
            out.add(prefix)
    return out


def _runner_file(parts: list[str]) -> bool:
    """Run by name alone: conftest.py, pytest.ini…, a .pth, site hooks, and entry points in
    distribution metadata (how pytest finds plugins to autoload)."""
    name = parts[-1]
    # importlib.metadata finds a distribution's folder in any case (round 63, read).
    metadata = len(parts) > 1 and parts[-2].lower().endswith((".dist-info", ".egg-info"))
    return (
        name in RUNNER_FILES
        or name.endswith(".pth")
        or any(p.split(".", 1)[0] in SITE_HOOKS for p in parts)
        or (metadata and name.lower() == "entry_points.txt")
    )


def judge(
    rows: list[dict[str, Any]],
    *,
    hidden: set[str],
    names: set[str],
    roots: list[str],
    base_paths: set[str],
    runners: frozenset[str] = frozenset(),
    whole_tree: bool = True,
) -> list[tuple[str, str]]:
    """(path, reason) of each changed path that breaks a rule, decided on the real tree, and
    ``TEST_ADDED`` for a new test file that breaks none. ``whole_tree`` False: the rules as
    before round 61 (a new test file is "tests_touched", a ``.gitattributes`` breaks none).
    ``runners``: the scripts the task's test command runs (``tests/runtests.py``, ``bin/test``),
    runner configuration like conftest.py. The work is bounded by the rows, not by what they
    hold: configuration texts are parsed up to ``CONFIG_BUDGET``."""
    tops = {r: {_module_name(p[len(r) :]) for p in base_paths if p.startswith(r)} for r in roots}
    budget = [CONFIG_BUDGET]
    # What a new file's names must not meet (rounds 62 to 65): linear in the base tree.
    prefix_tops = _prefix_tops(base_paths) if whole_tree else {}
    taken = _taken(names, prefix_tops, hidden) if whole_tree else set()
    out = []
    for row in rows:
        path, before = row["path"], row["before"]
        parts = path.split("/")
        name = parts[-1]
        link = row["after"] is not None and row["after"][0] == SYMLINK
        reason = None
        if any(p.casefold() == ".git" for p in parts):
            reason = "git_dir_touched"
        elif name == ".gitattributes" and whole_tree:
            # How git writes files out (`ident`, `eol`, encodings) is no part of a fix, and the
            # grader's git reads no attributes: a tree whose code reads its own text would be
            # one thing here and another wherever git checks it out (round 61).
            reason = "git_attributes"
        elif path in hidden:
            reason = "test_patch_path_created" if before is None else "tests_touched"
        elif is_test_file(path) and (before is not None or not whole_tree):
            reason = "tests_touched"
        elif (
            path in runners
            or _runner_file(parts)
            or (link and _runner_file([*parts, "entry_points.txt"]))
            or (name in PYTEST_SECTIONS and _config_changed(name, row, budget))
        ):
            reason = "runner_config_touched"
        elif "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
            reason = "bytecode_added"
        elif row["after"] is not None:
            for root in roots:
                if not path.startswith(root):
                    continue
                mod = _module_name(path[len(root) :], link=link)
                if not mod or mod in tops[root]:
                    continue
                # A new top-level name on a folder the runner puts on sys.path. Grading's own
                # modules live in the ``legorl`` namespace. Since round 64 it must also be a
                # test's name, one no module has: a runner tries imports no environment has
                # (Django's ``import ipdb``), and a new root module of that name would run in
                # test runs alone.
                new = whole_tree and before is None
                shadows = mod in names or mod.startswith("legorl")
                if shadows or (new and (mod in taken or not _test_name(mod))):
                    reason = "shadowing"
                    break
        if reason is None and before is None and is_test_file(path):
            # A new test (a reproduction, a test of the fix's own) that breaks no other rule
            # stays in the tree: the code under test sees the tree the patch makes. Unless it
            # makes a package, or adds a file for a name its folder has, or a runner that puts
            # one of its folders on sys.path (Django's puts tests/ first) would import it for
            # a module the environment or the repository has (round 62).
            inert = _inert(parts, taken, prefix_tops, base_paths, link=link)
            reason = TEST_ADDED if inert else "shadowing"
        if reason:
            out.append((path, reason))
    return out


def _taken(names: set[str], prefix_tops: dict[str, set[str | None]], hidden: set[str]) -> set[str]:
    """Every module name the environment, the repository (``prefix_tops``) and the hidden
    tests have, at any depth: a test module imported by its name alone (pytest's default
    import modes) must not find a new file of that name first, on any path."""
    taken = set(names)
    for tops_there in (*prefix_tops.values(), *_prefix_tops(hidden).values()):
        taken.update(t for t in tops_there if t)
    return taken


def _prefix_tops(base_paths: set[str]) -> dict[str, set[str | None]]:
    """For each folder of the base tree, the top-level import names below it."""
    out: dict[str, set[str | None]] = {}
    for path in base_paths:
        parts = path.split("/")
        for i in range(len(parts)):
            prefix = "/".join(parts[:i]) + ("/" if i else "")
            out.setdefault(prefix, set()).add(_module_name("/".join(parts[i:])))
    return out


def _test_name(mod: str) -> bool:
    """A module named as pytest collects tests (``test_*``, ``*_test``)."""
    return mod.startswith("test_") or mod.endswith("_test")


def _inert(
    parts: list[str],
    taken: set[str],
    prefix_tops: dict[str, set[str | None]],
    base_paths: set[str],
    *,
    link: bool = False,
) -> bool:
    """Whether no import can take a new file for another module (``link``: a symlink, read as
    a folder of its name too). A runner may put any folder above it on sys.path (Django's puts
    tests/ first) and import any name there, one the environment has or one it only tries
    (``import ipdb``, round 63): from each folder above it, a top-level name the file adds must
    be a test's (``test_*``, ``*_test``) and none of ``taken`` (the environment's, the
    repository's and the hidden tests' module names). A file that is no module (data) adds
    none. No package's ``__init__`` is inert, nor a module in a package's folder: a framework
    imports a package's members by walking it, whatever their names (Django's template tag
    libraries, round 65)."""
    if parts[-1].split(".", 1)[0] == "__init__":
        return False
    if _module_name(parts[-1], link=link) and "/".join([*parts[:-1], "__init__.py"]) in base_paths:
        return False
    for i in range(len(parts)):
        prefix = "/".join(parts[:i]) + ("/" if i else "")
        mod = _module_name("/".join(parts[i:]), link=link)
        here = prefix_tops.get(prefix, set())
        if not mod or (mod in here and i < len(parts) - 1):
            continue  # no module, or a folder the tree has there already
        # A name new here, or a second file for a name its folder has (``test_x.so`` beside
        # ``test_x.py``: the import system tries extension modules first).
        if mod in here or not _test_name(mod) or mod in taken:
            return False
    return True


def _refuse(patch: str) -> tuple[str, str] | None:
    if len(patch) > MAX_PATCH:
        return "patch_too_large", (
            f"the patch text is refused: {len(patch):,} characters, past the "
            f"{MAX_PATCH:,} a patch may have"
        )
    try:
        parse_strict(patch)
    except PatchError as err:
        return err.flag, f"the patch text is refused: {err}"
    return None


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
        await _judge_tree(sandbox, task, judged, runners, whole_tree=whole)
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
        roots=sorted({*import_roots(task, after), *_runner_folders(runners, base_paths)}),
        base_paths=base_paths,
        runners=runners,
        whole_tree=whole_tree,
    )
    # off the event loop: the other trajectories' gradings go on meanwhile
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
