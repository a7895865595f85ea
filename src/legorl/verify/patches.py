"""What of a model's patch may reach grading: file diffs to tests, test-runner configuration and
paths the hidden ``test_patch`` creates are dropped and named, everything else is kept.

    clean, dropped = sanitize(trajectory.patch, task.test_patch)
    # dropped: [("tests/test_geo.py", "tests_touched"), ("conftest.py", "runner_config_touched")]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

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


def split_diff(patch: str) -> list[FileDiff]:
    """The `diff --git` sections of a unified git diff, in order."""
    sections: list[FileDiff] = []
    current: list[str] = []
    paths: tuple[str, str] | None = None
    for line in patch.splitlines(keepends=True):
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
        any(part in _TEST_DIRS for part in p.parts[:-1])
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
