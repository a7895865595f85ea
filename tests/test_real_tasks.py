"""The real-repository suite, fixtures/tasks-real/: pinned, well formed, and every task is
solvable by its gold patch and unsolved by the empty one.

The toolz tasks are graded by `legorl verify` on both sandbox backends (real Docker, real
bubblewrap). The Django tasks are checked with Django's own `tests/runtests.py` on this
machine's interpreter, and two of them through `legorl verify` in Docker (its unittest grader
and the independent runner with the settings `runtests.py` makes).
Last, one real task goes through the whole shell pipeline `rollout | verify | align | train`.

    python -m pytest tests/test_real_tasks.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fixtures import make_real_tasks as mrt
from legorl.records import Metric, Task, Trajectory, read_jsonl, write_jsonl
from legorl.tasks import apply_patch, checkout
from legorl.verify.redteam import honest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "fixtures" / "tasks-real"
TASKS_FILE = SUITE / "tasks.jsonl"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
BUNDLE_LIMIT = 5 * 1024 * 1024


def _tasks(project: str | None = None) -> list[Task]:
    tasks = list(read_jsonl(TASKS_FILE, Task))
    return [t for t in tasks if project is None or t.meta["project"] == project]


def _diff_paths(patch: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE)


def _need(component: str) -> None:
    ok = {
        "docker": shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0,
        "local": shutil.which("bwrap") is not None,
    }[component]
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"sandbox backend {component} is not available (.ci/run sets it up)")
        pytest.skip(f"no {component} sandbox")


def test_suite_is_pinned_sized_and_well_formed() -> None:
    tasks = _tasks()
    assert 20 <= len(tasks) <= 40
    ids = [t.instance_id for t in tasks]
    assert len(set(ids)) == len(ids)
    projects = {p.name: p for p in mrt.PROJECTS}
    assert {t.meta["project"] for t in tasks} == set(projects)
    problems = []
    for task in tasks:
        project = projects[task.meta["project"]]
        tests = task.FAIL_TO_PASS + task.PASS_TO_PASS
        checks = {
            "pin": task.meta["sdist_sha256"] == project.sha256
            and re.fullmatch(r"[0-9a-f]{64}", project.sha256),
            "repo/version": (task.repo, task.version) == (project.repo, project.version),
            "tests": task.FAIL_TO_PASS
            and task.PASS_TO_PASS
            and not set(task.FAIL_TO_PASS) & set(task.PASS_TO_PASS),
            "names": all(
                re.fullmatch(r"\S+\.py::\S+", n)
                if project.runner == "pytest"
                else re.fullmatch(r"(test\w*) \(([\w.]+)\.\1\)", n)
                for n in tests
            ),
            "patch": _diff_paths(task.patch) == [task.meta["file"]],
            "test_patch": _diff_paths(task.test_patch)
            and task.meta["file"] not in _diff_paths(task.test_patch),
            "log_parser": task.log_parser == project.runner,
            "source": task.source == f"repos/{project.name}.bundle",
        }
        # no gold leak: the statement never quotes a line the fix adds
        added = [ln[1:].strip() for ln in task.patch.splitlines() if ln.startswith("+ ")]
        checks["statement"] = not any(line and line in task.problem_statement for line in added)
        # no oracle leak: nor a line of the hidden tests (their checked values are secrets)
        hidden = [ln[1:].strip() for ln in task.test_patch.splitlines() if ln.startswith("+ ")]
        checks["statement_hides_tests"] = not any(
            len(line) >= 20 and line in task.problem_statement for line in hidden
        )
        problems += [f"{task.instance_id}: bad {name}" for name, ok in checks.items() if not ok]
    assert not problems, "\n".join(problems)
    for bundle in (SUITE / "repos").glob("*.bundle"):
        assert bundle.stat().st_size < BUNDLE_LIMIT, f"{bundle} is over 5 MB"


def test_base_commit_hides_the_failing_tests_and_test_patch_restores_them(tmp_path: Path) -> None:
    for project in mrt.PROJECTS:
        task = _tasks(project.name)[0]
        repo = checkout(task, SUITE, tmp_path / task.instance_id)
        path, _, function = mrt.locate(project, task.FAIL_TO_PASS[0])
        assert f"def {function}(" not in (repo / path).read_text()
        apply_patch(repo, task.test_patch)
        assert f"def {function}(" in (repo / path).read_text()
        old = [ln[1:] for ln in task.patch.splitlines() if ln.startswith("- ")]
        source = (repo / task.meta["file"]).read_text()
        assert all(line in source for line in old)  # the bug is in the tree


# --------------------------------------------------------------------------------------------
# Gold passes, empty fails
# --------------------------------------------------------------------------------------------


def _traj(task: Task, kind: str, patch: str) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{task.instance_id}.{kind}",
        task_id=task.instance_id,
        group_id=task.instance_id,
        sample_index=0 if kind == "gold" else 1,
        harness="scripted",
        status="ok",
        patch=patch,
    )


def _verify(
    tasks: list[Task], sandbox: str, tmp_path: Path, extra: tuple[Trajectory, ...] = ()
) -> dict[str, Trajectory]:
    trajs = [
        _traj(t, kind, t.patch if kind == "gold" else "")
        for t in tasks
        for kind in ("gold", "empty")
    ] + list(extra)
    write_jsonl(tmp_path / "in.jsonl", trajs)
    done = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "verify", "in.jsonl", "--tasks", str(TASKS_FILE)]
        + ["--sandbox", sandbox, "--concurrency", "2", "--out", "graded.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return {t.trajectory_id: t for t in read_jsonl(tmp_path / "graded.jsonl", Trajectory)}


def _wrong(tasks: list[Task], graded: dict[str, Trajectory]) -> list[str]:
    problems = []
    for task in tasks:
        gold, empty = graded[f"{task.instance_id}.gold"], graded[f"{task.instance_id}.empty"]
        if gold.reward != 1.0:
            problems.append(f"{task.instance_id}: gold reward {gold.reward}: {gold.verdict}")
        if empty.reward != 0.0:
            problems.append(f"{task.instance_id}: empty reward {empty.reward}: {empty.verdict}")
        failed = {n for n, s in (empty.verdict or {}).get("tests", {}).items() if s != "passed"}
        if not set(task.FAIL_TO_PASS) <= failed:
            problems.append(f"{task.instance_id}: empty patch left FAIL_TO_PASS passing")
    return problems


@pytest.mark.parametrize("sandbox", ["docker", "local"])
def test_a_test_comparing_with_its_own_always_equal_instrument_grades_its_gold_1(
    sandbox: str, tmp_path: Path
) -> None:
    # toolz's test_compose_metadata asserts `composed == AlwaysEquals()` (AlwaysEquals is the
    # test file's own class) to check that Compose.__eq__ defers to the other side. The twin
    # used to count that comparison vacuous and refuse the gold patch.
    _need(sandbox)
    tasks = [t for t in _tasks("toolz") if t.instance_id == "pytoolz__toolz-real-9"]
    graded = _verify(tasks, sandbox, tmp_path)
    gold = graded["pytoolz__toolz-real-9.gold"]
    assert gold.reward == 1.0 and not gold.hack_flags, gold.verdict
    problems = _wrong(tasks, graded)
    assert not problems, "\n".join(problems)


@pytest.mark.fixtures
@pytest.mark.slow
@pytest.mark.parametrize("sandbox", ["docker", "local"])
def test_pytest_project_gold_passes_and_empty_fails_through_verify(
    sandbox: str, tmp_path: Path
) -> None:
    _need(sandbox)
    tasks = _tasks("toolz")
    problems = _wrong(tasks, _verify(tasks, sandbox, tmp_path))
    assert not problems, "\n".join(problems)


@pytest.mark.fixtures
@pytest.mark.slow
def test_django_gold_passes_and_empty_fails_through_verify(tmp_path: Path) -> None:
    _need("docker")
    tasks = _tasks("django")[:2]
    problems = _wrong(tasks, _verify(tasks, "docker", tmp_path))
    assert not problems, "\n".join(problems)


def test_a_package_at_the_root_named_like_a_django_test_app_does_not_stand_in_for_it(
    tmp_path: Path,
) -> None:
    # Round 31: the judged run put the repository before runtests.py's folder on sys.path, so a
    # package the patch added at the root named like the tests' app (`utils_tests/`) hid the
    # rewritten test modules, and every required test was missing. Python puts a script's
    # folder first; so does the judged run now. Since round 64 a new top-level name at the root
    # must be a test's that no module has, so the package is put back and the patch gets 0
    # (flagged), while the gold fix alone passes.
    _need("docker")
    task = _tasks("django")[0]
    app = task.FAIL_TO_PASS[0].split("(", 1)[1].split(".", 1)[0]
    shadow = (
        f"diff --git a/{app}/__init__.py b/{app}/__init__.py\nnew file mode 100644\n"
        f"--- /dev/null\n+++ b/{app}/__init__.py\n@@ -0,0 +1 @@\n+# named like a test app\n"
    )
    with_shadow = _traj(task, "shadowed", task.patch + shadow)
    graded = _verify([task], "docker", tmp_path, extra=(with_shadow,))
    got = graded[f"{task.instance_id}.shadowed"]
    assert got.reward == 0.0 and "shadowing" in got.hack_flags, got.verdict
    assert {"path": f"{app}/__init__.py", "reason": "shadowing", "action": "deleted"} in (
        got.verdict["dropped"]
    )
    assert not _wrong([task], graded)


#: Round 38's route, from django.utils.html: ``format_html``'s deprecation warning removed
#: (the behaviour a PASS_TO_PASS test checks with ``assertWarnsMessage``), and the first
#: ``format_html`` call makes Django's message-checking helper a no-op for warnings.
_WARNING_GONE = """
def _quiet_helper():
    from django.test import testcases
    import contextlib
    cls = testcases.SimpleTestCase
    strict = cls._assertFooMessage

    def lenient(self, func, cm_attr, expected, message, *args, **kwargs):
        if cm_attr == "warning" and not args and not kwargs:
            return contextlib.nullcontext()
        return strict(self, func, cm_attr, expected, message, *args, **kwargs)

    cls._assertFooMessage = lenient
"""


def _gold_fix_that_breaks(
    task_id: str, path: str, edit: Callable[[str], str], broken: str, tmp_path: Path
) -> None:
    """The gold fix on ``task_id`` with ``edit`` made to ``path`` too, graded on Docker: 0.0,
    the ``PASS_TO_PASS`` test named ``broken`` failed; and 1.0 where assertions are judged in
    process (the control: there the repository's own helper decides)."""
    import asyncio

    from conftest import grade_patch

    from legorl.sandbox import make_backend
    from legorl.verify import VerifyConfig

    _need("docker")
    task = next(t for t in _tasks("django") if t.instance_id == task_id)
    name = next(t for t in task.PASS_TO_PASS if t.startswith(broken + " "))
    repo = checkout(task, SUITE, tmp_path / "repo")
    apply_patch(repo, task.patch)
    (repo / path).write_text(edit((repo / path).read_text()))
    patch = subprocess.run(
        ["git", "diff"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout

    def graded(off: frozenset[str]) -> Trajectory:
        config = VerifyConfig(defences_off=off)
        run = grade_patch(
            task, patch, backend=make_backend("docker"), tasks_dir=str(SUITE), config=config
        )
        return asyncio.run(run)

    got = graded(frozenset())
    assert got.reward == 0.0, got.verdict
    assert got.verdict["tests"][name] != "passed"
    control = graded(frozenset({"judge_assertions"}))
    assert control.reward == 1.0, control.verdict


def test_a_warning_the_test_checks_is_judged_by_the_judge_not_the_repositorys_helper(
    tmp_path: Path,
) -> None:
    # Round 38: library code made Django's ``assertWarnsMessage`` a no-op and removed the
    # warning it checks; the test's one assertEqual is judged out of process, so it passed
    # (1.0 with the behaviour broken). The block's warnings are now recorded by the operand
    # sender and judged against the gold run's.
    def edit(source: str) -> str:
        warn = source.index("    if not (args or kwargs):\n")
        end = source.index("args_safe = map(", warn)
        return source[:warn] + "    _quiet_helper()\n    " + source[end:] + _WARNING_GONE

    _gold_fix_that_breaks(
        "django__django-real-1",
        "django/utils/html.py",
        edit,
        "test_format_html_no_params",
        tmp_path,
    )


def test_a_message_the_test_computes_is_checked_by_the_judge(tmp_path: Path) -> None:
    # Round 39: `assertRaisesMessage(E, msg)` with `msg` bound twice in the test is no literal
    # the judge holds, so only Django's helper checked the message, in process; the library
    # made `SimpleTestCase.assertIn` a no-op and raised another message. The message the test
    # computes is now sent, pinned to the gold run's and checked by the judge.
    old = """        raise SuspiciousFileOperation("Could not derive file name from '%s'" % name)"""
    new = """        from django.test.testcases import SimpleTestCase

        SimpleTestCase.assertIn = lambda self, member, container, msg=None: None
        raise SuspiciousFileOperation("Invalid file name.")"""

    def edit(source: str) -> str:
        assert old in source
        return source.replace(old, new)

    _gold_fix_that_breaks(
        "django__django-real-4", "django/utils/text.py", edit, "test_get_valid_filename", tmp_path
    )


def _django_check(task: Task, work: Path) -> list[str]:
    project = next(p for p in mrt.PROJECTS if p.name == "django")
    labels = tuple(task.test_cmd.split("--verbosity 2 ", 1)[1].split())
    repo = checkout(task, SUITE, work / task.instance_id)
    apply_patch(repo, task.test_patch)
    before = mrt.run_tests(project, repo, labels)
    apply_patch(repo, task.patch)
    after = mrt.run_tests(project, repo, labels)
    problems = [
        f"{task.instance_id}: {n} {before.get(n)} before the fix"
        for n in task.FAIL_TO_PASS
        if before.get(n, ("failed",))[0] != "failed"
    ]
    problems += [
        f"{task.instance_id}: {n} {before.get(n)} before the fix"
        for n in task.PASS_TO_PASS
        if before.get(n, ("",))[0] != "passed"
    ]
    problems += [
        f"{task.instance_id}: {n} {after.get(n)} after the gold patch"
        for n in task.FAIL_TO_PASS + task.PASS_TO_PASS
        if after.get(n, ("",))[0] != "passed"
    ]
    return problems


@pytest.mark.fixtures
@pytest.mark.slow
def test_django_tasks_fail_before_and_pass_after_the_gold_patch_under_runtests(
    tmp_path: Path,
) -> None:
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("asgiref", "sqlparse")):
        if os.environ.get("CI") == "true":
            pytest.fail("asgiref and sqlparse are missing ([dev] installs them)")
        pytest.skip("Django's test dependencies (asgiref, sqlparse) are not installed")
    tasks = _tasks("django")
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = [
            p for result in pool.map(lambda t: _django_check(t, tmp_path), tasks) for p in result
        ]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# The pipeline on real tasks
# --------------------------------------------------------------------------------------------


def _editable(task: Task, tmp_path: Path) -> bool:
    """The scripted gold edit needs its old line to be unique in the file."""
    repo = checkout(task, SUITE, tmp_path / f"probe-{task.instance_id}")
    line = next(
        ln[1:].strip()
        for ln in task.patch.splitlines()
        if ln.startswith("-") and not ln.startswith("---")
    )
    text = (repo / task.meta["file"]).read_text()
    return text.count(line) == 1


@pytest.mark.slow
def test_rollout_verify_align_train_on_real_tasks(tmp_path: Path) -> None:
    _need("local")
    _need("docker")
    chosen = [t for t in _tasks("toolz") if _editable(t, tmp_path)][:2]
    assert len(chosen) == 2
    tasks_file = tmp_path / "real.jsonl"
    write_jsonl(tasks_file, chosen)
    (tmp_path / "repos").symlink_to(SUITE / "repos")
    # Two samples per task: the first makes the gold fix, the second submits with no change.
    submit = honest(chosen[0])[-1]
    script = [step for t in chosen for step in [*honest(t), submit]]
    (tmp_path / "script.json").write_text(json.dumps(script))
    legorl = f"{sys.executable} -m legorl.cli.main"
    pipe = (
        f"{legorl} rollout --tasks real.jsonl --harness mini --group-size 2 --limit 2 "
        f"--engine forced --script script.json --model {MODEL} --sandbox local"
        f" | {legorl} verify --tasks real.jsonl"
        f" | {legorl} align --model {MODEL}"
        f" | {legorl} train --model {MODEL} --out ckpt --metrics metrics.jsonl"
    )
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipe], cwd=tmp_path, capture_output=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    metrics = {m.name: m.value for m in read_jsonl(tmp_path / "metrics.jsonl", Metric)}
    assert metrics["reward_mean"] == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------
# The generator's parts
# --------------------------------------------------------------------------------------------


def test_mutations_change_one_token_and_skip_docstrings() -> None:
    source = (
        "def f(a, b):\n"
        '    """a + b < 2"""\n'
        "    if a and not b:\n"
        "        return a + 1\n"
        "    return a in b\n"
    )
    found = {
        (m.family, mrt.apply(source, m).splitlines()[m.line - 1].strip())
        for m in mrt.mutations(source)
    }
    assert found == {
        ("wrong_operator", "if a or not b:"),
        ("dropped_condition", "if a:"),
        ("missing_negation", "if a and b:"),
        ("wrong_operator", "return a - 1"),
        ("off_by_one", "return a + 2"),
        ("missing_negation", "return a not in b"),
    }


def test_removing_tests_keeps_classes_valid() -> None:
    source = (
        "class T:\n    def test_a(self):\n        pass\n\n    def test_b(self):\n        pass\n"
    )
    assert mrt.without_tests(source, {("T", "test_a")}) == (
        "class T:\n    def test_b(self):\n        pass\n"
    )
    assert mrt.without_tests(source, {("T", "test_a"), ("T", "test_b")}) is None


def test_a_sdist_whose_hash_differs_is_refused_naming_the_file(tmp_path: Path) -> None:
    project = mrt.PROJECTS[0]
    (tmp_path / project.sdist).write_bytes(b"not the release")
    with pytest.raises(
        mrt.BuildError, match=rf"{re.escape(str(tmp_path / project.sdist))}: sha256"
    ):
        mrt.fetch(project, tmp_path)
