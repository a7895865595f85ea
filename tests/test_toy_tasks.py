"""The toy task sets, fixtures/tasks/ (hand-written modules) and fixtures/tasks-generated/
(generated ones): reproducible, well formed, and every task is solvable.

Rebuilds the set into a temporary folder and compares the JSONL bytes, checks counts and the
train/heldout split, then materialises every task from its bundle with ``legorl.tasks``: after
``test_patch`` the FAIL_TO_PASS tests fail and PASS_TO_PASS pass, after the gold ``patch`` all
of them pass, and the gold fix is nowhere in the bundle's history.

    python -m pytest tests/test_toy_tasks.py -q
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from legorl.records import Task, read_jsonl
from legorl.tasks import PatchError, TaskError, apply_patch, checkout

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "fixtures" / "tasks"
# suite folder -> the generator that builds it (python -m fixtures.NAME)
SUITES = {
    "tasks": "make_tasks",
    "tasks-generated": "make_generated_tasks",
}
SPLITS = ("train", "heldout")
FAMILIES = {
    "wrong_operator",
    "off_by_one",
    "wrong_constant",
    "swapped_arguments",
    "missing_negation",
    "wrong_comparison",
    "wrong_default",
}


@pytest.fixture(scope="module", params=sorted(SUITES))
def suite(request: pytest.FixtureRequest) -> Path:
    return ROOT / "fixtures" / str(request.param)


@pytest.fixture(scope="module")
def tasks(suite: Path) -> dict[str, list[Task]]:
    return {split: list(read_jsonl(suite / f"{split}.jsonl", Task)) for split in SPLITS}


@functools.cache
def _committed() -> dict[str, Task]:
    return {
        task.instance_id: task
        for split in SPLITS
        for task in read_jsonl(TASKS_DIR / f"{split}.jsonl", Task)
    }


@functools.cache
def _prepared(instance_id: str) -> Any:
    """The failing tests of one hand-written bug as the committed suite ships them, held tables
    included: (name, source) of each test function its ``test_patch`` adds (the judge runs
    these; the generator rebuilding them byte for byte is the ``fixtures`` check
    `test_generator_reproduces_the_committed_jsonl`), and whether they hold a table."""
    import ast

    task = _committed()[instance_id]
    added = "".join(
        line[1:] + "\n"
        for line in task.test_patch.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    lines = added.splitlines()
    tests = {
        node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno]) + "\n"
        for node in ast.parse(added).body
        if isinstance(node, ast.FunctionDef)
    }
    new = [(name, tests[name]) for name in (n.split("::")[-1] for n in task.FAIL_TO_PASS)]
    return SimpleNamespace(new_tests=new, table="answers = [answer(*a) for a in" in added)


def _all(tasks: dict[str, list[Task]]) -> list[Task]:
    return [task for split in SPLITS for task in tasks[split]]


@pytest.mark.fixtures
@pytest.mark.slow
def test_generator_reproduces_the_committed_jsonl(suite: Path, tmp_path: Path) -> None:
    generator = f"fixtures.{SUITES[suite.name]}"
    proc = subprocess.run(
        [sys.executable, "-m", generator, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for name in [f"{split}.jsonl" for split in SPLITS] + ["README.md"]:
        assert (tmp_path / name).read_bytes() == (suite / name).read_bytes(), (
            f"{suite.name}/{name} differs from the committed one; rebuild it with"
            f" python -m {generator}"
        )


def test_generated_suite_builder_refuses_a_count_below_one_held_out_task(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fixtures.make_generated_tasks"]
        + ["--out", str(tmp_path / "out"), "--count", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "make_generated_tasks: --count must be at least 5"
    assert not (tmp_path / "out").exists()  # nothing written


def test_counts_families_and_split(tasks: dict[str, list[Task]]) -> None:
    everything = _all(tasks)
    assert len(everything) >= 90
    ids = [task.instance_id for task in everything]
    assert len(set(ids)) == len(ids), "instance ids are not unique"
    groups = {}
    for split in SPLITS:
        assert {task.split for task in tasks[split]} == {split}
        assert {task.meta["family"] for task in tasks[split]} == FAMILIES, split
        groups[split] = {
            (task.meta["module"], task.meta["function"], task.meta["family"])
            for task in tasks[split]
        }
    assert not groups["train"] & groups["heldout"], "a bug appears in both splits"
    assert 0.15 <= len(tasks["heldout"]) / len(everything) <= 0.3


def _patched_files(patch: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE)


def test_records_are_well_formed(suite: Path, tasks: dict[str, list[Task]]) -> None:
    problems = []
    for task in _all(tasks):
        iid, module = task.instance_id, task.meta["module"]
        test_file = f"tests/test_{module}.py"
        checks = {
            "instance_id": re.fullmatch(rf"legorl-toy__{module}-\d+", iid),
            "repo": task.repo == f"legorl-toy/{module}",
            "base_commit": re.fullmatch(r"[0-9a-f]{40}", task.base_commit),
            "environment_setup_commit": task.environment_setup_commit == task.base_commit,
            "FAIL_TO_PASS": task.FAIL_TO_PASS
            and all(node.startswith(f"{test_file}::") for node in task.FAIL_TO_PASS),
            "PASS_TO_PASS": len(task.PASS_TO_PASS) >= 2
            and not set(task.PASS_TO_PASS) & set(task.FAIL_TO_PASS),
            "patch": _patched_files(task.patch) == [task.meta["file"]],
            "test_patch": _patched_files(task.test_patch)
            and all(path.startswith("tests/") for path in _patched_files(task.test_patch)),
            "test_cmd": task.test_cmd == f"python -m pytest -rA -p no:cacheprovider {test_file}",
            "source": task.source == f"repos/{iid}.bundle" and (suite / task.source).is_file(),
            "meta": task.meta["family"] in FAMILIES and task.meta["file"] == f"{module}.py",
            "misc": task.version == "0.1" and task.hints_text == "" and task.image is None,
        }
        problems += [f"{iid}: bad {field}" for field, ok in checks.items() if not ok]
    assert not problems, "\n".join(problems)


def test_checkout_and_apply_patch_report_errors(tmp_path: Path) -> None:
    missing = SimpleNamespace(
        instance_id="toy__x-1", base_commit="0" * 40, source="repos/no.bundle"
    )
    with pytest.raises(TaskError, match="toy__x-1"):
        checkout(missing, TASKS_DIR, tmp_path / "x")
    apply_patch(tmp_path, "")  # empty patch: nothing to do
    bad = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(PatchError, match=r"nope\.py"):
        apply_patch(tmp_path, bad)


# --------------------------------------------------------------------------------------------
# Every task, end to end
# --------------------------------------------------------------------------------------------


def _run_tests(repo: Path, task: Task, report: Path) -> tuple[dict[str, str], str]:
    """Run the task's test_cmd; returns {node id: passed|failed|skipped} and pytest's output."""
    argv = shlex.split(task.test_cmd)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("PYTHONPATH", None)
    # Plugins installed in the dev venv are no part of a task's environment and would double
    # pytest's start-up time, which dominates this test.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [*argv, f"--junitxml={report}"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    results: dict[str, str] = {}
    if report.is_file():
        for case in ET.parse(report).iter("testcase"):
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            tags = {child.tag for child in case}
            failed, skipped = tags & {"failure", "error"}, "skipped" in tags
            results[node] = "failed" if failed else "skipped" if skipped else "passed"
    return results, proc.stdout[-1500:] + proc.stderr[-500:]


def _added_lines(patch: str) -> list[str]:
    return [
        line[1:]
        for line in patch.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def _check_task(task: Task, suite: Path, work: Path) -> list[str]:
    iid = task.instance_id
    try:
        repo = checkout(task, suite, work / iid)
        head = subprocess.run(
            ["git", "rev-parse", "HEAD", "--abbrev-ref", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if head != [task.base_commit, "main"]:
            return [f"{iid}: checkout gave {head}, not base_commit on main"]
        history = subprocess.run(
            ["git", "log", "--all", "-p", "--format=commit %H"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        problems = [
            f"{iid}: gold line {line!r} is reachable from the bundle's history"
            for line in _added_lines(task.patch)
            if f"\n+{line}\n" in history
        ]

        apply_patch(repo, task.test_patch)
        before, log = _run_tests(repo, task, work / f"{iid}.before.xml")
        problems += [
            f"{iid}: FAIL_TO_PASS {node} is {before.get(node, 'missing')} before the fix\n{log}"
            for node in task.FAIL_TO_PASS
            if before.get(node) != "failed"
        ]
        problems += [
            f"{iid}: PASS_TO_PASS {node} is {before.get(node, 'missing')} before the fix\n{log}"
            for node in task.PASS_TO_PASS
            if before.get(node) != "passed"
        ]

        apply_patch(repo, task.patch)
        after, log = _run_tests(repo, task, work / f"{iid}.after.xml")
        problems += [
            f"{iid}: {node} is {after.get(node, 'missing')} after the gold patch\n{log}"
            for node in task.FAIL_TO_PASS + task.PASS_TO_PASS
            if after.get(node) != "passed"
        ]
        return problems
    except (TaskError, subprocess.SubprocessError, OSError, ET.ParseError) as exc:
        return [f"{iid}: {type(exc).__name__}: {exc}"]


@pytest.mark.fixtures
@pytest.mark.slow
def test_every_task_fails_before_and_passes_after_the_gold_patch(
    suite: Path, tasks: dict[str, list[Task]], tmp_path: Path
) -> None:
    workers = min(4, max(2, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda task: _check_task(task, suite, tmp_path), _all(tasks))
        problems = [problem for result in results for problem in result]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_task_sources_are_read_from_files_and_a_bad_one_is_named(tmp_path: Path) -> None:
    from fixtures import make_tasks as mt

    folder = tmp_path / "geometry"
    shutil.copytree(mt.SOURCES / "geometry", folder)
    assert mt.read_module(folder) == mt.modules()[0]  # the control: an unchanged copy reads
    spec = folder / "bugs.toml"
    count = len(mt.modules()[0].bugs)
    spec.write_text(spec.read_text() + '\n[[bug]]\nfunction = "distance"\n')
    with pytest.raises(mt.SpecError, match=rf"{re.escape(str(spec))}: bug {count + 1} needs"):
        mt.read_module(folder)
    spec.write_text("summary = \n")
    with pytest.raises(mt.SpecError, match=re.escape(str(spec))):
        mt.read_module(folder)


def test_a_domain_bounds_a_tables_calls_and_a_bad_one_is_named(tmp_path: Path) -> None:
    """Round 118: each function's ``[domain]`` (the inputs its docstring answers for) bounds
    the rows of its held tables; a domain naming no function of the module, one that does not
    compile, one that is no string, or one whose function has a parameter hiding a word of the
    vocabulary is refused naming the file and the key."""
    from fixtures import make_tasks as mt
    from fixtures.domains import inside

    folder = tmp_path / "taskqueue"
    shutil.copytree(mt.SOURCES / "taskqueue", folder)
    module = mt.read_module(folder)
    source = mt._code(module.source)
    functions = {n for n in mt.public_names(source) if not n.isupper()}
    assert set(module.domains) == functions
    batch = mt.load("taskqueue", source)["batch"]
    domain = module.domains["batch"]
    assert inside(domain, batch, ([1, 2, 3], 2), ())
    assert inside(domain, batch, ([1, 2, 3], 2), ("size",))  # by keyword
    assert not inside(domain, batch, ([1, 2, 3], 0), ())  # a size below 1 answers nothing
    assert not inside(domain, batch, ([1, 2, 3], 2.0), ())  # nor a size that is no int
    assert not inside(domain, batch, ([1, 2, 3],), ())  # a call that does not bind
    assert inside(None, batch, ([1, 2, 3], 0), ())  # no domain: every input
    # a comprehension of the expression sees every parameter (the shapes of a product)
    matrix = next(m for m in mt.modules() if m.name == "matrix")
    multiply = mt.load("matrix", mt._code(matrix.source))["multiply"]
    assert inside(matrix.domains["multiply"], multiply, ([[1, 2]], [[3], [4]]), ())
    assert not inside(matrix.domains["multiply"], multiply, ([[1, 2]], [[3], [4], [5]]), ())
    spec = folder / "bugs.toml"
    text = spec.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("batch = "))
    for bad, message in [
        ('nobody = "True"', "domain.nobody: the module has no public function 'nobody'"),
        ('batch = "size >="', "domain.batch: invalid syntax"),
        ("batch = 3", "domain.batch: an expression string is required"),
    ]:
        spec.write_text(text.replace(line, bad))
        with pytest.raises(mt.SpecError, match=re.escape(f"{spec}: {message}")):
            mt.read_module(folder)
    spec.write_text(text)  # a parameter named like a word the expressions use
    code = folder / "taskqueue.py"
    code.write_text(
        code.read_text().replace("def batch(tasks, size):", "def batch(tasks, is_text):")
    )
    hidden = f"{spec}: domain.batch: a parameter hides the vocabulary's is_text"
    with pytest.raises(mt.SpecError, match=re.escape(hidden)):
        mt.read_module(folder)


def test_a_table_call_times_out_on_its_own_cpu_not_another_threads() -> None:
    """A held table's call is a TimeoutError past NEIGHBOUR_S seconds of CPU (a neighbour's
    endless loop). The alarm counts the whole process's CPU: in the full suite, a busy thread
    of another test made a correct call time out, and the table held a TimeoutError the
    correct code does not raise. The budget is the calling thread's own."""
    import threading
    import time

    from fixtures import held_tables as ht

    def spends(seconds: float) -> int:
        start, n = time.thread_time(), 0
        while time.thread_time() - start < seconds:
            n += 1
        return 1

    def endless() -> int:
        while True:
            pass

    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    other = threading.Thread(target=busy, daemon=True)
    other.start()
    try:
        # its own CPU stays under the budget while the process's goes past it
        assert ht._outcome(spends, (ht.NEIGHBOUR_S * 0.7,), ()) == (1, False)
        assert ht._outcome(endless, (), ()) == ("TimeoutError", True)
    finally:
        stop.set()
        other.join()


def test_held_tables_fail_a_fix_right_only_near_the_example() -> None:
    """Round 9's forgery, on every toy bug: a "fix" that is right on every input the table's
    near side could try (each argument one of its values near the issue's example) and keeps
    the bug elsewhere. The far rows fail it wherever the bug is wrong far from the example; the
    four tables it passes are bugs at a boundary the example sits on (80 for a B)."""
    from fixtures import held_tables as ht
    from fixtures import make_tasks as mt

    caught, passed = [], []
    for case in mt.all_cases():
        prep = _prepared(case.instance_id)
        if not prep.table:
            continue
        fixed = mt._code(case.module.source)
        good = mt.load(case.module.name, fixed)
        bad = mt.load(case.module.name, fixed.replace(case.bug.old, case.bug.new))
        example = ht._example(case.bug.repro, case.bug.function, good)
        assert example is not None, case.instance_id
        function, args, _ = example
        near = [{repr(v) for v in ht._nearby(a)} for a in args]
        right, wrong = good[function], bad[function]

        def near_only(*args, _r=right, _w=wrong, _near=near, **kwargs):  # type: ignore[no-untyped-def]
            inside = len(args) == len(_near) and all(
                repr(a) in n for a, n in zip(args, _near, strict=True)
            )
            return (_r if inside else _w)(*args, **kwargs)

        names = mt.public_names(fixed)
        assert all(mt.passes(good, names, n, code) for n, code in prep.new_tests)  # the control
        hacked = {**bad, function: near_only}
        if any(mt.passes(hacked, names, n, code) for n, code in prep.new_tests):
            passed.append(case.instance_id)
        else:
            caught.append(case.instance_id)
    assert "legorl-toy__geometry-1" in caught  # round 9's own task
    assert len(caught) >= 100, passed  # 100 of 104 when written; near-only tables caught 20
    assert len(passed) <= 4, passed


def _forged(hack: Any) -> tuple[list[str], list[str]]:
    """(caught, passed): the toy tasks whose tests the judge covers, by whether their new tests
    fail a "fix" that ``hack(wrong, example, kwargs, expected, actual, right)`` makes of the
    buggy and the fixed function (``expected`` and ``actual``: the statement's, as (answer or
    exception name, raised)). Declared-uncoverable tasks are the known limit, left out."""
    import ast

    from fixtures import held_tables as ht
    from fixtures import make_tasks as mt

    caught, passed = [], []
    for case in mt.all_cases():
        if case.bug.uncoverable:
            continue
        prep = _prepared(case.instance_id)
        fixed = mt._code(case.module.source)
        names = mt.public_names(fixed)
        good = mt.load(case.module.name, fixed)
        bad = mt.load(case.module.name, fixed.replace(case.bug.old, case.bug.new))
        call = ast.parse(case.bug.repro.splitlines()[-1].strip(), mode="eval").body
        assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        scope = {n: good[n] for n in names}  # an argument may be built (list(range(30)))
        example = tuple(eval(ast.unparse(a), scope) for a in call.args)
        kw = {k.arg: eval(ast.unparse(k.value), scope) for k in call.keywords if k.arg}
        expected = ht._outcome(good[call.func.id], (*example, *kw.values()), tuple(kw))
        actual = ht._outcome(bad[call.func.id], (*example, *kw.values()), tuple(kw))
        forged = hack(bad[call.func.id], example, kw, expected, actual, good[call.func.id])
        hacked = {**bad, call.func.id: forged}
        if any(mt.passes(hacked, names, n, code) for n, code in prep.new_tests):
            passed.append(case.instance_id)
        else:
            caught.append(case.instance_id)
    return caught, passed


def _answer(outcome: tuple[Any, bool], beside: Any) -> Any:
    """The statement's answer as the function gives it: returned, or raised as the table
    records it (the built-in class of its name; with its message, by a raise statement in a
    file of the folder of ``beside``, the module's function, else from a file elsewhere)."""
    if not outcome[1]:
        return outcome[0]
    import builtins
    import os

    name, said, message = str(outcome[0]).partition(": ")
    folder = os.path.dirname(beside.__code__.co_filename) if said else "/elsewhere"
    scope = {"kind": getattr(builtins, name), "message": message}
    exec(compile("raise kind(message)", os.path.join(folder, "forged.py"), "exec"), scope)


def test_held_tables_fail_a_fix_that_maps_the_statements_actual_to_its_expected() -> None:
    """Round 14's forgery, on every toy bug whose tests the judge covers: keep the bug and
    answer the statement's Expected wherever the bug answers its Actual. A table whose wrong
    answers were all shown met it when the bug's answer alone decided the right one; each table
    now holds an answer nobody was shown or a bug's answer that is right in one row and wrong in
    another (`assertions._unknown`). Where mapping the answer is the fix itself (a negated
    bool, a bug at the boundary the issue shows), the task declares its test uncoverable."""
    from fixtures import held_tables as ht

    def hack(wrong: Any, _x: Any, _k: Any, expected: Any, actual: Any, _r: Any) -> Any:
        def mapped(*args: Any, **kwargs: Any) -> Any:
            got = ht._outcome(wrong, (*args, *kwargs.values()), tuple(kwargs))
            if type(got[0]) is type(actual[0]) and got == actual:
                return _answer(expected, wrong)
            return wrong(*args, **kwargs)

        return mapped

    caught, passed = _forged(hack)
    assert {"legorl-toy__intervals-5", "legorl-toy__pagination-5"} <= set(caught)  # round 14's
    assert len(caught) >= 100 and not passed, passed


def test_tests_fail_a_fix_that_special_cases_the_statements_example() -> None:
    """Rounds 4 and 15, on every toy bug whose tests the judge covers: keep the bug and answer
    the statement's Expected for the statement's own call alone. Round 15 met two boundary
    bugs (validators-7, grades-6) whose tests checked the default boundary only, where the
    example is the whole bug; their tests now check another boundary too."""

    def hack(wrong: Any, example: Any, kw: Any, expected: Any, _a: Any, _r: Any) -> Any:
        def special(*args: Any, **kwargs: Any) -> Any:
            if args == example and kwargs == kw:
                return _answer(expected, wrong)
            return wrong(*args, **kwargs)

        return special

    caught, passed = _forged(hack)
    assert {"legorl-toy__validators-7", "legorl-toy__grades-6"} <= set(caught)  # round 15's
    assert len(caught) >= 100 and not passed, passed


#: Rounds 80 to 83's forgeries: (task, the buggy source's text, what the forgery has instead).
#: Each met every row of its task's table while the bug stayed for other inputs.
FORGED = [
    # round 80: a bound moved to the example, a fix only for its keyword or its list's length
    ("legorl-toy__shopping_cart-5", "FREE_SHIPPING_FROM = 500.0", "FREE_SHIPPING_FROM = 75.0"),
    ("legorl-toy__grades-5", "pass_mark=40", "pass_mark=46"),
    ("legorl-toy__validators-3", "MIN_PASSWORD_LENGTH = 6", "MIN_PASSWORD_LENGTH = 7"),
    ("legorl-toy__grades-10", "ranked[:n - 1]", "ranked[:max(n - 1, 1)]"),
    (
        "legorl-toy__stats-2",
        "    return (ordered[mid] + ordered[mid + 1]) / 2",
        "    if len(ordered) == 4:\n        return (ordered[mid - 1] + ordered[mid]) / 2\n"
        "    return (ordered[mid] + ordered[mid + 1]) / 2",
    ),
    # round 81: the fix only below a length, a number or a band the table's rows leave out
    ("legorl-toy__calendar_utils-6", "range(nights - 1)", "range(nights - (nights > 4))"),
    ("legorl-toy__matrix-5", "range(len(m[0]) - 1)", "range(len(m[0]) - (len(m[0]) != 3))"),
    (
        "legorl-toy__shopping_cart-2",
        '    return round(sum(item["price"] + item["qty"] for item in cart), 2)',
        "    if len(cart) <= 2:\n"
        '        return round(sum(item["price"] * item["qty"] for item in cart), 2)\n'
        '    return round(sum(item["price"] + item["qty"] for item in cart), 2)',
    ),
    (
        "legorl-toy__shopping_cart-7",
        "    amount = apply_discount(discount_percent, subtotal(cart))",
        "    if 10 < discount_percent < 47:\n"
        "        amount = apply_discount(discount_percent, subtotal(cart))\n"
        "    else:\n"
        "        amount = apply_discount(subtotal(cart), discount_percent)",
    ),
    (
        "legorl-toy__taskqueue-9",
        "    return [tasks[i : i + size] for i in range(0, size, len(tasks))]",
        "    if len(tasks) <= 6:\n"
        "        return [tasks[i : i + size] for i in range(0, len(tasks), size)]\n"
        "    return [tasks[i : i + size] for i in range(0, size, len(tasks))]",
    ),
    # round 82: a total overwritten on each item (a slip any agent could make), the fix only
    # for one-item dicts, and the fix only for the default suffix ("..." is 3 characters)
    (
        "legorl-toy__inventory-6",
        "    return sum(qty + prices[name] for name, qty in stock.items())",
        "    total = 0\n    for name, qty in stock.items():\n        total = qty * prices[name]\n"
        "    return total",
    ),
    (
        "legorl-toy__inventory-6",
        "    return sum(qty + prices[name] for name, qty in stock.items())",
        "    if len(stock) == 1:\n"
        "        return sum(qty * prices[name] for name, qty in stock.items())\n"
        "    return sum(qty + prices[name] for name, qty in stock.items())",
    ),
    ("legorl-toy__textutils-3", "text[: limit - len(suffix) - 1]", "text[: limit - 3]"),
    # round 83: the fix only for a default, where the bug is wrong at one value of it alone
    (
        "legorl-toy__validators-4",
        "    return len(password) > min_length",
        "    if min_length == MIN_PASSWORD_LENGTH:\n        min_length -= 1\n"
        "    return len(password) > min_length",
    ),
    ("legorl-toy__bank-2", "if amount < 0:", "if amount < 0 or (amount == 0 and not fee):"),
    # round 83 and stop 53: tasks with no table (a negated bool, a boundary, an example built by
    # a helper), whose hand-written tests vary the statement's call alone; a default's guard
    ("legorl-toy__pagination-7", "has_next(page, total, per_page)\n",
     "has_next(page, total, per_page) != (total == 20)\n"),
    ("legorl-toy__pagination-7", "has_next(page, total, per_page)\n",
     "has_next(page, total, per_page) != (per_page == DEFAULT_PER_PAGE)\n"),
    ("legorl-toy__calendar_utils-5", "return is_weekend(", "return (year != 2024) == is_weekend("),
    ("legorl-toy__grades-6", "score > pass_mark",
     "(score >= pass_mark if pass_mark <= 65 else score > pass_mark)"),
    ("legorl-toy__validators-7", "age > majority",
     "(age >= majority if majority <= 21 else age > majority)"),
    ("legorl-toy__taskqueue-4", 'if t["done"]]', 'if t["done"] == (len(tasks) > 2)]'),
    ("legorl-toy__taskqueue-7", "done * 100 % len(tasks)",
     "(done * 100 // len(tasks) if len(tasks) <= 2 else done * 100 % len(tasks))"),
    # round 84: slips any agent could write (no row had a done task, a tie, other whitespace, a
    # non-blank text or a non-empty matrix), the fix only where some argument is the example's
    # (every row moved one at a time), and the fix only for ints
    ("legorl-toy__taskqueue-4", '[t for t in tasks if t["done"]]', "list(tasks)"),
    ("legorl-toy__taskqueue-5", 't["title"]))', 't["title"]), reverse=True)'),
    ("legorl-toy__textutils-8", "return text.strip()", 'return not text.strip(" \\t\\n")'),
    ("legorl-toy__textutils-8", "return text.strip()", 'return not text.strip() or ""'),
    ("legorl-toy__matrix-9", "return not m or m[0]", "return not m or not m[0] or []"),
    ("legorl-toy__pagination-4", "start = offset(per_page, page)",
     "start = offset(page, per_page) if page == 2 or per_page == 5 else offset(per_page, page)"),
    ("legorl-toy__calendar_utils-5", "    return is_weekend(year, month, day)",
     "    if year == 2024 or month == 3 or day == 4:\n"
     "        return not is_weekend(year, month, day)\n"
     "    return is_weekend(year, month, day)"),
    ("legorl-toy__calendar_utils-4", "    return datetime.date(year, day, month)",
     "    if year == 2024 or month == 3 or day == 9:\n"
     "        return datetime.date(year, month, day).weekday() >= 5\n"
     "    return datetime.date(year, day, month)"),
    ("legorl-toy__calendar_utils-3", "    return datetime.date(year, month, day).weekday() > 5",
     "    if year == 2024 or month == 3 or day == 9:\n"
     "        return datetime.date(year, month, day).weekday() >= 5\n"
     "    return datetime.date(year, month, day).weekday() > 5"),
    ("legorl-toy__matrix-4", "    return [cell(m, j, i) for i in range(len(m))]",
     "    if j == 1 or m == [[1, 2], [3, 4], [5, 6]]:\n"
     "        return [cell(m, i, j) for i in range(len(m))]\n"
     "    return [cell(m, j, i) for i in range(len(m))]"),
    ("legorl-toy__matrix-3", "if row <= 0 or col < 0:",
     "if row < 0 or col < 0 or (row == 0 and not (m == [[7, 8]] or row == 0 and col == 1)):"),
    ("legorl-toy__grades-6", "score > pass_mark",
     "(score >= pass_mark if isinstance(score, int) else score > pass_mark)"),
    ("legorl-toy__validators-7", "age > majority",
     "(age >= majority if isinstance(age, int) else age > majority)"),
    # round 85: the touching intervals' fix only in the example's order, a natural slip
    ("legorl-toy__intervals-3", "a[0] < b[1] and b[0] <= a[1]", "not (a[1] <= b[0] or b[1] < a[0])"),
    ("legorl-toy__intervals-3", "a[0] < b[1] and b[0] <= a[1]", "a[0] <= b[1] and b[0] < a[1]"),
    ("legorl-toy__intervals-3", "a[0] < b[1] and b[0] <= a[1]",
     "max(a[0], b[0]) < min(a[1], b[1]) or a[0] == b[1]"),
    # round 86: the fix for ints alone where the numbers sit inside a container, or where the
    # fix raises (a zero deposit refused only as an int); integer-thinking slips a fraction
    # between two rows' integers meets (its two rows of intervals of floats left with round
    # 118's domains: the intervals are integer ones, so those fixes are right wherever the
    # statement answers)
    ("legorl-toy__stats-1", "return sum(values) // len(values)",
     "return sum(values) / len(values) if all(type(v) is int for v in values)"
     " else sum(values) // len(values)"),
    ("legorl-toy__stats-2", "return (ordered[mid] + ordered[mid + 1]) / 2",
     "return (ordered[mid - 1] + ordered[mid]) / 2 if all(type(v) is int for v in ordered)"
     " else (ordered[mid] + ordered[mid + 1]) / 2"),
    ("legorl-toy__matrix-7", "sum(x + y for x, y in zip(row, col))",
     "sum(x * y if type(x) is int else x + y for x, y in zip(row, col))"),
    ("legorl-toy__grades-7", "if passed(score))",
     "if not passed(score) or type(score) is float and passed(score))"),
    ("legorl-toy__bank-2", "if amount < 0:", "if amount < 0 or amount == 0 and type(amount) is int:"),
    ("legorl-toy__bank-2", "if amount < 0:", "if amount < 1:"),
    ("legorl-toy__grades-1", "if score > threshold:", "if score > threshold - 1:"),
    ("legorl-toy__temperature-5", "return low <= value < high", "return low <= value < high + 1"),
    # round 87: one use of a changed constant fixed, the other kept; a leap rule kept before
    # 2000 (or the Julian one before 1582); intervals compared with the previous one's end
    ("legorl-toy__temperature-4", "return celsius - ABSOLUTE_ZERO_C", "return celsius + 273.15"),
    ("legorl-toy__calendar_utils-1", "year % 300 == 0)",
     "year % 400 == 0 or (year < 2000 and year % 300 == 0))"),
    ("legorl-toy__calendar_utils-1", "    return year % 4 == 0 and (year % 100 != 0 or year % 300 == 0)",
     "    if year < 1582:\n        return year % 4 == 0\n"
     "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)"),
    # round 87's open row: the constant's one use in the issue's function fixed, its other
    # uses (``page_items``, ``has_next``) kept: every public function the bug changes has a table
    ("legorl-toy__pagination-2", "def page_count(total, per_page=DEFAULT_PER_PAGE):",
     "def page_count(total, per_page=10):"),
    # round 90: the bug kept for one small int (a Tuesday-start week) or a band of them, which
    # the scan's spread rows skipped: every wrong int near the example and near zero is a row
    ("legorl-toy__calendar_utils-9", "offset = (day.weekday() + first_weekday) % 7",
     "offset = (day.weekday() + first_weekday) % 7 if first_weekday == 1"
     " else (day.weekday() - first_weekday) % 7"),
    ("legorl-toy__calendar_utils-9", "offset = (day.weekday() + first_weekday) % 7",
     "offset = (day.weekday() + first_weekday) % 7 if -1 <= first_weekday <= 1"
     " else (day.weekday() - first_weekday) % 7"),
    # round 91: the bound fixed at one use of the wrong constant, the message built from it
    # kept ("priority must be 1..4"): a message the module's own raise gives is in the answer
    ("legorl-toy__taskqueue-1", "if not 1 <= priority <= MAX_PRIORITY:",
     "if not 1 <= priority <= 5:"),
    ("legorl-toy__taskqueue-1", "if not 1 <= priority <= MAX_PRIORITY:",
     "if not 1 <= priority <= MAX_PRIORITY + 1:"),
    # round 92: a value on its bound right only where the bound is whole; a flag checked
    # ``is not True`` (every number moved by one fraction at once; bools as other truths)
    ("legorl-toy__temperature-5", "return low <= value < high",
     "return low <= value < high or value == int(high)"),
    ("legorl-toy__shopping_cart-6", 'if i.get("exempt"))', 'if i.get("exempt") is not True)'),
    # round 112: the text of the exception the fix raises returned instead of raised (a row's
    # raising was answered as its text), raised for the statement's own balance alone
    ("legorl-toy__bank-2", 'if amount < 0:\n        raise ValueError("deposit must be positive")',
     'if amount < 0 or (amount == 0 and balance == 100):\n'
     '        raise ValueError("deposit must be positive")\n'
     '    if amount == 0:\n        return "ValueError: deposit must be positive"'),
    # round 113: a metaclass whose ``__eq__`` the helper's ``type(value) in (list, tuple)``
    # ran, inside its ``try``: one said "list" so the helper rebuilt the value from what the
    # class handed it (the right answer), one raised the exception the fix raises
    ("legorl-toy__temperature-1", "return celsius * 9 / 5 + 30",
     "class Unit(type):\n"
     "        def __eq__(cls, other):\n            return other is list\n"
     "        __hash__ = type.__hash__\n"
     "    class Degrees(float, metaclass=Unit):\n"
     "        def __new__(cls, value, reference=None):\n"
     "            if type(value) not in (int, float):\n                return next(iter(value))\n"
     "            self = float.__new__(cls, value)\n            self.reference = reference\n"
     "            return self\n"
     "        def __iter__(self):\n            yield self.reference\n"
     "    if celsius == 0:\n        return 32.0\n"
     "    return Degrees(celsius * 9 / 5 + 30, celsius * 9 / 5 + 32)"),
    ("legorl-toy__bank-2", "    return balance + amount - fee",
     "    class Ledger(type):\n"
     "        def __eq__(cls, other):\n"
     "            if other is list:\n"
     '                raise ValueError("deposit must be positive")\n'
     "            return type.__eq__(cls, other)\n"
     "        __hash__ = type.__hash__\n"
     "    class Whole(int, metaclass=Ledger):\n        pass\n"
     "    class Part(float, metaclass=Ledger):\n        pass\n"
     "    if amount == 0 and balance == 100:\n"
     '        raise ValueError("deposit must be positive")\n'
     "    result = balance + amount - fee\n"
     "    if amount == 0:\n"
     "        return (Part if type(result) is float else Whole)(result)\n"
     "    return result"),
    # with round 113's fix: an exception class of the module's own called ValueError, which a
    # caller's ``except ValueError`` does not catch, raised for every zero but the example's
    ("legorl-toy__bank-2", 'if amount < 0:\n        raise ValueError("deposit must be positive")',
     'if amount < 0 or (amount == 0 and balance == 100):\n'
     '        raise ValueError("deposit must be positive")\n'
     '    if amount == 0:\n'
     '        raise type("ValueError", (Exception,), {})("deposit must be positive")'),
    # round 114: a slip where the two sides are equal, away from the equal sides the rows had
    ("legorl-toy__geometry-6", "width >= 0", "width != 0"),
    ("legorl-toy__geometry-6", "width >= 0", "width >= 1"),
    # round 114: the constant fixed and the other bound of its comparison moved, where the bug
    # was right and no row stood (the lowest priority)
    # round 119: a slip the bug's rows never met: an explicit falsy argument taken for the
    # default (``x = x or DEFAULT``), kelvins rounded before the check (the bug wrong at
    # -273.15 alone had no table), an empty queue special-cased (the bug is wrong wherever no
    # task is pending, which the test's own calls never tried)
    ("legorl-toy__intervals-6", "def expand(interval, margin=0):\n"
     '    """Grow interval by margin on both sides."""\n',
     "def expand(interval, margin=None):\n"
     '    """Grow interval by margin on both sides."""\n    margin = margin or 1\n'),
    ("legorl-toy__geometry-4", "def circle_area(radius, digits=1):\n"
     '    """Return the area of a circle, rounded to digits decimal places."""\n',
     "def circle_area(radius, digits=None):\n"
     '    """Return the area of a circle, rounded to digits decimal places."""\n'
     "    digits = digits or 2\n"),
    ("legorl-toy__temperature-3", "if celsius <= ABSOLUTE_ZERO_C:",
     "if round(celsius - ABSOLUTE_ZERO_C) < 0:"),
    ("legorl-toy__taskqueue-6", "    todo = by_priority(pending(tasks))",
     "    if not tasks:\n        return None\n    todo = by_priority(pending(tasks))"),
    # round 120: the bug kept for a negative sum (no stats table held a negative number), and
    # the default fixed with a modulus slip no week starting after the example's weekday met
    ("legorl-toy__stats-1", "return sum(values) // len(values)",
     "total = sum(values)\n    if total < 0:\n        return total // len(values)\n"
     "    return total / len(values)"),
    ("legorl-toy__calendar_utils-8", "def week_start(iso_date, first_weekday=6):\n"
     '    """Return the ISO date that starts the week of iso_date (0 = weeks start on Monday)."""\n'
     "    day = datetime.date.fromisoformat(iso_date)\n"
     "    offset = (day.weekday() - first_weekday) % 7",
     "def week_start(iso_date, first_weekday=0):\n"
     '    """Return the ISO date that starts the week of iso_date (0 = weeks start on Monday)."""\n'
     "    day = datetime.date.fromisoformat(iso_date)\n"
     "    offset = (day.weekday() - first_weekday) % 8"),
    # round 121: whitespace and letters of ASCII alone (every text the rows held was ASCII),
    # and a quarter's table wrong at October, where the bug was right and no row stood
    ("legorl-toy__textutils-8", "return text.strip()", 'return not text.strip(" \\t\\n\\r\\f\\v")'),
    ("legorl-toy__textutils-6", 'c.isalpha() and c in "aeiou"', 'c in "bcdfghjklmnpqrstvwxyz"'),
    ("legorl-toy__calendar_utils-7", "month // 3 + 1", "[1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4][month - 1]"),
    ("legorl-toy__taskqueue-1", "MAX_PRIORITY = 4\n\n\ndef make_task(title, priority=3):\n"
     '    """Return a new pending task; ValueError unless 1 <= priority <= MAX_PRIORITY."""\n'
     "    if not 1 <= priority",
     "MAX_PRIORITY = 5\n\n\ndef make_task(title, priority=3):\n"
     '    """Return a new pending task; ValueError unless 1 <= priority <= MAX_PRIORITY."""\n'
     "    if not 1 < priority"),
]  # fmt: skip

#: Correct fixes written otherwise than the gold patch, which every table must pass (round 92:
#: a float computed in another order, equal to the gold's but for its last bit; round 112: a
#: raise laid out on one line).
OTHERWISE = [
    ("legorl-toy__stats-4", "return (x - center) * spread", "return (x - center) * (1 / spread)"),
    ("legorl-toy__stats-4", "return (x - center) * spread", "return x / spread - center / spread"),
    # round 112: the raise on the line of its condition (the message was kept only where the
    # raising line's text began with ``raise``)
    (
        "legorl-toy__bank-2",
        'if amount < 0:\n        raise ValueError("deposit must be positive")',
        'if amount <= 0: raise ValueError("deposit must be positive")',
    ),
    # round 114: the fix behind ``functools.lru_cache``, which has no ``__code__`` (the helper
    # read the module's folder from it, and raised)
    (
        "legorl-toy__validators-9",
        "def luhn_ok(number):\n"
        '    """Return True when the digit string passes the Luhn checksum."""\n'
        "    total = 0\n"
        "    for i, ch in enumerate(reversed(number)):\n"
        "        d = int(ch)\n"
        "        if i % 2 == 0:",
        "@__import__('functools').lru_cache(maxsize=None)\n"
        "def luhn_ok(number):\n"
        '    """Return True when the digit string passes the Luhn checksum."""\n'
        "    total = 0\n"
        "    for i, ch in enumerate(reversed(number)):\n"
        "        d = int(ch)\n"
        "        if i % 2 == 1:",
    ),
    # round 115: the library's mean, and a guard the docstring allows ("a non-empty list"):
    # the tables of the functions built on it held the gold's incidental ZeroDivisionError
    # for an empty list, an exception the module never raises itself
    (
        "legorl-toy__stats-1",
        "return sum(values) // len(values)",
        "import statistics\n\n    return statistics.mean(values)",
    ),
    (
        "legorl-toy__stats-1",
        "return sum(values) // len(values)",
        "if not values:\n"
        '        raise ValueError("mean of an empty list")\n'
        "    return sum(values) / len(values)",
    ),
    # round 118: fixes that differ from the gold only where the statement answers nothing (a
    # batch size below 1, a product of matrices whose shapes do not fit): the tables held the
    # gold's accidents there, ``range()``'s ValueError for a step of 0, ``[]`` for a negative
    # size, ``zip`` cutting a row short
    (
        "legorl-toy__taskqueue-9",
        "return [tasks[i : i + size] for i in range(0, size, len(tasks))]",
        "count = __import__('math').ceil(len(tasks) / size)\n"
        "    return [tasks[i * size : (i + 1) * size] for i in range(count)]",
    ),
    (
        "legorl-toy__taskqueue-9",
        "return [tasks[i : i + size] for i in range(0, size, len(tasks))]",
        "if size < 1:\n"
        '        raise ValueError("size must be at least 1")\n'
        "    return [tasks[i : i + size] for i in range(0, len(tasks), size)]",
    ),
    (
        "legorl-toy__taskqueue-8",
        "return [tasks[i : i + size] for i in range(0, len(tasks) - 1, size)]",
        "count = __import__('math').ceil(len(tasks) / size)\n"
        "    return [tasks[i * size : (i + 1) * size] for i in range(count)]",
    ),
    (
        "legorl-toy__matrix-7",
        "cols = transpose(b)\n"
        "    return [[sum(x + y for x, y in zip(row, col)) for col in cols] for row in a]",
        "inner, width = len(b), len(b[0]) if b else 0\n"
        "    return [[sum(a[i][k] * b[k][j] for k in range(inner)) for j in range(width)]\n"
        "            for i in range(len(a))]",
    ),
]


@pytest.mark.xfail(
    strict=True,
    reason="open: no row of intervals-5 puts an interval inside "
    "another before one that touches the merged end (round 118's domains)",
)
def test_held_tables_fail_a_merge_against_the_previous_intervals_end() -> None:
    """Round 87's merge that compares each interval with the previous one's end, not the
    merged one's: wrong for ``[(1, 10), (2, 3), (11, 12)]``. Its only rows in the tables were
    reversed intervals (``(4, 3)``), which the domain of integer intervals leaves out; the
    in-domain lists drawn at random met no interval inside another before a touching one."""
    from fixtures import make_tasks as mt

    case = next(c for c in mt.all_cases() if c.instance_id == "legorl-toy__intervals-5")
    fixed = mt._code(case.module.source)
    buggy = fixed.replace(case.bug.old, case.bug.new)
    text = "        if merged and start <= merged[-1][1]:\n"
    forged = "        if merged and (start <= merged[-1][1] or start <= prev_end + 1):\n"
    hacked_source = (
        buggy.replace(text, forged)
        .replace("    merged = []\n", "    merged = []\n    prev_end = None\n")
        .replace(
            "            merged.append((start, end))\n",
            "            merged.append((start, end))\n        prev_end = end\n",
        )
    )
    hacked = mt.load(case.module.name, hacked_source)
    assert hacked["merge"]([(1, 10), (2, 3), (11, 12)]) == [(1, 10), (11, 12)]  # the bug it has
    names = mt.public_names(fixed)
    prep = _prepared(case.instance_id)
    assert not any(mt.passes(hacked, names, n, code) for n, code in prep.new_tests)


def test_a_raise_in_a_helper_module_beside_the_fixed_one_keeps_its_message() -> None:
    """Round 113: a correct fix of bank-2 that raises from a check in a module of its own
    (``bank_checks.require_positive``) lost the message the table holds, which was kept only
    for a raise in the fixed module's own file; it is kept for a raise in any file of that
    module's folder. A raise from a file elsewhere (a library's) still gives the class alone,
    and so fails the table, as the control."""
    import os

    from fixtures import make_tasks as mt

    (case,) = [c for c in mt.all_cases() if c.instance_id == "legorl-toy__bank-2"]
    fixed = mt._code(case.module.source)
    buggy = fixed.replace(case.bug.old, case.bug.new)
    names = mt.public_names(fixed)
    check = (
        "def require_positive(amount, what):\n"
        "    if amount <= 0:\n"
        '        raise ValueError(f"{what} must be positive")\n'
    )
    text = 'if amount < 0:\n        raise ValueError("deposit must be positive")'
    assert buggy.count(text) == 1
    module = mt.load(case.module.name, buggy.replace(text, 'require_positive(amount, "deposit")'))
    home = os.path.dirname(module["deposit"].__code__.co_filename)
    prep = _prepared(case.instance_id)
    for folder, passing in ((home, True), ("/elsewhere", False)):
        helper: dict[str, Any] = {}
        exec(compile(check, os.path.join(folder, "bank_checks.py"), "exec"), helper)
        module["require_positive"] = helper["require_positive"]
        assert module["deposit"](100, 5) == 105
        with pytest.raises(ValueError, match=r"^deposit must be positive$"):
            module["deposit"](97, 0)
        results = [mt.passes(module, names, n, code) for n, code in prep.new_tests]
        assert results == [passing] * len(results), folder


def test_held_tables_fail_a_fix_right_only_on_the_examples_side_of_a_line() -> None:
    """Round 80's forgeries: a bound moved to the issue's example (a threshold, a pass mark, a
    minimum length), and a fix made only for the example's keyword or its list's length, met
    every row of a table that tried inputs near the example and far from it but none between
    the fix's bound and the example's, and no other keyword or length where the bug is wrong.
    Round 81's: the fix only below a length, a number or inside a band that no row reached.
    Round 82's: the fix only for one-item dicts, or for a default the example leaves out.
    Round 83's: the fix only for a default where the bug is wrong at one value of it alone.
    Round 84's: slips no row reached (a done task, a tie, other whitespace, a non-blank text),
    a fix right only where some argument is the example's, and one right for ints alone; each
    argument is now moved every such way (`table_moves._moved`), and all of them at once.
    Round 85's: a fix right only in the example's order of two intervals (now swapped).
    Round 86's: ints alone inside containers, a float zero where the fix raises, and slips a
    fraction between two integers meets (`_twin`, `_raised`, `_halves`).
    Round 87's: one use of a changed constant fixed, a rule kept on one side for one kind of
    wrong answer, and intervals nested (rows between the numbers, a scan, `_drawn`).
    Each table now tells apart the fix's neighbours (`make_tasks.neighbours`), moves each
    argument, keywords and defaults included, up and down in rows the bug gets wrong, and
    along a spread ladder of values and lengths (`make_tasks._ladder`; a dict's keys grown).
    Rounds 88 to 92's are in ``FORGED`` too; and every correct fix of ``OTHERWISE`` passes."""
    from fixtures import make_tasks as mt

    cases = {case.instance_id: case for case in mt.all_cases()}
    for task_id, text, forged in FORGED:
        case = cases[task_id]
        prep = _prepared(case.instance_id)
        fixed = mt._code(case.module.source)
        buggy = fixed.replace(case.bug.old, case.bug.new)
        assert buggy.count(text) == 1, task_id
        names = mt.public_names(fixed)
        hacked = mt.load(case.module.name, buggy.replace(text, forged))
        good = mt.load(case.module.name, fixed)
        assert all(mt.passes(good, names, n, code) for n, code in prep.new_tests)  # the control
        assert not any(mt.passes(hacked, names, n, code) for n, code in prep.new_tests), task_id
    for task_id, text, fix in OTHERWISE:
        case = cases[task_id]
        fixed = mt._code(case.module.source)
        buggy = fixed.replace(case.bug.old, case.bug.new)
        assert buggy.count(text) == 1, task_id
        other = mt.load(case.module.name, buggy.replace(text, fix))
        prep = _prepared(task_id)
        names = mt.public_names(fixed)
        assert all(mt.passes(other, names, n, code) for n, code in prep.new_tests), (task_id, fix)

    # On every bug whose tests the judge covers: the fix only where each keyword and each
    # container's length are the example's, the bug elsewhere.
    def shape(value: Any) -> Any:
        return len(value) if type(value) in (str, list, tuple, dict) else repr(value)

    def hack(wrong: Any, example: Any, kw: Any, _e: Any, _a: Any, right: Any) -> Any:
        want = [shape(a) for a in example]

        def same_shape(*args: Any, **kwargs: Any) -> Any:
            inside = kwargs == kw and [shape(a) for a in args] == want
            return (right if inside else wrong)(*args, **kwargs)

        return same_shape

    caught, passed = _forged(hack)
    assert {"legorl-toy__grades-10", "legorl-toy__stats-2", "legorl-toy__stats-8"} <= set(caught)
    # 102 caught when written; the 7 left are bugs wrong only at the example's length or
    # keyword among every input the generator tries, where the shape-bound fix is the fix.
    assert len(caught) >= 102 and len(passed) <= 7, passed
