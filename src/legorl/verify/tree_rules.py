"""The tree rules: which paths of a judged tree the patch may not change, decided on the tree
as the file system holds it (``tree_probe``'s survey), by pure functions over paths. ``judge``
names each rule-breaking path and its reason; ``tree.py`` puts those back and applies the rest.

    flagged = judge(changes, hidden=..., names=..., roots=..., base_paths=..., runners=...)
    # [("conftest.py", "runner_config_touched"), ("tests/test_fix.py", "test_added"), ...]
"""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import PurePosixPath
from typing import Any

from legorl.records import Task
from legorl.verify.patches import is_test_file

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
#: ``judge``'s reason for a new test file that breaks no rule: named, and kept in the tree.
TEST_ADDED = "test_added"
#: Config files where only the pytest sections are runner configuration.
PYTEST_SECTIONS = {"pyproject.toml", "setup.cfg"}
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")


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
        # pytest's reader keeps a key's case: ``FilterWarnings`` is no option of its (round 77)
        cfg.optionxform = str  # type: ignore[assignment,method-assign]
        cfg.read_string(text)
        # no pytest section is no configuration, as no file is (round 75)
        return {s: dict(cfg[s]) for s in cfg.sections() if s in ("tool:pytest", "pytest")} or None
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
    if name == "pyproject.toml" and (row["before"] is None) != (row["after"] is None):
        # pytest 8.1+ takes any pyproject.toml for its configuration file where no other is
        # found, pytest section or none: a new one moves the rootdir and the folder above
        # which no conftest.py loads (round 77)
        return True
    if before == after:
        return False
    if name == "setup.cfg" and not any(map(_names_pytest_section, (before, after))):
        # No reader finds pytest's section in a text with no header that could name it
        # (round 75: a new setup.cfg of ``[metadata]``; round 79: one whose extras list
        # ``test = pytest``, read as a runner's configuration).
        return False
    cost = len(before or "") + len(after or "")
    if cost > budget[0]:
        return True
    budget[0] -= cost
    if name == "setup.cfg" and (
        _headers(before) != _headers(after) or not all(map(_plain_header, _headers(after)))
    ):
        # pytest reads setup.cfg with its own ini parser, which ends a header where
        # configparser does not (round 21: ``[tool:pytest] #]`` is pytest's section and
        # configparser's ``tool:pytest] #``; round 76: ``[x #]`` ends no section for it,
        # so the keys below stay in ``[tool:pytest]``): a header added, removed or changed
        # in a text that names pytest is a change of the runner's configuration, whoever's
        # reading is right.
        return True
    return _pytest_sections(name, before) != _pytest_sections(name, after)


def _names_pytest_section(text: str | None) -> bool:
    """Whether some line of ``text``, split wherever any reader splits, may be a header naming
    pytest: ``pytest`` (case-folded) after a ``[``. A section name is text after the ``[`` of
    its own line, whatever the reader cuts before it (a byte-order mark, blanks)."""
    for line in (text or "").splitlines():
        _, bracket, rest = line.partition("[")
        if bracket and "pytest" in rest.casefold():
            return True
    return False


def _plain_header(line: str) -> bool:
    """A header both readers end where it ends: ``[name]`` with no ``#`` or ``;`` (pytest's
    reader cuts a comment first, then reads a line that no longer ends in ``]`` as the value
    above it: round 78, keys added below an existing ``[x #]`` stayed in ``[tool:pytest]``)."""
    return re.fullmatch(r"\[[^\[\]#;]*\]", line) is not None


def _headers(text: str | None) -> list[str]:
    """The lines of an ini text that any reader may take for a section header."""
    return [ln.strip() for ln in (text or "").splitlines() if ln.lstrip().startswith("[")]


def _module_name(rest: str, *, link: bool = False) -> str | None:
    """The top-level import name a path below an import root provides. ``link``: the path is a
    symlink, which stands for whatever it leads to, a folder too (round 66: ``tests/ipdb``,
    led to a package, was data by its name and a package to the import system)."""
    top, sep, _ = rest.partition("/")
    return _module_top(top, deeper=bool(sep), link=link)


def _module_top(top: str, *, deeper: bool, link: bool = False) -> str | None:
    """``_module_name`` of a path whose first part is ``top`` (``deeper``: more follow). A name
    need not be an identifier: the import system finds ``importlib.import_module("a-b")`` in
    ``a-b.py`` (round 103: the standard library loads ``_sysconfigdata_…-linux-gnu`` so); a
    folder's name with a dot in it is no top-level name (a dotted name is a submodule's)."""
    if deeper or (link and "." not in top):
        return top if top and "." not in top else None
    for suffix in MODULE_SUFFIXES:
        if top.endswith(suffix):
            stem = top[: -len(suffix)].split(".", 1)[0]
            return stem or None
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


def runner_folders(runners: frozenset[str], base_paths: set[str]) -> set[str]:
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
    mentioned: set[str] | None = None,
    asked: set[str] | None = None,
) -> list[tuple[str, str]]:
    """(path, reason) of each changed path that breaks a rule, decided on the real tree, and
    ``TEST_ADDED`` for a new test file that breaks none. ``whole_tree`` False: the rules as
    before round 61 (a new test file is "tests_touched", a ``.gitattributes`` breaks none).
    ``runners``: the scripts the task's test command runs (``tests/runtests.py``, ``bin/test``),
    runner configuration like conftest.py. The work is bounded by the rows, not by what they
    hold: configuration texts are parsed up to ``CONFIG_BUDGET``.

    A new module name that is no test's is refused where code other than the patch could try
    to import it (rounds 62 to 64: Django's runner tries ``import ipdb``). ``mentioned``: the
    names of ``asked`` that some text the patch did not write names as an import would
    (`mentions`); None: every name counts as mentioned. ``asked``: filled with the names the
    rules refused for that alone."""
    tops = {r: {_module_name(p[len(r) :]) for p in base_paths if p.startswith(r)} for r in roots}
    budget = [CONFIG_BUDGET]
    # What a new file's names must not meet (rounds 62 to 65): linear in the base tree.
    prefix_tops = _prefix_tops(base_paths) if whole_tree else {}
    taken = _taken(names, prefix_tops, hidden) if whole_tree else set()
    code = {r: _code_tops(rows, r) for r in roots}
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
                if not mod or mod in tops[root] or mod not in code[root]:
                    continue  # no new name, or a new folder of data (`_code_tops`)
                # A new top-level name on a folder the runner puts on sys.path. Grading's own
                # modules live in the ``legorl`` namespace. Since round 64 it must also be a
                # test's name, one no module has: a runner tries imports no environment has
                # (Django's ``import ipdb``), and a new root module of that name would run in
                # test runs alone.
                new = whole_tree and before is None
                shadows = mod in names or mod.startswith("legorl")
                if shadows or (new and (mod in taken or _unknown(mod, mentioned, asked))):
                    reason = "shadowing"
                    break
        if reason is None and before is None and is_test_file(path):
            # A new test (a reproduction, a test of the fix's own) that breaks no other rule
            # stays in the tree: the code under test sees the tree the patch makes. Unless it
            # makes a package, or adds a file for a name its folder has, or a runner that puts
            # one of its folders on sys.path (Django's puts tests/ first) would import it for
            # a module the environment or the repository has (round 62).
            inert = _inert(
                parts, taken, prefix_tops, base_paths, link=link, mentioned=mentioned, asked=asked
            )
            reason = TEST_ADDED if inert else "shadowing"
        if reason:
            out.append((path, reason))
    return out


def _code(parts: list[str], *, link: bool) -> bool:
    """Whether a path (its ``parts``) can be code an import runs: a symlink (whatever it leads
    to), or a module file by a suffix of any of its parts; anything else is data."""
    return link or any(p.endswith(MODULE_SUFFIXES) for p in parts)


def _code_tops(rows: list[dict[str, Any]], root: str) -> set[str | None]:
    """The top-level names below ``root`` that the changed paths give code to: a module file
    (by its name's suffix, at any depth) or a symlink. A new folder that holds neither is data
    (round 98: a fix with a new ``docs/`` of notes scored 0): the import system makes it an
    empty namespace package at most, which runs no code and never wins over a module of its
    name anywhere on the path (an import that failed may succeed as that empty package, which
    can break code, never carry a fix: round 108)."""
    out: set[str | None] = set()
    for row in rows:
        path, after = row["path"], row["after"]
        if after is None or not path.startswith(root):
            continue
        rest, link = path[len(root) :], after[0] == SYMLINK
        if _code(rest.split("/"), link=link):
            out.add(_module_name(rest, link=link))
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


def _unknown(mod: str, mentioned: set[str] | None, asked: set[str] | None) -> bool:
    """Whether a new name no environment, repository or hidden test has must be refused: not
    a test's name, and named somewhere a runner could try it from (``mentioned``: None, every
    name). Each name refused for that alone goes into ``asked``."""
    if _test_name(mod):
        return False
    if asked is not None:
        asked.add(mod)
    return mentioned is None or mod in mentioned


def _inert(
    parts: list[str],
    taken: set[str],
    prefix_tops: dict[str, set[str | None]],
    base_paths: set[str],
    *,
    link: bool = False,
    mentioned: set[str] | None = None,
    asked: set[str] | None = None,
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
    if not _code(parts, link=link):
        # data, in whatever folders and by whatever name (round 99: ``__init__.json``): no
        # import runs it (round 98, `_code_tops`)
        return True
    if parts[-1].split(".", 1)[0] == "__init__":
        return False
    if _module_name(parts[-1], link=link) and "/".join([*parts[:-1], "__init__.py"]) in base_paths:
        return False
    # Linear in the depth (round 75: joining the parts at each level cost a tree of 1,000 new
    # test files below 2,000 folders 75 s of the judge's CPU): below the first folder the
    # base tree lacks, no deeper one is in it either.
    prefix: str | None = ""
    for i, top in enumerate(parts):
        mod = _module_top(top, deeper=i < len(parts) - 1, link=link)
        here = prefix_tops.get(prefix, set()) if prefix is not None else set()
        if prefix is not None:
            prefix = f"{prefix}{top}/"
            prefix = prefix if prefix in prefix_tops else None
        if not mod or (mod in here and i < len(parts) - 1):
            continue  # no module, or a folder the tree has there already
        # A name new here, or a second file for a name its folder has (``test_x.so`` beside
        # ``test_x.py``: the import system tries extension modules first).
        if mod in here or mod in taken or _unknown(mod, mentioned, asked):
            return False
    return True
