"""The runner's parts without Docker: the bootstrap and the independent runner as real
subprocesses on a small repository in a temporary folder, and the static scans of patch text.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.records import Task, read_jsonl
from legorl.verify.parsers import PytestReportParser, records
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects

VERIFY = ROOT / "src" / "legorl" / "verify"


def _repo(tmp: Path, files: dict[str, str]) -> tuple[Path, Path]:
    repo, grade = tmp / "repo", tmp / "grade"
    grade.mkdir()
    for name in ("bootstrap.py", "pytest_report.py", "plainrun.py"):
        shutil.copy(VERIFY / name, grade / name)
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(textwrap.dedent(text))
    return repo, grade


def _boot(repo: Path, grade: Path, mode: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-B", str(grade / "bootstrap.py"), mode, "fd", *args],
        cwd=repo,
        input=b"k3y\n",
        capture_output=True,
        timeout=120,
    )


LIB = {
    "lib.py": "def area(w, h):\n    return w * h\n",
    "tests/test_lib.py": """
        import unittest

        import pytest
        from lib import area

        def test_area():
            assert area(3, 5) == 15

        def test_area_approx():
            assert area(0.1, 3) == pytest.approx(0.3)

        def test_wrong():
            assert area(3, 5) == 8

        def test_fixture(tmp_path):
            assert area(1, 1) == 1

        @pytest.mark.parametrize("n", [1, 2])
        def test_many(n):
            assert area(n, 1) == n

        class TestCase(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                cls.side = 2

            def test_eq(self):
                self.assertEqual(area(self.side, 2), 4)

        def setup_module(module):
            module.READY = True

        class TestPlain:
            def setup_method(self, method):
                self.w = 3 if READY else 0

            def test_method(self):
                assert area(self.w, 5) == 15
    """,
}


def test_a_root_pytest_module_does_not_run_and_is_named(tmp_path: Path) -> None:
    repo, grade = _repo(tmp_path, {**LIB, "pytest.py": "raise SystemExit('the fake ran')\n"})
    proc = _boot(repo, grade, "pytest", "--", "-q", "-p", "no:cacheprovider", "tests")
    results = PytestReportParser().parse(proc.stdout, b"k3y")
    assert b"the fake ran" not in proc.stdout + proc.stderr
    assert results.finished and results.shadowed == ["pytest"]
    assert results.outcomes["tests/test_lib.py::test_area"] == "passed"
    assert results.outcomes["tests/test_lib.py::test_wrong"] == "failed"
    assert proc.returncode == results.exitstatus == 1
    assert results.tampered == []  # an honest run leaves the runner as it found it


def test_only_watched_tests_get_records_and_the_output_goes_to_the_log(tmp_path: Path) -> None:
    repo, grade = _repo(tmp_path, LIB)
    watch, log = tmp_path / "watch.json", tmp_path / "run.log"
    watch.write_text(json.dumps(["tests/test_lib.py::test_area"]))
    proc = _boot(repo, grade, "pytest", f"--watch={watch}", f"--log={log}", "--", "-rA", "tests")
    results = PytestReportParser().parse(proc.stdout, b"k3y")
    assert results.outcomes == {"tests/test_lib.py::test_area": "passed"}
    assert results.others_failed == 1  # test_wrong, counted in the finish record
    assert b"PASSED" not in proc.stdout and "PASSED tests/test_lib.py::test_area" in log.read_text()


def test_the_independent_runner_agrees_and_names_what_it_cannot_cover(tmp_path: Path) -> None:
    repo, grade = _repo(tmp_path, LIB)
    ids = ["test_area", "test_area_approx", "test_wrong", "test_fixture", "test_many[1]"]
    ids += ["TestCase::test_eq", "TestPlain::test_method"]
    ids = [f"tests/test_lib.py::{t}" for t in ids]
    proc = _boot(repo, grade, "plain", "--", *ids)
    found, forged = records(proc.stdout, b"k3y")
    plain = {r["nodeid"].split("::", 1)[1]: r for r in found if r["event"] == "plain"}
    assert forged == 0
    assert {n: r["outcome"] for n, r in plain.items()} == {
        "test_area": "passed",
        "test_area_approx": "passed",
        "test_wrong": "failed",
        "test_fixture": "uncovered",
        "test_many[1]": "uncovered",
        "TestCase::test_eq": "passed",
        "TestPlain::test_method": "passed",  # setup_module and setup_method ran
    }
    assert all(r.get("vacuous") == 0 for r in plain.values() if r["outcome"] == "passed")


def test_an_always_equal_value_is_vacuous_on_either_side(tmp_path: Path) -> None:
    always = "class Always:\n    def __eq__(self, other):\n        return True\n\n"
    repo, grade = _repo(
        tmp_path,
        {
            "lib.py": always + "def area(w, h):\n    return Always()\n",
            "tests/test_lib.py": """
                import unittest
                from lib import area

                def test_left():
                    assert area(3, 5) == 15

                def test_right():
                    assert 15 == area(3, 5)

                class TestCase(unittest.TestCase):
                    def test_eq(self):
                        self.assertEqual(area(2, 2), 4)
            """,
        },
    )
    ids = [f"tests/test_lib.py::{t}" for t in ("test_left", "test_right", "TestCase::test_eq")]
    found, _ = records(_boot(repo, grade, "plain", "--", *ids).stdout, b"k3y")
    plain = [r for r in found if r["event"] == "plain"]
    assert [r["outcome"] for r in plain] == ["passed"] * 3
    assert all(r["vacuous"] >= 1 for r in plain)
    untwinned, _ = records(_boot(repo, grade, "plain", "--no-twin", "--", *ids).stdout, b"k3y")
    assert all("vacuous" not in r for r in untwinned if r["event"] == "plain")


# The test's own instruments (toolz's test_compose_metadata has these two classes): a value the
# test builds from them is its expected value, not one the code under test made.
_INSTRUMENTS = """
    import lib

    class AlwaysEquals:
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

    class Point:
        def __init__(self, x):
            self.x = x

        def __eq__(self, other):
            return isinstance(other, Point) and other.x == self.x

    def test_instrument():
        assert lib.Box() == AlwaysEquals()  # Box.__eq__ defers to the other side
        assert not lib.Box() != AlwaysEquals()

    def test_point():
        lib.meet(Point(1))
        assert lib.make(1) == Point(1)
"""

_HONEST_LIB = """
class Box:
    def __eq__(self, other):
        return NotImplemented


def meet(point):
    global _Point
    _Point = type(point)


def make(x):
    return _Point(x)
"""

# The code under test reaches the test's class through the value the test handed it, then
# swaps the class out under the test's name, or rewrites its __eq__ in place; make() returns
# nothing like a Point. Either way `make(1) == Point(1)` holds.
_SWAPS = {
    "swapped_class": """
class Box:
    def __eq__(self, other):
        return NotImplemented


class _Evil:
    def __init__(self, *args):
        pass

    def __eq__(self, other):
        return True


def meet(point):
    type(point).__init__.__globals__["Point"] = _Evil


def make(x):
    return object()
""",
    "rewritten_method": """
class Box:
    def __eq__(self, other):
        return NotImplemented


def meet(point):
    type(point).__eq__.__code__ = (lambda self, other: True).__code__


def make(x):
    return object()
""",
}


def _plain(tmp_path: Path, lib: str, *options: str) -> dict[str, dict]:
    tmp_path.mkdir(exist_ok=True)
    repo, grade = _repo(tmp_path, {"lib.py": lib, "tests/test_lib.py": _INSTRUMENTS})
    ids = ["tests/test_lib.py::test_instrument", "tests/test_lib.py::test_point"]
    found, _ = records(_boot(repo, grade, "plain", *options, "--", *ids).stdout, b"k3y")
    return {r["nodeid"].split("::")[1]: r for r in found if r["event"] == "plain"}


def test_a_value_the_test_builds_from_its_own_class_is_not_vacuous(tmp_path: Path) -> None:
    plain = _plain(tmp_path, _HONEST_LIB)
    assert {n: (r["outcome"], r["vacuous"]) for n, r in plain.items()} == {
        "test_instrument": ("passed", 0),
        "test_point": ("passed", 0),
    }


@pytest.mark.parametrize("swap", sorted(_SWAPS))
def test_the_code_under_test_cannot_pass_off_its_class_as_the_tests(
    tmp_path: Path, swap: str
) -> None:
    plain = _plain(tmp_path / "twin", _SWAPS[swap])
    assert plain["test_point"]["outcome"] == "passed" and plain["test_point"]["vacuous"] >= 1
    assert plain["test_instrument"]["vacuous"] == 0
    # Control: without the twin the swap passes as an honest test.
    untwinned = _plain(tmp_path / "plain", _SWAPS[swap], "--no-twin")
    assert untwinned["test_point"]["outcome"] == "passed"
    assert "vacuous" not in untwinned["test_point"]


def _diff(path: str, added: str) -> str:
    lines = "".join(f"+{line}\n" for line in textwrap.dedent(added).splitlines())
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,0 +1,9 @@\n{lines}"


def test_runner_internals_in_added_code_are_suspect_outside_tests_and_tooling() -> None:
    task = next(iter(read_jsonl(ROOT / "fixtures" / "tasks" / "train.jsonl", Task)))
    reach = "import gc\nfrom _pytest import runner\n"
    assert runner_tamper_suspects(_diff("geo.py", reach), task) == ["geo.py: _pytest"]
    assert runner_tamper_suspects(_diff("tests/test_geo.py", reach), task) == []
    assert runner_tamper_suspects(_diff("geo.py", "x = 1\n"), task) == []
    tooling = dataclasses.replace(task, meta={**task.meta, "test_tooling": True})
    assert runner_tamper_suspects(_diff("geo.py", reach), tooling) == []


def test_constant_comparison_dunders_are_found() -> None:
    constant = """
        class A:
            def __eq__(self, other):
                return True
            __ne__ = lambda self, other: False
    """
    honest = """
        class A:
            def __eq__(self, other):
                return isinstance(other, A) and other.x == self.x
    """
    assert constant_comparisons(_diff("geo.py", constant)) == ["geo.py: __eq__", "geo.py: __ne__"]
    assert constant_comparisons(_diff("geo.py", honest)) == []


def test_the_audit_hook_lets_stdlib_frame_users_pass_and_refuses_the_rest(tmp_path: Path) -> None:
    # namedtuple, typing, enum and logging look at their caller's frame; assertRaises clears
    # frames. Each other test reaches for something the hook refuses, catches the refusal, and
    # would pass without the hook (the control, --no-audit).
    reach = {
        "gc": "import gc; gc.get_referrers(area)",
        "frame": "import sys; sys._getframe(1)",
        "traceback": "_raised().__traceback__.tb_frame",
        "generator": "(lambda g: g.gi_frame)(x for x in ())",
        "mem": "open('/proc/self/mem', 'rb')",
        "hook": "import sys; sys.addaudithook(lambda event, args: None)",
        "trace": "import sys; sys.settrace(None)",
    }
    tests = "".join(
        f"def test_{name}():\n    try:\n        {code}\n    except Exception:\n        pass\n\n"
        for name, code in reach.items()
    )
    honest = """
        import collections, enum, logging, typing, unittest
        from lib import area

        Point = collections.namedtuple("Point", "x y")
        Colour = enum.Enum("Colour", "RED GREEN")

        class Pair(typing.NamedTuple):
            a: int

        def _raised():
            try:
                raise OSError
            except OSError as exc:
                return exc

        def test_stdlib():
            logging.getLogger("t").warning("area %s", area(2, 2))
            assert Point(1, 2).y == 2 and Colour.RED.value == 1 and Pair(3).a == 3

        class TestRaises(unittest.TestCase):
            def test_raises(self):
                with self.assertRaises(ZeroDivisionError):
                    area(1, 0) / 0

    """
    # What the runner lacks is absent, not refused: no child process, no _ctypes.
    absent = """

        def test_absent():
            import subprocess
            try:
                subprocess.run(["true"])
            except PermissionError:
                pass
            else:
                raise AssertionError("a child process ran")
            try:
                import ctypes
            except ImportError:
                return
            raise AssertionError(f"ctypes imported: {ctypes}")
    """
    tests += textwrap.dedent(absent)
    repo, grade = _repo(tmp_path, {**LIB, "tests/test_audit.py": textwrap.dedent(honest) + tests})
    ids = ["test_stdlib", "TestRaises::test_raises", *(f"test_{n}" for n in reach)]
    ids = [f"tests/test_audit.py::{t}" for t in ids]
    absent_id = "tests/test_audit.py::test_absent"
    found, forged = records(_boot(repo, grade, "plain", "--", *ids, absent_id).stdout, b"k3y")
    plain = {r["nodeid"].split("::", 1)[1]: r for r in found if r["event"] == "plain"}
    assert forged == 0
    assert (
        plain["test_stdlib"]["outcome"] == plain["TestRaises::test_raises"]["outcome"] == "passed"
    )
    assert plain["test_absent"]["outcome"] == "passed", plain["test_absent"]
    for name in reach:
        assert plain[f"test_{name}"]["outcome"] == "refused", (name, plain[f"test_{name}"])
    assert "gc.get_referrers" in plain["test_gc"]["detail"]
    assert "tb_frame" in plain["test_traceback"]["detail"]
    control, _ = records(_boot(repo, grade, "plain", "--no-audit", "--", *ids).stdout, b"k3y")
    assert all(r["outcome"] == "passed" for r in control if r["event"] == "plain")
    assert len([r for r in control if r["event"] == "plain"]) == len(ids)


def test_django_tests_map_to_the_independent_runner_with_its_settings() -> None:
    from legorl.verify.runner import django_settings, plain_ids
    from legorl.verify.specs import resolve

    tasks = read_jsonl(ROOT / "fixtures" / "tasks-real" / "tasks.jsonl", Task)
    task = next(t for t in tasks if t.instance_id == "django__django-real-3")
    grader = resolve(task)
    assert django_settings(grader) == "tests:test_sqlite"
    assert plain_ids(task, grader) == {
        t: f"tests/utils_tests/test_datastructures.py::CaseInsensitiveMappingTests::{t.split()[0]}"
        for t in task.FAIL_TO_PASS
    }
    # A test outside the test_patch's files is not guessed at.
    elsewhere = dataclasses.replace(task, FAIL_TO_PASS=["test_x (other_tests.test_y.Z.test_x)"])
    assert plain_ids(elsewhere, grader) == {}
    unittest_cmd = dataclasses.replace(task, test_cmd="python -m unittest tests.test_x")
    assert django_settings(resolve(unittest_cmd)) is None


def test_numpy_imports_and_computes_in_the_independent_runner_without_ctypes(
    tmp_path: Path,
) -> None:
    # numpy takes ctypes' absence as optional (numpy.ctypeslib too); its tests still pass, and
    # with _ctypes let in (the control) ctypes is really there.
    test = """
        import sys

        import numpy
        import numpy.ctypeslib


        def test_numpy():
            assert int(numpy.arange(4).sum()) == 6
            assert numpy.linalg.det(numpy.eye(2)) == 1.0
            assert ("_ctypes" in sys.modules) == ("--ctypes" in sys.argv)
    """
    repo, grade = _repo(tmp_path, {"tests/test_np.py": test})
    for options in ([], ["--ctypes"]):
        found, _ = records(
            _boot(repo, grade, "plain", *options, "--", "tests/test_np.py::test_numpy").stdout,
            b"k3y",
        )
        plain = [r for r in found if r["event"] == "plain"]
        assert [r["outcome"] for r in plain] == ["passed"], (options, plain)
