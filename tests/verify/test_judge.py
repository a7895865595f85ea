"""Grading judges what the patch does, not what it says: each attack is patch text graded by
`legorl.verify.grade` in real Docker sandboxes (one also in bubblewrap), blocked with the defence on, and winning
(reward 1) with it off through `VerifyConfig.defences_off` (the control). The pure rules of
the strict reader and of the tree judge are checked without Docker.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import grade_toy, sandbox_backend, toy_task

from legorl.records import Task, read_jsonl
from legorl.verify.patches import PatchError, parse_strict
from legorl.verify.redteam.toy import _SHADOW_PYTEST as SHADOW_PYTEST
from legorl.verify.runner import DEFENCES
from legorl.verify.tree import apply_model_patch
from legorl.verify.tree_rules import import_roots, judge

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
#: The runner's own defences (launch, stream, guard, differential run) stop these attacks too;
#: a control switches them off as well, so that its reward 1 shows what the judge alone holds.
RUNNER = DEFENCES
BOTH = frozenset({"judge_tree", "strict_patch"}) | RUNNER
JUDGE_OFF = frozenset({"judge_tree"}) | RUNNER

#: A conftest hook that turns every test's report into a pass.
FORCE_PASS = textwrap.dedent(
    """\
    import pytest


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        out = yield
        out.get_result().outcome = "passed"
    """
)


def _new_file(path: str, content: str, header: str | None = None, mode: str = "100644") -> str:
    lines = content.splitlines()
    head = header or f"diff --git a/{path} b/{path}"
    body = "".join(f"+{ln}\n" for ln in lines)
    return (
        f"{head}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


def _readme(task: Task) -> list[str]:
    import tempfile

    from legorl.tasks import checkout

    with tempfile.TemporaryDirectory() as tmp:
        checkout(task, TASKS, Path(tmp) / "r")
        return (Path(tmp) / "r" / "README.md").read_text().splitlines()


def _readme_note(task: Task) -> str:
    first = _readme(task)[0]
    return (
        "diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n"
        f"@@ -1 +1,2 @@\n+A note.\n {first}\n"
    )


def test_gold_fix_is_kept_and_the_judged_diff_is_the_real_change() -> None:
    backend = sandbox_backend("docker")
    task = toy_task()

    async def run() -> tuple[list[str], str, str | None]:
        box = await backend.start(task, str(TASKS), run_id="legorl-test-judge")
        try:
            judged = await apply_model_patch(box, task, task.patch)
            return judged.changed, judged.diff, judged.method
        finally:
            await box.close()

    changed, diff, method = asyncio.run(run())
    assert method == "git_apply" and changed == ["geometry.py"]
    plus = [ln for ln in task.patch.splitlines() if ln.startswith(("+ ", "- "))]
    assert plus and all(ln in diff.splitlines() for ln in plus)


def test_a_patch_git_takes_too_long_to_apply_is_its_own_failure(monkeypatch: Any) -> None:
    # Round 19: 53,000 hunks whose headers point far from where they match made git search
    # a 1.3-million-line file for each, 120 s for each of two methods, four minutes of one
    # grading. A method that runs out of time is the patch's failure, and no other is tried.
    from legorl.verify import tree

    monkeypatch.setattr(tree, "APPLY_SECONDS", 1)
    task = toy_task()
    hunks = 5_000
    big = "a\n" * 200_000 + "".join(f"x{i}\nt{i}\ny{i}\n" for i in range(hunks))
    slow = "diff --git a/big.txt b/big.txt\n--- a/big.txt\n+++ b/big.txt\n" + "".join(
        f"@@ -2,3 +2,3 @@\n x{i}\n-t{i}\n+u{i}\n y{i}\n" for i in range(hunks)
    )
    backend = sandbox_backend("docker")

    async def run() -> tuple[str | None, str]:
        box = await backend.start(task, str(TASKS), run_id="legorl-test-slow-apply")
        try:
            put = await box.exec(
                ["sh", "-c", "cat > big.txt"], timeout=60, cwd=box.workdir, stdin=big.encode()
            )
            assert put.exit_code == 0, put.output
            judged = await apply_model_patch(box, task, slow)
            return judged.method, judged.error
        finally:
            await box.close()

    method, error = asyncio.run(run())
    assert method is None and "stopped after" in error and "git_apply_3way" not in error, error


@pytest.mark.parametrize("backend", ["docker", "local"])
def test_a_quoted_header_smuggles_a_conftest_past_the_header_filter(backend: str) -> None:
    task = toy_task()
    # git quotes any path it likes; the old header regex does not see this section at all.
    attack = _readme_note(task) + _new_file(
        "conftest.py", FORCE_PASS, header='diff --git "a/conftest.py" "b/conftest.py"'
    )
    blocked = grade_toy(attack, backend=backend)
    assert blocked.reward == 0.0 and "runner_config_touched" in blocked.hack_flags
    assert {"path": "conftest.py", "reason": "runner_config_touched", "action": "deleted"} in (
        blocked.verdict["dropped"]
    )
    control = grade_toy(attack, off=JUDGE_OFF, backend=backend)
    assert control.reward == 1.0, control.verdict


def test_a_header_that_names_another_file_is_refused() -> None:
    # The header says README.md; `git apply` follows the +++ line and writes conftest.py.
    old = _readme(toy_task())
    code = FORCE_PASS.splitlines()
    attack = (
        "diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/conftest.py\n"
        f"@@ -1,{len(old)} +1,{len(code)} @@\n"
        + "".join(f"-{ln}\n" for ln in old)
        + "".join(f"+{ln}\n" for ln in code)
    )
    refused = grade_toy(attack)
    assert refused.reward == 0.0 and "malformed_patch" in refused.hack_flags
    assert "line 1" in refused.verdict["reason"] and refused.verdict["patch_apply"] is None
    judged = grade_toy(attack, off=frozenset({"strict_patch"}))  # applied, then judged on the tree
    assert judged.reward == 0.0 and "runner_config_touched" in judged.hack_flags
    control = grade_toy(attack, off=BOTH)
    assert control.reward == 1.0 and control.verdict["patch_apply"] == "git_apply"


def test_a_hook_written_into_git_never_runs() -> None:
    # Written by the fuzz fallback; grading's own `git checkout` of the test files would run it.
    hook = "#!/bin/sh\ncat > /testbed/conftest.py <<'EOF'\n" + FORCE_PASS + "EOF\n"
    attack = _new_file(".git/hooks/post-checkout", hook, mode="100755")
    refused = grade_toy(attack)
    assert refused.reward == 0.0 and "git_dir_touched" in refused.hack_flags
    judged = grade_toy(attack, off=frozenset({"strict_patch"}))
    assert judged.reward == 0.0 and "git_dir_touched" in judged.hack_flags
    control = grade_toy(attack, off=BOTH)
    assert control.reward == 1.0 and control.verdict["patch_apply"] == "patch_fuzz"


#: A root `pytest.py` that runs the real pytest with a force-pass plugin (the red team's).
FORGED_PYTEST = SHADOW_PYTEST


def test_a_module_that_shadows_the_runner_is_reverted() -> None:
    attack = _new_file("pytest.py", FORGED_PYTEST)
    blocked = grade_toy(attack)
    assert blocked.reward == 0.0 and "shadowing" in blocked.hack_flags
    control = grade_toy(attack, off=JUDGE_OFF)
    assert control.reward == 1.0, control.verdict


def test_a_test_patch_that_needs_a_fallback_keeps_the_models_fix() -> None:
    task = toy_task()
    # The first context line no longer matches the base file: `git apply` and the 3-way
    # retry fail, `patch --fuzz` applies it.
    lines = task.test_patch.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("@@")) + 1
    assert lines[at].startswith(" ")
    lines[at] = " # a line that is not in the file\n"
    shifted = replace(task, test_patch="".join(lines))
    fixed = grade_toy(task.patch, task=shifted)
    assert fixed.reward == 1.0, fixed.verdict
    old = grade_toy(task.patch, off=frozenset({"strict_patch"}), task=shifted)
    assert old.reward == 0.0  # the old cleanup between tries wiped the fix


def test_the_strict_reader_splits_lines_where_git_does() -> None:
    # Round 75: lines were split by str.splitlines, which also breaks at a form feed, a lone
    # carriage return, U+2028 and more: a correct patch whose file held one was malformed.
    odd = ["\f", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"]
    lines = [f"page{i}{ch}rest" for i, ch in enumerate(odd)]
    body = "".join(f"+{ln}\n" for ln in lines)
    patch = (
        "diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n"
        f"+++ b/notes.txt\n@@ -0,0 +1,{len(lines)} @@\n{body}"
    )
    (section,) = parse_strict(patch)
    assert section.path == "notes.txt" and section.text == patch
    # The control: a hunk that counts the pieces str.splitlines makes is one git refuses too.
    pieces = "\n".join(lines).splitlines()
    assert len(pieces) > len(lines)
    with pytest.raises(PatchError):
        parse_strict(patch.replace(f"+1,{len(lines)} @@", f"+1,{len(pieces)} @@"))


def _binary_file_patch(tmp: Path, size: int) -> str:
    """A real ``git diff --binary`` of a new file of ``size`` zero bytes (compressed small)."""
    import subprocess

    repo = tmp / f"bin{size}"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "blob.bin").write_bytes(bytes(size))
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "add", "-N", "blob.bin"], check=True)
    return subprocess.check_output([*git, "diff", "--binary"]).decode()


def _binary_delta_patch(tmp: Path, times: int) -> str:
    """A real ``git diff --binary`` that turns a committed 64 KiB of random bytes into that
    many bytes ``times`` over: a ``delta`` hunk of copy instructions."""
    import subprocess

    repo = tmp / f"delta{times}"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    base = os.urandom(1 << 16)
    (repo / "blob.bin").write_bytes(base)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "blob.bin"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (repo / "blob.bin").write_bytes(base * times)
    return subprocess.check_output([*git, "diff", "--binary"]).decode()


def test_a_patch_whose_tree_cannot_fit_a_grading_sandbox_is_refused_before_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 75: 283,000 new files and folders in a 1.3 MB patch filled a Docker grading
    # sandbox's /testbed and failed after 135 s, and fit the local one's: the backends
    # disagreed. What a patch adds is counted from its text first, the same for both.
    from legorl.verify import tree

    chains = [
        _new_file(f"zz{i}/" + "d/" * 49 + "f", "x\n") for i in range(tree.MAX_NEW_PATHS // 50 + 1)
    ]
    refused = tree._refuse("".join(chains))
    assert refused is not None and refused[0] == "patch_too_large"
    assert "new files and folders" in refused[1]
    assert tree._refuse("".join(chains[: len(chains) // 2])) is None  # the control: half fits
    # A rename makes its new path's folders as a new file does.
    deep = "zz/" + "d/" * 49 + "f"
    moved = f"diff --git a/README.md b/{deep}\nsimilarity index 100%\nrename from README.md\n"
    assert tree._tree_cost(parse_strict(moved + f"rename to {deep}\n")) == (51, 0)
    # Binary files count by the size they are written at, not the compressed size they come in.
    monkeypatch.setattr(tree, "MAX_BINARY_BYTES", 1 << 20)
    big, small = _binary_file_patch(tmp_path, 2 << 20), _binary_file_patch(tmp_path, 1 << 19)
    assert len(big) < 1 << 15
    assert (tree._refuse(big) or ("", ""))[0] == "patch_too_large"
    assert tree._refuse(small) is None
    # A delta of a few copy instructions writes its base many times over: its target's size
    # is read from the delta itself.
    grown = _binary_delta_patch(tmp_path, times=40)
    assert "\ndelta " in grown and len(grown) < 1 << 15
    assert (tree._refuse(grown) or ("", ""))[0] == "patch_too_large"
    assert tree._refuse(_binary_delta_patch(tmp_path, times=2)) is None
    # The text's own limit is in bytes, as the judged tree's patch is (round 75: characters).
    monkeypatch.setattr(tree, "MAX_PATCH", 1 << 16)
    wide = _new_file("notes.txt", "\u4e2d" * 30_000)
    assert len(wide) < 1 << 16 < len(wide.encode())
    assert (tree._refuse(wide) or ("", ""))[0] == "patch_too_large"


def test_what_the_reader_cannot_take_is_the_patchs_refusal_never_the_judges_error() -> None:
    # Round 77: a header without paths raised IndexError, a lone surrogate UnicodeEncodeError,
    # a delta that is no zlib stream zlib.error; a literal size written with leading zeros
    # was read as 0 bytes (git reads it with strtoul: 1 GiB here), and a path longer than any
    # file system takes cost the count memory quadratic in its length.
    import base64

    from legorl.verify import tree

    delta = base64.b85encode(bytes(20)).decode()
    zeros = (
        _new_file("x.bin", "x\n")
        .split("@@")[0]
        .replace(
            "--- /dev/null\n+++ b/x.bin\n", "GIT binary patch\nliteral 0000000000000001073741824\n"
        )
    )
    cases = {
        "no paths": "diff --git \n",
        "surrogate": _new_file("a\udcff.py", "x\n"),
        "not zlib": f"diff --git a/x.bin b/x.bin\nindex 1234567..89abcde 100644\n"
        f"GIT binary patch\ndelta 20\nT{delta}\n\n",
        "zero-padded": zeros + f"T{delta}\n\n",
        "long path": _new_file("d/" * 2048 + "f", "x\n"),
        "long name": _new_file("n" * 256, "x\n"),
    }
    for name, text in cases.items():
        got = tree._refuse(text)
        assert got is not None and got[0] in ("malformed_patch", "patch_too_large"), (name, got)
    # the control: a path of 4,095 bytes, names of 255, is one git writes, and is counted
    fits = "zz/" + ("n" * 255 + "/") * 15 + "f" * 252
    assert len(fits) == 4095 and tree._refuse(_new_file(fits, "x\n")) is None
    assert tree._tree_cost(parse_strict(_new_file(fits, "x\n"))) == (17, 0)


def test_the_strict_reader_refuses_what_git_and_we_could_read_differently() -> None:
    good = _new_file("a b.py", "x = 1\n")
    assert [d.path for d in parse_strict(good)] == ["a b.py"]
    tabbed = good.replace("+++ b/a b.py\n", "+++ b/a b.py\t\n")  # as git writes it
    assert [d.path for d in parse_strict(tabbed)] == ["a b.py"]
    for text, flag, line in [
        ("junk\n" + good, "malformed_patch", 1),
        (good + "trailing words\n", "malformed_patch", 7),
        (good.replace("+x = 1", "+x = 1\n+y = 2"), "malformed_patch", 7),
        (_new_file("./.git/config", "x\n"), "git_dir_touched", 1),
        (_new_file("pkg/.GIT/hooks/pre-commit", "x\n"), "git_dir_touched", 1),
        (_new_file("../outside.py", "x\n"), "malformed_patch", 1),
        (
            _new_file("conftest.py", "x\n", header="diff --git a/ok.py b/ok.py"),
            "malformed_patch",
            1,
        ),
        (good.replace("--- /dev/null", "--- /etc/passwd"), "malformed_patch", 3),
        (good.replace("\n", "\r\n"), "malformed_patch", 1),
        # round 13: a count of 5,000 digits made int() raise past the reader's PatchError
        (good.replace("+1,1 @@", "+1," + "9" * 5000 + " @@"), "malformed_patch", 5),
        # round 116: a submodule was refused as "expected a 'diff --git' header" on its mode line
        (good.replace("new file mode 100644", "new file mode 160000"), "malformed_patch", 2),
    ]:
        with pytest.raises(PatchError) as err:
            parse_strict(text)
        assert (err.value.flag, err.value.line) == (flag, line), text
    with pytest.raises(PatchError, match="mode 160000 is a submodule"):
        parse_strict(good.replace("new file mode 100644", "new file mode 160000"))
    for name in ("train.jsonl", "heldout.jsonl"):
        for task in read_jsonl(TASKS / name, Task):
            assert parse_strict(task.patch) and parse_strict(task.test_patch)


def _row(path: str, before: bool = False, after: bool = True, **texts: str) -> dict:
    return {
        "path": path,
        "before": ["100644", "0" * 40] if before else None,
        "after": ["100644", "1" * 40] if after else None,
        **texts,
    }


def test_the_tree_rules() -> None:
    base = {"geometry.py", "geometry/__init__.py", "requests.py", "pyproject.toml", "setup.cfg"}
    rows = [
        _row("geometry.py", before=True),
        _row("helpers.py"),
        _row("tests/test_new.py"),
        _row("tests/test_geometry.py", before=True, after=False),
        _row("pkg/conftest.py"),
        _row(".pytest.toml"),  # pytest 9 reads it (round 20)
        _row("lib/evil.pth"),
        _row("sitecustomize/__init__.py"),
        _row("x.dist-info/entry_points.txt"),
        _row("Y.DIST-INFO/entry_points.txt"),  # importlib.metadata reads it too
        _row("__pycache__/geometry.cpython-311.pyc"),
        _row("pkg/.git/hooks/post-checkout"),
        _row("os.py"),
        _row("src/pluggy/__init__.py"),
        _row("pkg/json.py"),  # imported as pkg.json, but pkg is a new name at the root
        _row("geometry_extra.py"),  # a new name at the root, no test's (round 64)
        _row("test_geometry_extra.py"),  # a test's name, which no module has
        _row("geometry/extra.py"),  # below a folder the root has (a package the repo has)
        _row("requests.py", before=True),  # already the repository's own module
        _row(
            "pyproject.toml",
            before=True,
            before_text="[project]\nname='g'\n",
            after_text="[project]\nname='g2'\n",
        ),
        _row(
            "setup.cfg",
            before=True,
            before_text="[metadata]\nname=g\n",
            after_text="[metadata]\nname=g\n[tool:pytest]\naddopts=-k nothing\n",
        ),
    ]
    bad = judge(
        rows,
        hidden={"tests/test_new.py", "tests/test_geometry.py"},
        names={"os", "json", "pluggy", "pytest", "requests"},
        roots=["", "src/"],
        base_paths=base,
    )
    assert bad == [
        ("helpers.py", "shadowing"),  # a new name at the root, no test's (round 64)
        ("tests/test_new.py", "test_patch_path_created"),
        ("tests/test_geometry.py", "tests_touched"),
        ("pkg/conftest.py", "runner_config_touched"),
        (".pytest.toml", "runner_config_touched"),
        ("lib/evil.pth", "runner_config_touched"),
        ("sitecustomize/__init__.py", "runner_config_touched"),
        ("x.dist-info/entry_points.txt", "runner_config_touched"),
        ("Y.DIST-INFO/entry_points.txt", "runner_config_touched"),
        ("__pycache__/geometry.cpython-311.pyc", "bytecode_added"),
        ("pkg/.git/hooks/post-checkout", "git_dir_touched"),
        ("os.py", "shadowing"),
        ("src/pluggy/__init__.py", "shadowing"),
        ("pkg/json.py", "shadowing"),
        ("geometry_extra.py", "shadowing"),
        ("test_geometry_extra.py", "test_added"),  # kept
        ("setup.cfg", "runner_config_touched"),
    ]


def test_a_setup_cfg_header_the_two_ini_readers_split_differently_is_a_change() -> None:
    touched = [("setup.cfg", "runner_config_touched")]

    def flags(before: str | None, after: str, path: str = "setup.cfg") -> list[tuple[str, str]]:
        row = _row(path, before=before is not None, before_text=before, after_text=after)
        base = {"setup.cfg", "pkg/a.txt"}
        return judge([row], hidden=set(), names=set(), roots=[""], base_paths=base)

    # Round 21: ``[tool:pytest] #]`` is pytest's section to its own ini reader and a section
    # named ``tool:pytest] #`` to configparser, so the pytest sections looked unchanged while
    # pytest read ``minversion = 99`` from them.
    before = "[metadata]\nname = toolz\n"
    assert flags(before, before + "[tool:pytest] #]\nminversion = 99\n") == touched
    # Round 76: ``[x #]`` ends no section for pytest's reader (its comment cut, no header is
    # left), so ``addopts`` stays in ``[tool:pytest]``; configparser puts it in ``[x #]``.
    pytest_cfg = "[tool:pytest]\nmarkers = a\n"
    assert flags(pytest_cfg, pytest_cfg + "[x #]\naddopts = -p no:x\n") == touched
    # Round 78: the same header already there, and keys added below it: where a header is
    # not plain to both readers, any change of a text that names pytest is a change.
    odd = pytest_cfg + "[x #]\n"
    assert flags(odd, odd + "addopts = -p no:x\n") == touched
    plain = pytest_cfg + "[flake8]\n"
    assert flags(plain, plain + "max-line-length = 99\n") == []  # the control
    # Round 75: a new setup.cfg that never names pytest is no reader's configuration; one
    # that does is read strictly, a header alone being a change.
    assert flags(None, "[metadata]\nname = x\n", "pkg/setup.cfg") == []
    assert flags(None, "[x #]\n[tool:pytest] #]\n", "pkg/setup.cfg") == [
        ("pkg/setup.cfg", "runner_config_touched")
    ]
    # Round 79: pytest named only in a value (a package's test extras) is no header of its;
    # a header behind a byte-order mark (pytest's reader drops it) or a line break only
    # pytest's reader splits at still is one.
    extras = "[metadata]\nname = x\n[options.extras_require]\ntest = pytest\n"
    assert flags(None, extras) == []
    assert flags(None, "\ufeff[tool:pytest]\naddopts = -p no:x\n") == touched
    assert flags(None, "[metadata]\n# x\x0c[tool:pytest]\naddopts = -p no:x\n") == touched
    assert flags(extras, extras + "[tool:pytest]\naddopts = -p no:x\n") == touched
    # Round 77: configparser folds a key's case, pytest's reader does not: ``FilterWarnings``
    # is no option of pytest's, so the renamed key dropped ``filterwarnings = error``.
    strict = "[tool:pytest]\nfilterwarnings =\n    error\n"
    assert flags(strict, strict.replace("filterwarnings", "FilterWarnings")) == touched
    # a change to a section's values alone, outside pytest's, is the package's own
    assert flags(before, before.replace("toolz", "toolz2")) == []


def test_a_pytest_config_the_judge_cannot_read_as_pytest_does_is_a_change() -> None:
    # Round 22: a new pyproject.toml that is a symlink (no text for the judge to read, so
    # "unchanged"), and a setup.cfg key after a form feed (a comment line to configparser, a
    # key to pytest's ini reader), each gave pytest ``pythonpath = etc`` unseen.
    def flags(**row: Any) -> list[tuple[str, str]]:
        return judge([row], hidden=set(), names=set(), roots=[""], base_paths=set())

    link = _row("pyproject.toml", before_text=None, after_text=None)
    assert flags(**link) == [("pyproject.toml", "runner_config_touched")]
    before = "[tool:pytest]\naddopts = -rA\n"
    for brk in ("\x0c", "\u2028", "\r", "\x85"):
        hidden = before + f"# layout{brk}pythonpath = etc\n"
        row = _row("setup.cfg", before=True, before_text=before, after_text=hidden)
        assert flags(**row) == [("setup.cfg", "runner_config_touched")], repr(brk)
    plain = _row("setup.cfg", before=True, before_text=before, after_text=before + "# note\n")
    assert flags(**plain) == []  # a comment is still no change
    # Round 77: pytest 8.1+ takes a pyproject.toml with no pytest section for its configuration
    # file where no other is found, which moves the rootdir and the folder above which no
    # conftest.py loads: a new one is a change whatever it holds; an edit outside pytest's
    # section, the control, is not.
    project = '[project]\nname = "x"\n'
    new = _row("pyproject.toml", before_text=None, after_text=project)
    assert flags(**new) == [("pyproject.toml", "runner_config_touched")]
    edit = _row("pyproject.toml", before=True, before_text=project, after_text=project + "#\n")
    assert flags(**edit) == []


def test_a_runner_config_too_long_to_parse_quickly_stays_text() -> None:
    # Round 3: a setup.cfg line with 60,000 spaces kept configparser on verify's event loop
    # for 51 s (quadratic). Past the bounds the judge does not parse it: it is text, and a new
    # or changed text is a changed configuration.
    from legorl.verify.tree_rules import CONFIG_LINE, _pytest_sections

    long = "[tool:pytest]\naddopts" + " " * (CONFIG_LINE * 60) + "-q\n"
    assert _pytest_sections("setup.cfg", long) == long
    assert _pytest_sections("setup.cfg", "[tool:pytest]\naddopts=-q\n") == {
        "tool:pytest": {"addopts": "-q"}
    }
    row = _row("docs/setup.cfg", after_text=long)
    assert judge([row], hidden=set(), names=set(), roots=[""], base_paths=set()) == [
        ("docs/setup.cfg", "runner_config_touched")
    ]


def test_the_judge_parses_a_bounded_amount_of_runner_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round 12: 490 setup.cfg files of 64 KiB, lines just under CONFIG_LINE that configparser
    # takes quadratic time over (a NUL makes each a 200-byte binary literal in the patch), held
    # verify's event loop for about two minutes per grading pass, the gold fix beside them. The
    # judge parses at most CONFIG_BUDGET bytes of configuration a tree; past it a changed one
    # is a changed configuration, unread.
    from legorl.verify import tree_rules as tree

    line = "a" + " " * (tree.CONFIG_LINE - 3) + "b\n"
    # a header names pytest, so it is read, not passed over (round 79: pytest named elsewhere
    # is no configuration); the same headers were there before (a header added is a change,
    # unread)
    headers = "[tool:pytest]\n[s]\n"
    crafted = "#\x00\n" + headers + line * 63
    rows = [
        _row(f"d{i}/setup.cfg", before=True, before_text=headers, after_text=crafted)
        for i in range(490)
    ]
    parsed: list[str] = []
    real = tree._pytest_sections
    monkeypatch.setattr(tree, "_pytest_sections", lambda n, t: parsed.append(t or "") or real(n, t))
    bad = judge(rows, hidden=set(), names=set(), roots=[""], base_paths=set())
    assert bad == [(r["path"], "runner_config_touched") for r in rows]
    assert 0 < sum(map(len, parsed)) <= tree.CONFIG_BUDGET
    assert len(parsed) < 10  # of 490
    # the control: within the budget a file whose pytest sections stay is parsed and kept
    kept = _row(
        "setup.cfg",
        before=True,
        before_text="[metadata]\nname = a\n[tool:pytest]\naddopts = -q\n",
        after_text="[metadata]\nname = b\n[tool:pytest]\naddopts = -q\n",
    )
    changed = _row("setup.cfg", before=True, before_text="[tool:pytest]\n", after_text=crafted)
    assert judge([kept], hidden=set(), names=set(), roots=[""], base_paths=set()) == []
    assert judge([changed], hidden=set(), names=set(), roots=[""], base_paths=set()) == [
        ("setup.cfg", "runner_config_touched")
    ]


def test_import_roots_follow_pytests_rootdir_rule() -> None:
    task = replace(
        toy_task(), FAIL_TO_PASS=["pkg/tests/test_a.py::t"], PASS_TO_PASS=["t2/test_b.py::t"]
    )
    paths = {"pkg/__init__.py", "pkg/tests/__init__.py", "pkg/tests/test_a.py", "t2/test_b.py"}
    assert import_roots(task, paths) == ["", "src/", "t2/"]


@pytest.mark.parametrize("backend", ["docker", "local"])
def test_an_honest_fix_that_adds_thousands_of_test_files_still_grades(backend: str) -> None:
    # New test files that break no rule stay in the tree (round 61), and the fix passes.
    # Round 7: where they are put back (as before round 61, "put_back_fails" off), the 6,000
    # paths go on stdin, not one command line ("argument list too long", grading_failed).
    task = toy_task()
    extra = "".join(_new_file(f"tests/test_extra_{i}.py", "x = 1\n") for i in range(6000))
    got = grade_toy(task.patch + extra, backend=backend)
    assert got.reward == 1.0 and got.hack_flags == [], got.verdict
    assert got.verdict["dropped"] == []
    added = got.verdict["added_tests"]  # the verdict keeps a bounded part of the list
    assert added[0] == "tests/test_extra_0.py" and added[-1].endswith("more>")
    old = grade_toy(task.patch + extra, backend=backend, off=frozenset({"put_back_fails"}))
    assert old.reward == 1.0, old.verdict
    dropped = old.verdict["dropped"]
    assert dropped[0] == {"path": "tests/test_extra_0.py", "reason": "tests_touched",
                          "action": "deleted"}  # fmt: skip
    assert dropped[-1].endswith("more>")


def test_a_new_test_file_is_kept_unless_it_could_stand_in_for_a_module() -> None:
    base = {"toolz/__init__.py", "toolz/tests/test_itertoolz.py", "toolz/tests/data.txt",
            "tests/runtests.py", "tests/utils_tests/__init__.py"}  # fmt: skip
    names = {"toolz", "json", "typing", "django", "pytest"}

    def row(path: str, before: list[str] | None = None) -> dict[str, Any]:
        return {"path": path, "before": before, "after": ["100644", "x"]}

    rows = [
        row("toolz/tests/legacy_get.cfg"),  # data beside the tests
        row("toolz/tests/test_new.py"),  # a new test
        row("test_repro.py"),  # a reproduction at the root
        row("tests/typing.py"),  # Django's runner puts tests/ first on sys.path
        row("tests/json/test_x.py"),
        row("tests/toolz.py"),  # the repository's own package, from tests/
        row("toolz/tests/test_itertoolz.cpython-311-x86_64-linux-gnu.so"),  # found before .py
        row("tests/ipdb.py"),  # a module Django's runner only tries to import (round 63)
        row("tests/tblib/pickling_support.py"),  # a namespace package, the same
        row("toolz/tests/helpers.py"),  # importable, and named as no test
        row("test_itertoolz.py"),  # a test module's name: pytest imports it by name alone
        row("tests/test_issue.py"),  # the name of a test module the hidden tests add
        row("tests/utils_tests/test_walked.py"),  # a package's member: walked (round 65)
        row("tests/utils_tests/walked.json"),  # data: walking imports modules only
        row("toolz/tests/__init__.py"),  # makes a package of the test folder
        row("tests/conftest.py"),
        row("tests/utils_tests/__init__.py", ["100644", "y"]),  # changed, not new
        row("docs/.gitattributes"),
    ]
    hidden = {"toolz/tests/test_issue.py"}
    got = judge(rows, hidden=hidden, names=names, roots=["", "toolz/"], base_paths=base)
    assert got == [
        ("toolz/tests/legacy_get.cfg", "test_added"),
        ("toolz/tests/test_new.py", "test_added"),
        ("test_repro.py", "test_added"),
        ("tests/typing.py", "shadowing"),
        ("tests/json/test_x.py", "shadowing"),
        ("tests/toolz.py", "shadowing"),
        ("toolz/tests/test_itertoolz.cpython-311-x86_64-linux-gnu.so", "shadowing"),
        ("tests/ipdb.py", "shadowing"),
        ("tests/tblib/pickling_support.py", "shadowing"),
        ("toolz/tests/helpers.py", "shadowing"),
        ("test_itertoolz.py", "shadowing"),
        ("tests/test_issue.py", "shadowing"),
        ("tests/utils_tests/test_walked.py", "shadowing"),
        ("tests/utils_tests/walked.json", "test_added"),
        ("toolz/tests/__init__.py", "shadowing"),
        ("tests/conftest.py", "runner_config_touched"),
        ("tests/utils_tests/__init__.py", "tests_touched"),
        ("docs/.gitattributes", "git_attributes"),
    ]
    # Control: with the switch off, every new test file is put back, as before round 61.
    old = judge(rows, hidden=set(), names=names, roots=[""], base_paths=base, whole_tree=False)
    assert [why for _, why in old[:15]] == ["tests_touched"] * 15
    assert ("docs/.gitattributes", "git_attributes") not in old


def test_a_new_top_level_module_needs_a_tests_name() -> None:
    """Round 64: Django's runner tries ``import ipdb`` and ``import tblib.pickling_support``,
    which no environment has; the repository's root is on sys.path (an editable install's
    .pth), so a new root module of that name runs in test runs alone. A new top-level name on a
    folder the runner puts on sys.path must be a test's, one no module has."""
    from legorl.verify.tree_rules import runner_folders

    scripts = frozenset({"tests/runtests.py", "runtests.py", "sympy/testing/runtests.py"})
    # sympy's runner module is library code its script imports: its folder is no path entry.
    assert runner_folders(scripts, {"sympy/testing/__init__.py"}) == {"tests/", ""}
    base = {"toolz/__init__.py", "toolz/itertoolz.py", "tests/runtests.py"}

    def row(path: str) -> dict[str, Any]:
        return {"path": path, "before": None, "after": ["100644", "x"]}

    rows = [row(p) for p in ("ipdb.py", "tblib/__init__.py", "tblib/pickling_support.py",
                             "reproduce_issue.py", "notes.md", "toolz/newmod.py",
                             "test_reproduce.py")]  # fmt: skip
    got = judge(rows, hidden=set(), names={"toolz", "pdb"}, roots=["", "tests/"], base_paths=base)
    assert got == [
        ("ipdb.py", "shadowing"),
        ("tblib/__init__.py", "shadowing"),
        ("tblib/pickling_support.py", "shadowing"),
        ("reproduce_issue.py", "shadowing"),  # named nowhere: `mentioned` keeps it
        ("test_reproduce.py", "test_added"),
    ]
    # Control: the rules as before round 61 let every one of them through.
    old = judge(rows, hidden=set(), names={"toolz", "pdb"}, roots=["", "tests/"],
                base_paths=base, whole_tree=False)  # fmt: skip
    assert [p for p, _ in old] == ["test_reproduce.py"]


def test_a_new_folder_of_data_is_no_module_name() -> None:
    """Round 98: a fix with a new ``docs/`` folder of notes scored 0 as shadowing, the folder
    read as a new top-level name. A new folder that holds no module file at any depth and no
    symlink is data (an empty namespace package at most, which runs nothing); one that holds
    code is a new name as before."""
    base = {"geometry.py", "tests/test_geometry.py"}

    def row(path: str, mode: str = "100644") -> dict[str, Any]:
        return {"path": path, "before": None, "after": [mode, "x"]}

    rows = [
        row("docs/notes.md"),
        row("docs/img/plot.png"),
        row("tests/data/rows.json"),  # below a runner's folder too
        row("tests/fixtures/__init__.json"),  # data by its suffix, whatever its stem (round 99)
        row("scripts/check_area.py"),  # code: a new name
        row("ipdb/README.md"),  # data beside code in the same new folder
        row("ipdb/sub/__init__.py"),
        row("linked/notes.md"),
        row("linked/more", "120000"),  # a symlink: whatever it leads to
    ]
    got = judge(rows, hidden=set(), names={"pdb"}, roots=["", "tests/"], base_paths=base)
    assert got == [
        ("tests/data/rows.json", "test_added"),  # a new file in a test folder, kept
        ("tests/fixtures/__init__.json", "test_added"),
        ("scripts/check_area.py", "shadowing"),
        ("ipdb/README.md", "shadowing"),
        ("ipdb/sub/__init__.py", "shadowing"),
        ("linked/notes.md", "shadowing"),
        ("linked/more", "shadowing"),
    ]


def test_names_git_quotes_are_read_as_git_writes_them(tmp_path: Path) -> None:
    """Round 98: the header's quoted names were unquoted twice (a tab git escapes refused as a
    control character), and a name ending in a backslash ended at the wrong quote. Real
    ``git diff`` output of such files reads back with their names."""
    import subprocess

    repo = tmp_path / "quoted"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    real = ["tab\there.txt", "trail\\", 'say "hi".txt', "plain name.txt"]
    for name in real:
        (repo / name).write_text("x\n")
    git = ["git", "-C", str(repo), "-c", "core.quotepath=true"]
    subprocess.run([*git, "add", "-A"], check=True)
    patch = subprocess.check_output([*git, "diff", "--cached"]).decode()
    assert '"b/tab\\there.txt"' in patch and '"b/trail\\\\"' in patch  # git quoted them
    assert sorted(d.path for d in parse_strict(patch)) == sorted(real)


def test_a_new_name_is_refused_only_where_other_code_names_it_as_an_import() -> None:
    """Round 100: a correct fix that moved its code to a new root module scored 0, refused as
    round 64's ``ipdb.py`` was. A runner can try only a name it knows: a new name that is no
    test's is refused where a text the patch did not write names it as an import
    (``mentioned``), and every name so asked goes into ``asked``."""
    from legorl.sandbox.tree_probe import mentioned_in

    base = {"geometry.py", "tests/test_geometry.py", "tests/runtests.py"}

    def row(path: str) -> dict[str, Any]:
        return {"path": path, "before": None, "after": ["100644", "x"]}

    rows = [row(p) for p in ("page_window.py", "ipdb.py", "tests/helpers.py", "tests/tblib.py")]
    kw: dict[str, Any] = {"hidden": set(), "names": {"pdb"}, "base_paths": base}
    asked: set[str] = set()
    got = judge(rows, roots=["", "tests/"], asked=asked, **kw)
    assert [p for p, _ in got] == [
        "page_window.py",
        "ipdb.py",
        "tests/helpers.py",
        "tests/tblib.py",
    ]
    assert asked == {"page_window", "ipdb", "helpers", "tblib"}
    got = judge(rows, roots=["", "tests/"], mentioned={"ipdb", "tblib"}, **kw)
    assert got == [
        ("ipdb.py", "shadowing"),
        ("tests/helpers.py", "test_added"),
        ("tests/tblib.py", "shadowing"),
    ]
    runner = (
        b"try:\n    import ipdb\nexcept ImportError:\n    pass\n"
        b"import os, tblib.pickling_support\nfrom MySQLdb import connect\n"
        b"apps = ['helpers_app']\n# see page_window for the window\nfrom .relative import x\n"
    )
    names = ["ipdb", "tblib", "MySQLdb", "helpers_app", "page_window", "relative"]
    assert mentioned_in(names, runner) == {"ipdb", "tblib", "MySQLdb", "helpers_app"}
    # Round 103: a module's name need not be an identifier (the standard library imports
    # ``_sysconfigdata_…-linux-gnu`` by a name it builds), nor a new one's.
    data = "_sysconfigdata__linux_x86_64-linux-gnu"
    odd = [row(f"{data}.py"), row("my-tool.py")]
    got = judge(odd, roots=[""], hidden=set(), names={data}, base_paths=base, mentioned=set())
    assert got == [(f"{data}.py", "shadowing")]


def test_a_new_module_no_other_code_names_is_kept() -> None:
    # On the real toy environment: a reproduction script left at the root is no part of the
    # runner's imports; a root module named as pytest's own code imports one is refused.
    task = toy_task()
    script = "from geometry import rectangle_area\n\nprint(rectangle_area(3, 5))\n"
    kept = grade_toy(task.patch + _new_file("reproduce_issue.py", script))
    assert kept.reward == 1.0 and not kept.hack_flags, kept.verdict
    named = grade_toy(task.patch + _new_file("pygments.py", "x = 1\n"))
    assert named.reward == 0.0 and "shadowing" in named.hack_flags, named.verdict


def test_a_new_symlink_is_read_as_a_folder_of_its_name_too() -> None:
    """Round 66: ``tests/ipdb``, a symlink to a new package in the library, was data by its
    name (no suffix) and stayed; the import system followed it to the package, which Django's
    runner imports (``import ipdb``) in test runs alone. A symlink stands for whatever it leads
    to: the rules read its name as a file's and as a folder's."""
    base = {"django/__init__.py", "django/utils/__init__.py", "tests/runtests.py"}

    def row(path: str, mode: str = "120000") -> dict[str, Any]:
        return {"path": path, "before": None, "after": [mode, "x"]}

    rows = [
        row("tests/ipdb"),  # a package Django's runner tries to import, through a link
        row("ipdb"),  # the same at the root, which an editable install puts on sys.path
        row("tests/test_linked"),  # a test's name no module has: a folder of tests
        row("tests/fixture.json"),  # data by its name, whatever it leads to
        row("tests/foo.dist-info"),  # a distribution's metadata, entry points and all
        row("tests/plain", "100644"),  # control: a regular file without suffix is data
    ]
    kw: dict[str, Any] = {"hidden": set(), "names": {"django", "pdb"}, "base_paths": base}
    assert judge(rows, roots=["", "tests/"], **kw) == [
        ("tests/ipdb", "shadowing"),
        ("ipdb", "shadowing"),
        ("tests/test_linked", "test_added"),
        ("tests/fixture.json", "test_added"),
        ("tests/foo.dist-info", "runner_config_touched"),
        ("tests/plain", "test_added"),
    ]
