"""Patch text: the strict reader grading accepts, and the old header-level filter.

    sections = parse_strict(trajectory.patch)  # PatchError(line, flag, message) when refused
    clean, dropped = sanitize(trajectory.patch, task.test_patch)  # only with judge_tree off

``parse_strict`` accepts exactly a sequence of well-formed ``diff --git`` sections, each path
relative, without ``.``/``..`` parts and outside any ``.git``, whose header, ``---``/``+++``
lines and hunk counts agree: text that git and our reader could read differently never
reaches ``git apply``. What a patch may change is decided later, on the tree it produces
(``legorl.verify.tree``); ``sanitize`` is the old decision from headers, kept as the control.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

#: (A line number or count past 12 digits is no file's: refused as a bad header, never read
#: by ``int``, which raises past 4,300 digits.)
_HUNK = re.compile(r"^@@ -(\d{1,12})(?:,(\d{1,12}))? \+(\d{1,12})(?:,(\d{1,12}))? @@(?: .*)?$")
_MODE = r"(100644|100755|120000)"
_EXTENDED = [
    re.compile(p)
    for p in (
        rf"^old mode {_MODE}$",
        rf"^new mode {_MODE}$",
        rf"^deleted file mode {_MODE}$",
        rf"^new file mode {_MODE}$",
        r"^similarity index \d{1,3}%$",
        r"^dissimilarity index \d{1,3}%$",
        rf"^index [0-9a-f]{{7,64}}\.\.[0-9a-f]{{7,64}}(?: {_MODE})?$",
    )
]
#: An extended header line with a mode the reader does not apply (a submodule's 160000)
_OTHER_MODE = re.compile(r"^(?:(?:old|new|deleted file|new file) mode|index \S+) (\d{6})$")
_BASE85 = re.compile(r"^[A-Za-z][0-9A-Za-z!#$%&()*+;<=>?@^_`{|}~-]+$")
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


class PatchError(ValueError):
    """Patch text grading refuses: ``flag`` is ``malformed_patch`` or ``git_dir_touched``."""

    def __init__(self, line: int, message: str, flag: str = "malformed_patch") -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.flag = flag


_HEADER = re.compile(r"^diff --git a/(.*?) b/(.*)$")
_RUNNER_FILES = {
    "conftest.py",
    "pytest.ini",
    "tox.ini",
    "sitecustomize.py",
    "usercustomize.py",
    "noxfile.py",
    ".pytest.ini",
}
_CONFIG_WITH_PYTEST = {"setup.cfg", "pyproject.toml"}
_TEST_DIRS = {"test", "tests", "testing"}


@dataclass(slots=True, frozen=True)
class FileDiff:
    old_path: str
    new_path: str
    text: str  # the whole `diff --git` section, newline-terminated

    @property
    def path(self) -> str:
        return self.new_path if self.new_path != "/dev/null" else self.old_path

    @property
    def creates(self) -> bool:
        return "\nnew file mode" in self.text or "\n--- /dev/null" in self.text


def patch_lines(patch: str) -> list[str]:
    """``patch``'s lines, each with its ``\n``, split where git splits them: at ``\n`` only.
    (``str.splitlines`` also splits at form feeds, ``\r``, U+2028 and more, which a file's
    lines may hold: a correct patch was read as malformed, round 75.)"""
    lines = [line + "\n" for line in patch.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def split_diff(patch: str) -> list[FileDiff]:
    """The `diff --git` sections of a unified git diff, in order."""
    sections: list[FileDiff] = []
    current: list[str] = []
    paths: tuple[str, str] | None = None
    for line in patch_lines(patch):
        match = _HEADER.match(line.rstrip("\n"))
        if match:
            if paths is not None:
                sections.append(FileDiff(paths[0], paths[1], "".join(current)))
            paths, current = (match.group(1), match.group(2)), [line]
        elif paths is not None:
            current.append(line)
    if paths is not None:
        text = "".join(current)
        sections.append(FileDiff(paths[0], paths[1], text if text.endswith("\n") else text + "\n"))
    return sections


def is_test_file(path: str) -> bool:
    p = PurePosixPath(path)
    name = p.name
    return (
        any(part in _TEST_DIRS for part in p.parts)
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
    )


def runner_config_reason(diff: FileDiff) -> str | None:
    name = PurePosixPath(diff.path).name
    if name in _RUNNER_FILES or name.endswith(".pth"):
        return "runner_config_touched"
    if name in _CONFIG_WITH_PYTEST:
        changed = [
            ln
            for ln in diff.text.splitlines()
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
        ]
        context = diff.text
        if (
            any("pytest" in ln or "addopts" in ln for ln in changed)
            or "[tool.pytest" in context
            or "[tool:pytest]" in context
        ):
            return "runner_config_touched"
    return None


def sanitize(patch: str, test_patch: str) -> tuple[str, list[tuple[str, str]]]:
    """(the patch without forbidden file diffs, [(path, reason), …] of what was dropped)."""
    hidden = {d.path for d in split_diff(test_patch)}
    kept: list[str] = []
    dropped: list[tuple[str, str]] = []
    for diff in split_diff(patch):
        reason = None
        if diff.path in hidden or diff.old_path in hidden:
            reason = "test_patch_path_created" if diff.creates else "tests_touched"
        elif runner_config_reason(diff):
            reason = runner_config_reason(diff)
        elif is_test_file(diff.path) or is_test_file(diff.old_path):
            reason = "tests_touched"
        if reason:
            dropped.append((diff.path, reason))
        else:
            kept.append(diff.text)
    return "".join(kept), dropped


def _unquote(name: str, line: int) -> str:
    """A path as git writes it: plain, or C-quoted when it holds odd bytes."""
    if not name.startswith('"'):
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
            raise PatchError(line, f"control character in unquoted path {name!r}")
        return name
    if len(name) < 2 or not name.endswith('"'):
        raise PatchError(line, f"unterminated quoted path {name!r}")
    out = bytearray()
    body, i = name[1:-1], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            if ch == '"':
                raise PatchError(line, f"stray quote in path {name!r}")
            out += ch.encode()
            i += 1
            continue
        nxt = body[i + 1 : i + 2]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif re.fullmatch(r"[0-3][0-7]{2}", body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise PatchError(line, f"bad escape in path {name!r}")
    try:
        return out.decode()
    except UnicodeDecodeError:
        raise PatchError(line, f"path {name!r} is not UTF-8") from None


#: The longest path below the tree a patch may name (bytes): the kernel's limit, less one.
PATH_BYTES = 4095


def check_path(path: str, line: int) -> str:
    """``path`` if grading may let a patch write it: relative, no empty, ``.`` or ``..`` part,
    nothing under a ``.git`` (in any case)."""
    if not path or path.startswith("/") or "\0" in path:
        raise PatchError(line, f"path {path!r} is not relative")
    parts = path.split("/")
    if any(p.casefold() == ".git" for p in parts):
        raise PatchError(line, f"path {path!r} is inside a .git folder", "git_dir_touched")
    if any(p in ("", ".", "..") for p in parts):
        raise PatchError(line, f"path {path!r} has an empty, '.' or '..' part")
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > PATH_BYTES or any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
        # no file system makes it (git would fail to write it), and each of its folders costs
        # the count of what the patch adds (round 77)
        raise PatchError(line, f"path of {size:,} bytes is longer than a file system allows")
    return path


def _side(name: str, prefix: str, line: int) -> str | None:
    """The path of a ``---``/``+++`` name (None for /dev/null); git ends a name that holds
    a space with a tab."""
    name = _unquote(name[:-1] if name.endswith("\t") else name, line)
    if name == "/dev/null":
        return None
    if not name.startswith(prefix):
        raise PatchError(line, f"{name!r} does not start with {prefix!r}")
    return check_path(name[len(prefix) :], line)


def _closing_quote(text: str) -> int:
    """The index of the quote that ends the C-quoted name ``text`` starts with, or -1: escapes
    are read in pairs (round 98: ``"a/trail\\\\"``, a name ending in a backslash, ends at its
    last quote)."""
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i
        else:
            i += 1
    return -1


def _header_paths(rest: str, line: int) -> tuple[str, str] | None:
    """(old, new) from ``a/OLD b/NEW`` when that is unambiguous, else None (paths with spaces:
    then the other lines must name them)."""
    if not rest.strip():
        raise PatchError(line, "a 'diff --git' header without paths")
    if rest.startswith('"'):
        end = _closing_quote(rest)
        if end < 0:
            raise PatchError(line, "unterminated quoted path in the header")
        if rest[end + 1 : end + 2] != " ":
            raise PatchError(line, "no space after the header's quoted path")
        old, new = rest[: end + 1], rest[end + 2 :]
    elif rest.count(" b/") == 1:
        old, _, new = rest.partition(" b/")
        new = "b/" + new
    elif rest.count(" ") == 1:
        old, _, new = rest.partition(" ")
    else:
        half = (len(rest) - 1) // 2
        old, new = rest[:half], rest[half + 1 :]
        if rest[half] != " " or old[2:] != new[2:]:
            return None
    # Each name unquoted once (round 98: a quoted name was read again as a plain one, so the
    # tab git had escaped in it was refused as a control character).
    old, new = _unquote(old, line), _unquote(new, line)
    if not old.startswith("a/") or not new.startswith("b/"):
        raise PatchError(line, "the header's paths must start with a/ and b/")
    return check_path(old[2:], line), check_path(new[2:], line)


def parse_strict(patch: str) -> list[FileDiff]:
    """The sections of ``patch`` if it is exactly well-formed ``diff --git`` sections; else
    ``PatchError`` naming the line."""
    lines = patch_lines(patch)
    sections: list[FileDiff] = []
    i = 0
    while i < len(lines):
        start = i
        head = lines[i].rstrip("\n")
        if not head.startswith("diff --git "):
            raise PatchError(i + 1, f"expected a 'diff --git' header, found {head[:60]!r}")
        named = _header_paths(head[len("diff --git ") :], i + 1)
        i += 1
        renames: dict[str, str] = {}
        creates = deletes = False
        while i < len(lines):
            text = lines[i].rstrip("\n")
            key = next((k for k in ("rename from ", "rename to ", "copy from ", "copy to ")
                        if text.startswith(k)), None)  # fmt: skip
            if key:
                renames[key.strip()] = check_path(_unquote(text[len(key) :], i + 1), i + 1)
            elif any(p.match(text) for p in _EXTENDED):
                creates |= text.startswith("new file mode")
                deletes |= text.startswith("deleted file mode")
            elif other := _OTHER_MODE.match(text):
                what = "a submodule" if other[1] == "160000" else "no file's mode"
                raise PatchError(
                    i + 1,
                    f"mode {other[1]} is {what}: a patch may hold only 100644, 100755, 120000",
                )
            else:
                break
            i += 1
        old = renames.get("rename from") or renames.get("copy from")
        new = renames.get("rename to") or renames.get("copy to")
        text = lines[i].rstrip("\n") if i < len(lines) else ""
        if text.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(i + 2, "a '---' line without its '+++' line")
            minus = _side(text[4:], "a/", i + 1)
            plus = _side(lines[i + 1].rstrip("\n")[4:], "b/", i + 2)
            if (minus is None) != creates or (plus is None) != deletes:
                raise PatchError(i + 1, "'/dev/null' does not agree with the file mode lines")
            old, new = minus or old or plus, plus or new or minus
            i = _hunks(lines, i + 2)
        elif text == "GIT binary patch":
            i = _binary(lines, i + 1)
        elif text.startswith("Binary files "):
            i += 1
        if named is not None:
            if (old or named[0]) != named[0] or (new or named[1]) != named[1]:
                raise PatchError(start + 1, "the header names other paths than the section")
            old, new = named
        if old is None or new is None:
            raise PatchError(start + 1, "cannot tell which file the section changes")
        body = "".join(lines[start:i])
        sections.append(FileDiff(old, new if not deletes else "/dev/null", body))
    return sections


def _hunks(lines: list[str], i: int) -> int:
    """Past the hunks starting at ``i``, each with exactly the lines its header counts."""
    seen = 0
    while i < len(lines) and lines[i].startswith("@@"):
        match = _HUNK.match(lines[i].rstrip("\n"))
        if not match:
            raise PatchError(i + 1, f"bad hunk header {lines[i].rstrip()[:60]!r}")
        old = int(match.group(2) if match.group(2) is not None else 1)
        new = int(match.group(4) if match.group(4) is not None else 1)
        i += 1
        last = ""
        while old > 0 or new > 0:
            if i >= len(lines):
                raise PatchError(i, "the patch ends inside a hunk")
            tag = lines[i][:1]
            if tag == " ":
                old, new = old - 1, new - 1
            elif tag == "-":
                old -= 1
            elif tag == "+":
                new -= 1
            elif tag == "\\" and last:
                pass
            else:
                raise PatchError(i + 1, f"a line that is not part of the hunk: {lines[i][:60]!r}")
            if old < 0 or new < 0:
                raise PatchError(i + 1, "more hunk lines than the hunk header counts")
            last = tag
            i += 1
        if i < len(lines) and lines[i].startswith("\\ "):
            i += 1
        seen += 1
    if not seen:
        raise PatchError(i + 1, "a '+++' line without a hunk")
    return i


def _binary(lines: list[str], i: int) -> int:
    """Past a ``GIT binary patch`` body: one or two literal/delta blocks, each ending blank."""
    for block in range(2):
        if i >= len(lines) or not re.fullmatch(r"(literal|delta) \d+", lines[i].rstrip("\n")):
            if block == 1:
                return i
            raise PatchError(i + 1, "a binary patch without its 'literal'/'delta' line")
        i += 1
        while i < len(lines) and lines[i].rstrip("\n"):
            if not _BASE85.match(lines[i].rstrip("\n")):
                raise PatchError(i + 1, "a bad line in a binary patch")
            i += 1
        if i >= len(lines):
            raise PatchError(i, "the patch ends inside a binary patch")
        i += 1
    return i
