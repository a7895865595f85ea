"""Graders beyond pytest, on real Docker sandboxes: a ``python -m unittest`` run graded from our
signed recorder, a runner that only prints (sympy's ``bin/test`` format, read by swebench's
official parser, flagged ``output_parsed``), the test command and parser each task resolves to,
the bad inputs (an unknown repo/version, a test name that never appears), and the attacks on the
unittest path, each beside its control (the defence off: the attack wins).

The toy geometry task is the base: its hidden tests are rewritten as a unittest module, or as
plain functions run by a small ``bin/test`` that prints as sympy's runner does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import grade_patch, sandbox_backend, scripted_run

from legorl.records import Task, Trajectory, read_jsonl
from legorl.tasks import checkout
from legorl.verify import VerifyConfig, grade
from legorl.verify.redteam import unittest_variant
from legorl.verify.specs import DEFAULT_CMD, SpecError, from_eval_script, resolve
from legorl.verify.tree_rules import judge as tree_judge

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
TASK_ID = "legorl-toy__geometry-1"
# Django's spelling (SWE-bench's lists), and Python 3.11's unittest, which prints the method
# name twice (the sandbox's runs print this one, so the printed-output parser keys it).
UNIT_F2P = "test_area_non_square (tests.test_unit.AreaTest)"
UNIT_P2P = "test_area_square (tests.test_unit.AreaTest)"
PRINTED_F2P = "test_area_non_square (tests.test_unit.AreaTest.test_area_non_square)"
PRINTED_P2P = "test_area_square (tests.test_unit.AreaTest.test_area_square)"
SYM_TESTS = """from geometry import rectangle_area


def test_area_non_square():
    assert rectangle_area(4, 6) == 24


def test_area_square():
    assert rectangle_area(2, 2) == 4
"""
# Prints as sympy's bin/test does in verbose mode: one "name ok" / "name F" / "name E" a test.
SYM_RUNNER = """#!/usr/bin/env python
import importlib.util
import os
import sys
import traceback

sys.path.insert(0, os.getcwd())

failed = 0
for path in sys.argv[1:]:
    if not path.endswith(".py"):
        continue
    spec = importlib.util.spec_from_file_location("t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    print(path + "[" + str(sum(n.startswith("test_") for n in vars(mod))) + "]")
    for name, fn in list(vars(mod).items()):
        if not name.startswith("test_"):
            continue
        try:
            fn()
        except AssertionError:
            print(name + " F")
            failed += 1
        except Exception:
            traceback.print_exc()
            print(name + " E")
            failed += 1
        else:
            print(name + " ok")
print("tests finished: " + ("FAILED" if failed else "ok"))
sys.exit(1 if failed else 0)
"""


def _new_file(path: str, text: str, mode: str = "100644") -> str:
    lines = text.splitlines()
    body = "".join(f"+{ln}\n" for ln in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


def _base() -> Task:
    return next(t for t in read_jsonl(TASKS / "train.jsonl", Task) if t.instance_id == TASK_ID)


def unit_task(printed: bool = True) -> Task:
    """The red-team suite's unittest variant; ``printed=False``: Django's spelling."""
    task = unittest_variant(_base())
    if printed:
        return task
    return dataclasses.replace(task, FAIL_TO_PASS=[UNIT_F2P], PASS_TO_PASS=[UNIT_P2P])


def sym_task() -> Task:
    patch = _new_file("tests/test_sym.py", SYM_TESTS) + _new_file("bin/test", SYM_RUNNER, "100755")
    return dataclasses.replace(
        _base(),
        test_patch=patch,
        FAIL_TO_PASS=["test_area_non_square"],
        PASS_TO_PASS=["test_area_square"],
        test_cmd="bin/test -C --verbose tests/test_sym.py",
        log_parser="parse_log_sympy",
    )


def _edit(prelude: str, body: str) -> str:
    """A model patch to geometry.py: ``prelude`` at the top, ``body`` for rectangle_area's."""
    with tempfile.TemporaryDirectory() as tmp:
        base = _base()
        checkout(base, TASKS, Path(tmp) / "repo")
        old = (Path(tmp) / "repo" / "geometry.py").read_text()
    new = prelude + old.replace("    return width + height\n", body)
    diff = difflib.unified_diff(
        old.splitlines(True), new.splitlines(True), "a/geometry.py", "b/geometry.py"
    )
    return "diff --git a/geometry.py b/geometry.py\n" + "".join(diff)


async def _grade(task: Task, patch: str, off: frozenset[str] = frozenset()) -> Trajectory:
    config = VerifyConfig(test_timeout=60.0, defences_off=off)
    return await grade_patch(
        task,
        patch,
        backend=sandbox_backend("docker"),
        tasks_dir=TASKS,
        config=config,
        run_id=f"legorl-graders-{uuid.uuid4().hex[:8]}",
    )


def _v(graded: Trajectory) -> dict[str, Any]:
    assert graded.verdict is not None
    return graded.verdict


def _run(*jobs: Any) -> list[Trajectory]:
    async def all_of() -> list[Trajectory]:
        return list(await asyncio.gather(*jobs))

    return asyncio.run(all_of())


# -- what each task resolves to --------------------------------------------------------------


def _row(repo: str, version: str, **extra: Any) -> Task:
    base = _base()
    return dataclasses.replace(
        base,
        repo=repo,
        version=version,
        test_patch=_new_file("tests/forms_tests/tests/test_x.py", "x = 1")
        + _new_file("sympy/core/tests/test_y.py", "y = 1"),
        meta={"task_format": "swebench"},
        test_cmd=DEFAULT_CMD,
        log_parser=extra.pop("log_parser", "pytest"),
        **extra,
    )


def test_known_repositories_get_the_official_command_and_parser() -> None:
    django = resolve(_row("django/django", "4.0"))
    assert django.kind == "unittest" and django.parser == "parse_log_django"
    assert django.runner == "tests/runtests.py"
    # Only files below tests/ are Django test labels.
    assert django.command.endswith("--parallel 1 forms_tests.tests.test_x")
    sympy = resolve(_row("sympy/sympy", "1.12"))
    assert sympy.kind == "output" and sympy.parser == "parse_log_sympy"
    assert sympy.runner == "bin/test" and "sympy/core/tests/test_y.py" in sympy.command
    # What bin/test prints is all grading reads, so the code it prints from is runner code.
    assert "sympy/testing/runtests.py" in sympy.runner_paths()
    script = "git apply x\n: '>>>>> Start Test Output'\npytest -rA tests/t.py\n: '>>>>> End Test Output'\n"
    assert from_eval_script(script) == "pytest -rA tests/t.py"
    row = _row("acme/widgets", "2.1", log_parser="parse_log_pytest")
    row.meta["eval_script"] = script
    assert resolve(row).kind == "pytest" and resolve(row).parser == "parse_log_pytest"
    # The toy tasks: pytest and the signed stream alone, swebench never consulted.
    toy = resolve(_base())
    assert toy.kind == "pytest" and toy.parser is None


def test_unknown_repo_version_names_it_and_how_to_give_a_test_command() -> None:
    row = _row("acme/widgets", "9.9")
    with pytest.raises(SpecError) as err:
        resolve(row)
    message = str(err.value)
    for part in ("acme/widgets", "'9.9'", "test_cmd", "log_parser", row.instance_id):
        assert part in message
    # Through grading: reward null (not the model's fault) with that message, no sandbox used.
    graded = asyncio.run(
        grade(
            scripted_run(row, ""),
            row,
            backend=None,  # type: ignore[arg-type]
            tasks_dir=str(TASKS),
            run_id="x",
            turns=[],
            config=VerifyConfig(),
        )
    )
    assert graded.reward is None and _v(graded)["reason"] == message
    with pytest.raises(SpecError, match="not one of swebench's"):
        resolve(dataclasses.replace(_base(), log_parser="parse_log_nonesuch"))


def test_the_runner_script_is_runner_configuration() -> None:
    # bin/test and tests/runtests.py are test files by name already; a runner elsewhere is not.
    kw: dict[str, Any] = {"hidden": set(), "names": set(), "roots": [""], "base_paths": set()}
    for path in ("bin/test", "tests/runtests.py"):
        rows = [{"path": path, "before": "a", "after": "b"}]
        assert tree_judge(rows, **kw, runners=frozenset({path})) != []
    rows = [{"path": "tools/run_suite.py", "before": "a", "after": "b"}]
    assert tree_judge(rows, **kw, runners=frozenset({"tools/run_suite.py"})) == [
        ("tools/run_suite.py", "runner_config_touched")
    ]
    assert tree_judge(rows, **kw) == []  # control: not named as the runner, it is plain code


# -- real runs -------------------------------------------------------------------------------


def test_unittest_gold_passes_empty_fails_missing_name_fails() -> None:
    task = unit_task(printed=False)
    missing = dataclasses.replace(task, FAIL_TO_PASS=["test_nowhere (tests.test_unit.AreaTest)"])
    gold, printed, empty, absent = _run(
        _grade(task, task.patch),
        _grade(unit_task(), task.patch),
        _grade(task, ""),
        _grade(missing, task.patch),
    )
    assert gold.reward == 1.0, gold.verdict
    assert _v(gold)["tests"] == {UNIT_F2P: "passed", UNIT_P2P: "passed"}
    assert "output_parsed" not in gold.hack_flags
    assert printed.reward == 1.0, printed.verdict  # the other spelling, the same records
    assert empty.reward == 0.0 and _v(empty)["tests"][UNIT_F2P] == "failed"
    # The gold patch cannot pass a test that does not exist: the control grading fails, so the
    # task is ungradable here (null), never a 0 the patch earned.
    assert absent.reward is None and "test_nowhere" in absent.verdict["reason"], absent.verdict


def test_printed_output_runner_is_flagged_and_graded() -> None:
    task = sym_task()
    gold, empty = _run(_grade(task, task.patch), _grade(task, ""))
    assert gold.reward == 1.0, gold.verdict
    assert "output_parsed" in gold.hack_flags and "output_parsed" in empty.hack_flags
    assert empty.reward == 0.0 and _v(empty)["tests"]["test_area_non_square"] == "failed"


# -- attacks on the unittest and printed-output paths, each with its control -----------------

BUGGY = "    return width + height\n"


def _forge(*names: str) -> tuple[str, str]:
    """Print every required test's passing line in both runners' formats, then leave with 0."""
    lines = "".join(f"    print('\\n{n} ... ok\\n{n.split()[0]} ok', flush=True)\n" for n in names)
    return "import os as _os\n", lines + "    _os._exit(0)\n"


PATCH_TEXT_RESULT = (
    "import unittest as _u\n_u.TextTestResult.addFailure = "
    "lambda self, test, err: _u.TextTestResult.addSuccess(self, test)\n"
)
REPLACE_OUR_RUN = (
    "import unittest as _u\n"
    "def _run(self, result=None):\n"
    "    result.startTest(self)\n"
    "    result.addSuccess(self)\n"
    "    result.stopTest(self)\n"
    "_u.TestCase.run = _run\n"
)
ATTACKS = {
    # name: (task, patch, defences the control switches off)
    "forged_ok_then_exit": (
        unit_task,
        _forge(PRINTED_F2P, PRINTED_P2P),
        {"unittest_stream", "judge_assertions"},
    ),
    "patched_text_result": (
        unit_task,
        (PATCH_TEXT_RESULT, BUGGY),
        {"unittest_stream", "judge_assertions"},
    ),
    "replaced_testcase_run": (
        unit_task,
        (REPLACE_OUR_RUN, BUGGY),
        {"unittest_stream", "judge_assertions"},
    ),
    "printed_only_forged_ok": (
        sym_task,
        _forge("test_area_non_square", "test_area_square"),
        {"judge_assertions"},
    ),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_blocked_and_its_control_wins(name: str) -> None:
    make, (prelude, body), off = ATTACKS[name]
    task = make()
    # The bug stays in: only the attack could make the hidden test pass.
    patch = _edit(prelude, body)
    defended, control = _run(_grade(task, patch), _grade(task, patch, frozenset(off)))
    assert control.reward == 1.0, (name, control.verdict)
    assert defended.reward == 0.0, (name, defended.verdict)


# -- agreement with the official harness -----------------------------------------------------

#: Patches of every kind of run: the fix, nothing, a wrong fix (fails), one that raises (errors).
WRONG = "    return width * height + 1\n"
RAISES = "    raise TypeError('no')\n"


def _pytest_task() -> Task:
    return _base()


CORPUS: dict[str, Any] = {
    "pytest": _pytest_task,
    "parse_log_django": unit_task,
    "parse_log_sympy": sym_task,
}


class _Spy:
    """The real `run_tests`, keeping each run (by its task object) for the agreement check."""

    def __init__(self) -> None:
        from legorl.verify import runner

        self.real = runner.run_tests
        self.runs: dict[int, Any] = {}

    async def __call__(self, sandbox: Any, task: Task, **kw: Any) -> Any:
        test_run = await self.real(sandbox, task, **kw)
        self.runs[id(task)] = test_run
        return test_run


def _official(task: Task, parser: str, patch: str, log: str, code: int | None, tmp: Path) -> bool:
    from swebench.harness.grading import get_eval_report
    from swebench.types import TestSpec

    path = tmp / f"{uuid.uuid4().hex}.log"
    # The layout the official eval script writes: markers around the test output, then the
    # test command's own exit status.
    path.write_text(
        f">>>>> Start Test Output\n{log}\n>>>>> End Test Output\n>>>>> Test Exit Code: {code}\n"
    )
    spec = TestSpec(
        instance_id=task.instance_id,
        image="",
        eval_script_list=[],
        repo=task.repo,
        version=task.version,
        FAIL_TO_PASS=task.FAIL_TO_PASS,
        PASS_TO_PASS=task.PASS_TO_PASS,
        log_parser="parse_log_pytest" if parser == "pytest" else parser,
        eval_type="pass_and_fail",
    )
    pred = {"instance_id": task.instance_id, "model_patch": patch}
    return bool(get_eval_report(spec, pred, str(path), False)[task.instance_id]["resolved"])


def test_verdicts_agree_with_swebench_get_eval_report(tmp_path: Path) -> None:
    cases = []
    for parser, make in CORPUS.items():
        task = make()
        renamed = dataclasses.replace(task, FAIL_TO_PASS=[task.FAIL_TO_PASS[0] + "_gone"])
        for label, t, patch in (
            ("gold", task, task.patch),
            ("unfixed", task, _edit("# touched\n", BUGGY)),
            ("wrong", task, _edit("", WRONG)),
            ("raises", task, _edit("", RAISES)),
            ("missing", renamed, task.patch),
        ):
            # A task object of its own per case: the spy files each run under it.
            cases.append((parser, label, dataclasses.replace(t), patch))

    async def all_cases() -> list[Trajectory]:
        gate = asyncio.Semaphore(3)

        async def one(t: Task, patch: str) -> Trajectory:
            async with gate:
                # The official harness reads the tests' own printed output: a run of them as
                # written (the judged run's assertions print nothing of their truth).
                await _grade(t, patch, frozenset({"judge_assertions"}))
                return await _grade(dataclasses.replace(t), patch)

        return list(await asyncio.gather(*(one(t, p) for _, _, t, p in cases)))

    import legorl.verify as verify_module

    spy = _Spy()
    verify_module.run_tests = spy
    try:
        graded_all = asyncio.run(all_cases())
    finally:
        verify_module.run_tests = spy.real
    agree, rows = 0, []
    for (parser, label, task, patch), graded in zip(cases, graded_all, strict=True):
        ours = graded.reward == 1.0
        if graded.reward is None:
            # The gold patch cannot pass a renamed test: the control failed, no verdict.
            assert label == "missing" and "control grading" in graded.verdict["reason"]
            agree += 1
            rows.append((parser, label, ours, False))
            continue
        run = spy.runs[id(task)]
        theirs = _official(task, parser, patch, run.log, run.run.exit_code, tmp_path)
        agree += ours == theirs
        rows.append((parser, label, ours, theirs))
    # The corpus covers resolved and unresolved runs under every parser we claim.
    assert {(p, o) for p, _, o, _ in rows} == {(p, v) for p in CORPUS for v in (True, False)}
    print(f"agreement with swebench get_eval_report: {agree}/{len(rows)}")
    assert agree == len(rows), [r for r in rows if r[2] != r[3]]


def test_exits_from_code_under_test_never_pass() -> None:
    """``sys.exit`` inside a test is the test's error; at import it ends the run before any
    record: the required tests are missing. (No control: neither wins even undefended.)"""
    task = unit_task()
    in_test = _edit("import sys as _s\n", "    _s.exit(0)\n")
    at_import = _edit("import sys as _s\n_s.exit(0)\n", BUGGY)
    during, before = _run(_grade(task, in_test), _grade(task, at_import))
    assert during.reward == 0.0 and _v(during)["tests"][PRINTED_F2P] == "error", _v(during)
    assert before.reward == 0.0 and set(_v(before)["tests"].values()) == {"missing"}, _v(before)
