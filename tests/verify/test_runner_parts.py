"""The runner's parts without Docker: the bootstrap (from stdin), the rewrite of the tests and the
out-of-process judge, as real pytest subprocesses on a small repository in a temporary folder,
and the static scans of patch text.

Each attack on the judge below also has its control: the same candidate under the in-process
outcome alone (what grading was before assertions were judged out of process) passes.
"""

from __future__ import annotations

import ast
import asyncio
import binascii
import contextlib
import dataclasses
import json
import marshal
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.records import Task, read_jsonl
from legorl.verify import assertions, rewrite
from legorl.verify.parsers import PytestReportParser, records
from legorl.verify.runner import LOADER, _bundle
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects

KEY = "k3y"
TESTS = "tests/test_lib.py"
GOLD = "def area(w, h):\n    return w * h\n"
BASE = "def area(w, h):\n    return w + h\n"  # the bug the gold patch fixes
LIB_TESTS = """
    import unittest

    import pytest
    from lib import area


    def test_area():
        assert area(3, 5) == 15


    def test_area_held_local():
        expected = 12
        assert area(3, 4) == expected


    def test_area_approx():
        assert area(0.1, 3) == pytest.approx(0.3)


    def test_symmetric():
        assert area(2, 3) == area(3, 2)


    def test_raises():
        with pytest.raises(TypeError):
            area("a", "b")


    def test_type():
        assert isinstance(area(2, 2), int)


    class TestUnit(unittest.TestCase):
        def test_equal(self):
            self.assertEqual(area(2, 5), 10)
            self.assertGreater(area(2, 5), 9)
"""
REQUIRED = [
    f"{TESTS}::{name}"
    for name in (
        "test_area",
        "test_area_held_local",
        "test_area_approx",
        "test_symmetric",
        "test_raises",
        "test_type",
        "TestUnit::test_equal",
    )
]


def _repo(tmp: Path, lib: str, tests: str = LIB_TESTS) -> Path:
    repo = tmp / "repo"
    (repo / "tests").mkdir(parents=True, exist_ok=True)
    (repo / "lib.py").write_text(textwrap.dedent(lib))
    (repo / TESTS).write_text(textwrap.dedent(tests))
    return repo


def _boot(repo: Path, *args: str, **options: object) -> subprocess.CompletedProcess:
    bundle = _bundle({"log": str(repo.parent / "run.log"), **options})
    return subprocess.run(
        [sys.executable, "-I", "-B", "-c", LOADER, "pytest", "--", *args],
        cwd=repo,
        input=(KEY + "\n").encode() + bundle,
        capture_output=True,
        timeout=120,
    )


def _judged_run(
    repo: Path, plan: rewrite.Plan | None, onward: bool = False
) -> tuple[list[dict], dict[str, str]]:
    if plan is not None:
        for path, text in plan.files.items():
            (repo / path).write_text(text)
    proc = _boot(repo, "-q", "-p", "no:cacheprovider", "--rootdir", ".", "tests", onward=onward)
    found, _ = records(proc.stdout, KEY.encode())
    outcomes = PytestReportParser().parse(proc.stdout, KEY.encode()).outcomes
    return found, outcomes


def _gold(
    tmp: Path, tests: str = LIB_TESTS, gold: str = GOLD, base: str = BASE
) -> tuple[list[str], rewrite.Plan, assertions.Gold]:
    """The plan of the required tests in ``tests``, and the gold patch's record: two runs of
    ``gold`` and one of ``base`` (what the empty patch leaves)."""
    pristine = {TESTS: textwrap.dedent(tests)}
    required = [t for t in REQUIRED if t.split("::")[-1] in tests]
    plan = rewrite.plan_files(required, pristine, django=False, pytest=True, inproc=set())
    runs = []
    for _ in range(2):
        found, _ = _judged_run(_repo(tmp / "gold", gold, tests), plan)
        runs.append(assertions.by_test(found))
    empty, _ = _judged_run(_repo(tmp / "base", base, tests), plan, onward=True)
    return required, plan, assertions.Gold(runs=runs, empty=assertions.by_test(empty))


def _judge(
    tmp: Path, candidate: str, tests: str = LIB_TESTS, gold_lib: str = GOLD, base: str = BASE
) -> tuple[dict, dict]:
    """Gold recorded, then ``candidate`` judged: (judgements, in-process outcomes). The
    required tests count as ``PASS_TO_PASS`` here (coverage: one assertion judged here)."""
    required, plan, gold = _gold(tmp, tests, gold_lib, base)
    found, outcomes = _judged_run(_repo(tmp / "candidate", candidate, tests), plan)
    events = assertions.by_test(found)
    covered = assertions.covered_tests(plan, gold, set())
    verdicts = {
        t: assertions.judge_test(plan.keys[t], events, plan, gold, covered[t]) for t in required
    }
    return verdicts, outcomes


def test_the_gold_patch_passes_and_every_test_is_covered(tmp_path: Path) -> None:
    verdicts, outcomes = _judge(tmp_path, GOLD)
    assert {t: v.outcome for t, v in verdicts.items()} == dict.fromkeys(REQUIRED, "passed")
    assert all(v.judged_out >= 1 and v.judged_in == 0 for v in verdicts.values()), verdicts
    assert all(outcomes[t] == "passed" for t in REQUIRED)


def test_a_failing_test_is_covered_only_by_an_assertion_the_fix_changes_judged_on_a_secret(
    tmp_path: Path,
) -> None:
    # As FAIL_TO_PASS tests against the base ``w + h``: the equalities against held literals
    # fail there and are judged here (covered). A computed expected side (``area(2, 3) ==
    # area(3, 2)``) and a class name (isinstance, raises) are not secrets: not covered.
    required, plan, gold = _gold(tmp_path)
    covered = assertions.covered_tests(plan, gold, set(required))
    names = {t.split("::")[-1]: c for t, c in covered.items()}
    assert names == {
        "test_area": True,
        "test_area_held_local": True,
        "test_area_approx": True,
        "test_symmetric": False,
        "test_raises": False,
        "test_type": False,
        "test_equal": True,
    }
    # Its values do change (5 on the base, 6 fixed), but both sides are computed in the judged
    # process: sending the same value twice meets it.
    key = plan.keys[f"{TESTS}::test_symmetric"]
    assert assertions.decisive(key, plan, gold) == [0]
    assert not assertions.secret_bearing(key, 0, plan, gold)
    # The control: one assertion judged here is enough without the rule.
    assert all(assertions.covered_tests(plan, gold, set(required), secrets=False).values())
    assert [assertions.guessable(v) for v in (True, None, 0, -1, "", [False, True], 15, "B")] == [
        True, True, True, True, True, True, False, False,
    ]  # fmt: skip


def test_the_empty_runs_tests_go_on_past_an_assertion_that_raised(tmp_path: Path) -> None:
    # Round 14: the unfixed code raised at a test's first assertion, so the judge never saw
    # what it answers at the next one and counted that one's expected value whole; the bug
    # got it right, and a fix special-casing the statement's example (15) met the test. The
    # gold record's run of the empty patch now goes on past a failed assertion of the test's
    # own body; one inside a ``with`` or ``try``, whose exception the test may expect, stops
    # the test as before, as does every assertion of every other run.
    tests = """
    import pytest
    from lib import area


    def test_area():
        x = area(3, 5)
        assert [x][x - 15] == 15
        assert area(2, 2) == 4
        for w in (1, 2):
            assert [x][x - 15] == 15
        assert area(2, 7) == 14


    def test_area_held_local():
        x = area(3, 5)
        with pytest.raises(IndexError):
            assert [x][x - 100] == 8
        assert area(2, 2) == 4
    """
    _, plan, gold = _gold(tmp_path, tests)
    area_key = plan.keys[f"{TESTS}::test_area"]
    assert gold.empty is not None
    unfixed = gold.empty[area_key]
    assert [e.ok for e in unfixed.events] == [False, None, False, False, None]
    assert unfixed.events[1].values[0] == 4 and unfixed.events[4].values[0] == 9
    # the answer the bug gets right is not decisive; 14, which it gets wrong, carries the test
    assert assertions.decisive(area_key, plan, gold) == [0, 2, 3, 4]
    assert assertions.secret_bearing(area_key, 4, plan, gold, "area(3, 5) gives 8, not 15")
    assert not assertions.secret_bearing(area_key, 0, plan, gold, "area(3, 5) gives 8, not 15")
    # inside ``pytest.raises`` the test stops where it raised, as written
    local_key = plan.keys[f"{TESTS}::test_area_held_local"]
    local = gold.empty[local_key].events
    assert [e.site for e in local] == [e.site for e in gold.runs[-1][local_key].events]
    assert len(local) == 2 and local[0].types[0] is not None  # the block raised IndexError
    # every other run stops the test at the assertion that raised
    found, outcomes = _judged_run(_repo(tmp_path / "other", BASE, tests), plan)
    assert len(assertions.by_test(found)[area_key].events) == 0
    assert outcomes[f"{TESTS}::test_area"] == "failed"


def test_identity_with_a_held_literal_is_its_exact_value(tmp_path: Path) -> None:
    tests = """
        import unittest

        from lib import area


        class TestUnit(unittest.TestCase):
            def test_equal(self):
                self.assertIs(area(2, 3) == 6, True)
                self.assertIsNot(area(2, 3), None)
    """
    verdicts, _ = _judge(tmp_path / "gold", GOLD, tests)
    assert [v.outcome for v in verdicts.values()] == ["passed"], verdicts
    verdicts, _ = _judge(tmp_path / "base", BASE, tests)
    assert [v.outcome for v in verdicts.values()] == ["failed"], verdicts


def test_a_raised_message_is_checked_by_the_judge_not_the_tests_manager(tmp_path: Path) -> None:
    # The candidate raises the right class with the bug's message, and makes pytest.raises
    # accept any message (round 2 did this to Django's assertRaisesMessage): the in-process
    # outcome passes; the judge holds the message and checks what was raised.
    tests = """
        import pytest
        from lib import area


        def test_raises():
            with pytest.raises(ValueError, match="negative width"):
                area(-1, 2)
    """
    gold = GOLD.replace(
        "    return", "    if w < 0:\n        raise ValueError('negative width')\n    return"
    )
    candidate = (
        "import pytest, contextlib\n"
        "_raises = pytest.raises\n"
        "pytest.raises = lambda exc, match=None: _raises(exc)\n"
        + GOLD.replace("    return", "    if w < 0:\n        raise ValueError('bad')\n    return")
    )
    verdicts, outcomes = _judge(tmp_path / "forged", candidate, tests, gold)
    key = f"{TESTS}::test_raises"
    assert outcomes[key] == "passed"  # the control: the in-process outcome is fooled
    assert verdicts[key].outcome == "failed", verdicts[key]
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold)
    assert verdicts[key].outcome == "passed", verdicts[key]


def test_a_raises_check_in_its_call_form_is_judged_as_its_block(tmp_path: Path) -> None:
    # Round 40 (named, not built): ``assertRaises(E, f, *args)`` and ``pytest.raises(E, f,
    # *args)`` as statements were decided in the judged process, by managers library code can
    # replace. They are now the blocks they mean, ``with assertRaises(E): f(*args)``, judged as
    # any raises block: the candidate below keeps the bug (nothing raised) and makes both
    # managers accept anything.
    tests = """
        import unittest

        import pytest
        from lib import area


        def test_raises():
            pytest.raises(ValueError, area, -1, h=2)


        class TestUnit(unittest.TestCase):
            def test_equal(self):
                self.assertRaisesRegex(ValueError, "neg", area, -1, 2)
                self.assertEqual(area(2, 5), 10)
    """
    gold = GOLD.replace(
        "    return", "    if w < 0:\n        raise ValueError('negative width')\n    return"
    )
    candidate = (
        "import contextlib, unittest, pytest\n"
        "def _any(*args, **kwargs):\n"
        "    return contextlib.nullcontext()\n"
        "pytest.raises = _any\n"
        "unittest.TestCase.assertRaisesRegex = lambda self, *a, **k: _any()\n"
        "unittest.TestCase.assertRaises = lambda self, *a, **k: _any()\n" + GOLD
    )
    keys = [f"{TESTS}::test_raises", f"{TESTS}::TestUnit::test_equal"]
    verdicts, outcomes = _judge(tmp_path / "forged", candidate, tests, gold)
    for key in keys:
        assert outcomes[key] == "passed"  # the control: the in-process outcome is fooled
        assert verdicts[key].outcome == "failed", verdicts[key]
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold)
    assert [verdicts[k].outcome for k in keys] == ["passed", "passed"], verdicts
    # The message is the judge's too: the right class with another message fails.
    other = gold.replace("'negative width'", "'bad'")
    verdicts, _ = _judge(tmp_path / "other", other, tests, gold)
    assert verdicts[keys[1]].outcome == "failed", verdicts[keys[1]]


def test_a_call_forms_arguments_are_evaluated_before_its_check_begins(tmp_path: Path) -> None:
    # Round 45 (read, not run): the call form's callable and arguments were moved inside the
    # block it means, so an argument whose evaluation raised the expected class met the check,
    # where the test as written errors before the check begins. The candidate keeps the bug
    # (``area(-1, 2)`` raises nothing) and makes the library's ``width`` raise instead.
    tests = """
        import unittest

        import pytest
        from lib import area, width


        def test_raises():
            pytest.raises(ValueError, area, width(-1), h=2)


        class TestUnit(unittest.TestCase):
            def test_equal(self):
                self.assertRaises(ValueError, area, *[width(-1), 2])
                self.assertEqual(area(2, 5), 10)
    """
    gold = "def width(x):\n    return x\n" + GOLD.replace(
        "    return", "    if w < 0:\n        raise ValueError('negative width')\n    return"
    )
    keys = [f"{TESTS}::test_raises", f"{TESTS}::TestUnit::test_equal"]
    base = "def width(x):\n    return x\n" + BASE
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold, base)
    assert [verdicts[k].outcome for k in keys] == ["passed", "passed"], verdicts
    candidate = (
        "def width(x):\n    if x < 0:\n        raise ValueError('negative width')\n"
        "    return x\n" + GOLD
    )
    verdicts, outcomes = _judge(tmp_path / "forged", candidate, tests, gold, base)
    for key in keys:
        assert outcomes[key] == "failed"  # as the test as written: an error before the check
        assert verdicts[key].outcome == "raised", verdicts[key]
        assert "raised ValueError" in verdicts[key].detail, verdicts[key]


def test_a_call_form_whose_meaning_depends_on_pytests_version_stays_as_written() -> None:
    # Round 46 (read): ``pytest.warns(W, f, match=m)`` hands ``match`` to ``f`` in pytest 8
    # and later, and takes it as its own (unchecked) in pytest 7. It stays a statement of the
    # test, decided in process; the same call without ``match`` becomes its block.
    from legorl.verify.rewrite import _as_block

    def form(text: str) -> object:
        call = ast.parse(text).body[0]
        assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
        return _as_block(call.value)

    assert form("pytest.warns(UserWarning, f, 1, match='x')") is None
    held, block = form("pytest.warns(UserWarning, f, 1, key='x')")  # type: ignore[misc]
    assert ast.unparse(block).startswith("with pytest.warns(UserWarning):")
    held, block = form("pytest.raises(ValueError, f, 1, match='x')")  # type: ignore[misc]
    assert "'match': 'x'" in ast.unparse(held)  # pytest.raises hands it on in both versions


def test_what_a_tests_callable_did_is_pinned_not_its_helpers_verdict(tmp_path: Path) -> None:
    # Round 16: toolz's tests check errors through a helper of the library's own
    # (``assert raises(TypeError, lambda: diff())``), a truth check whose True the patched
    # helper gave for a call that no longer raised; the patch broke the checked behaviour and
    # got 1.0. What the test's callable did (raised which class, or returned) goes to the
    # judge, pinned to the gold run's; the helper's answer alone carries nothing. Round 17:
    # the same with a callable that is not a lambda, and with a class named as the one the
    # gold run raised.
    helper = (
        "def raises(err, fn):\n    try:\n        fn()\n        return False\n"
        "    except err:\n        return True\n"
    )
    tests = """
    from lib import area, raises


    def negative():
        return area(-1, 2)


    def test_area():
        assert area(3, 5) == 15
        assert raises(ValueError, lambda: area(-1, 2))
        assert not raises(ValueError, lambda: area(1, 2))
        assert raises(ValueError, negative)
        assert raises((KeyError, ValueError), fn=negative)
    """
    gold = helper + GOLD.replace(
        "    return", "    if w < 0:\n        raise ValueError('negative')\n    return"
    )
    key = f"{TESTS}::test_area"
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold)
    assert verdicts[key].outcome == "passed", verdicts[key]
    # a subclass of what the gold run raised meets it, as the helper's own except does
    subclass = gold.replace("raise ValueError(", "raise UnicodeError(")
    verdicts, _ = _judge(tmp_path / "sub", subclass, tests, gold)
    assert verdicts[key].outcome == "passed", verdicts[key]
    for name, candidate in {
        # no check of the width, and a helper that answers True whether or not it raised
        "always": helper.replace("return False", "return True") + GOLD,
        # the helper never calls the test's callable
        "uncalled": "def raises(err, fn):\n    return err is ValueError\n" + GOLD,
        # another class raised, the helper told it is the one asked for
        "other": helper.replace("except err:", "except Exception:")
        + GOLD.replace("    return", "    if w < 0:\n        raise KeyError(w)\n    return"),
        # round 17: a class of the patch's own that names itself the built-in one, and one
        # that merely bears its name, each told by name to be it
        "named": helper.replace("except err:", "except Exception as e:\n        return True")
        + "class _Bad(Exception):\n    __module__ = 'builtins'\n    __qualname__ = 'ValueError'\n"
        + GOLD.replace("    return", "    if w < 0:\n        raise _Bad(w)\n    return"),
        "namesake": helper.replace("except err:", "except Exception as e:\n        return True")
        + "class ValueError(Exception):\n    pass\n"
        + GOLD.replace("    return", "    if w < 0:\n        raise ValueError(w)\n    return"),
    }.items():
        verdicts, outcomes = _judge(tmp_path / name, candidate, tests, gold)
        assert outcomes[key] == "passed", name  # the control: the in-process outcome is fooled
        assert verdicts[key].outcome == "failed", (name, verdicts[key])
        assert "callable" in verdicts[key].detail, (name, verdicts[key])


def test_a_truth_checks_callable_is_called_by_the_sender_first_with_no_hook_inside(
    tmp_path: Path,
) -> None:
    # Round 24: the library's helper decided how the test's callable was called: with an
    # argument it does not take (a TypeError, the class the test expects, without running it),
    # or under a trace function that raised the expected class as the callable started.
    # Round 25: the helper sent the call's record itself and never called the callable, or
    # swapped what the callable calls for one raising the expected class while it held it.
    # Round 26: the code under test rebound a builtin the sender looked up by name.
    # The sender calls the callable first, before the helper runs, and hands the helper a
    # stand-in. A hook the code under test sets at import (a trace or profile function, a
    # signal handler) runs nothing inside that call.
    helper = (
        "def raises(err, fn):\n    try:\n        fn()\n        return False\n"
        "    except err:\n        return True\n"
    )
    tests = """
    from lib import area, raises


    def test_area():
        assert area(3, 5) == 15
        assert raises(TypeError, lambda: area(-1, 2))
    """
    gold = helper + GOLD.replace(
        "    return", "    if w < 0:\n        raise TypeError('negative')\n    return"
    )
    key = f"{TESTS}::test_area"
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold)
    assert verdicts[key].outcome == "passed", verdicts[key]
    # the helper rigs the callable's globals while it holds it
    rigged = (
        "def raises(err, fn):\n"
        "    inner = fn\n"
        "    while getattr(inner, '__closure__', None) and not hasattr(inner, '__globals__'):\n"
        "        inner = inner.__closure__[0].cell_contents\n"
        "    space = getattr(fn, '__globals__', {})\n"
        "    def boom(*a, **k):\n        raise err('forged')\n"
        "    real = space.get('area')\n"
        "    space['area'] = boom\n"
        "    try:\n        fn()\n        return False\n"
        "    except err:\n        return True\n"
        "    finally:\n        space['area'] = real\n"
    )
    # the helper sends the record the gold run sent and never calls the callable
    sent = (
        "import builtins\n"
        "def raises(err, fn):\n"
        "    ours = getattr(builtins, '__legorl__', None)\n"
        "    if ours is not None:\n"
        "        space = ours.watch_call.__globals__\n"
        "        for cell in ours.watch_call.__code__.co_consts:\n"
        "            pass\n"
        "        site = sys_site()\n"
        "        space['_send']({'event': 'w', 'site': site, 'r': space['_class_names'](err)})\n"
        "    return True\n"
        "def sys_site():\n"
        "    import sys\n"
        "    frame = sys._getframe(2)\n"
        "    return frame.f_locals.get('site')\n"
    )
    # round 26: the code under test rebinds builtins.callable so that the sender takes the
    # test's lambda for no callable (and calls nothing), and the helper sends the record
    swapped = (
        "import builtins, sys\n"
        "_real = builtins.callable\n"
        "def _callable(x):\n"
        "    if sys._getframe(1).f_code.co_name == '_called':\n"
        "        return False\n"
        "    return _real(x)\n"
        "builtins.callable = _callable\n"
        "def raises(err, fn):\n"
        "    ours = getattr(builtins, '__legorl__', None)\n"
        "    if ours is not None:\n"
        "        site = sys._getframe(1).f_locals.get('site')\n"
        "        space = ours.watch_call.__globals__\n"
        "        space['_send']({'event': 'w', 'site': site, 'r': space['_class_names'](err)})\n"
        "    return True\n"
    )
    # hooks the code under test sets at import: each raises the expected class inside the
    # test's call of the code under test (the caller is the helper, or the sender)
    at_import = (
        "import signal, sys\n"
        "def _ours(frame):\n"
        "    back = frame.f_back\n"
        "    return (frame.f_code.co_name == '<lambda>' and 'test_lib' in frame.f_code.co_filename\n"
        "            and back is not None and back.f_code.co_name != 'test_area')\n"
        "def _hook(frame, event, arg=None):\n"
        "    if event == 'call' and _ours(frame):\n"
        "        raise TypeError('forged')\n"
        "ARM\n"
    )
    timer = (
        "import atexit, signal\n"
        "def _handler(signum, frame):\n"
        "    if frame is not None and frame.f_code.co_name == 'area':\n"
        "        signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "        raise TypeError('forged')\n"
        "atexit.register(signal.setitimer, signal.ITIMER_REAL, 0)\n"
        "signal.signal(signal.SIGALRM, _handler)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)\n"
    )
    slow = GOLD.replace(
        "    return",
        "    for _ in range(20_000_000 if w < 0 else 0):\n        pass\n    return",
    )
    for name, candidate in {
        "arity": helper.replace("fn()", "fn(None)") + GOLD,
        "rigged": rigged + GOLD,
        "sent": sent + GOLD,
        "callable": swapped + GOLD,
        "trace": helper + at_import.replace("ARM", "sys.settrace(_hook)") + GOLD,
        "profile": helper + at_import.replace("ARM", "sys.setprofile(_hook)") + GOLD,
        "signal": helper + timer + slow,
    }.items():
        repo = _repo(tmp_path / name / "plain", candidate, tests)
        plain = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TESTS],
            cwd=repo,
            capture_output=True,
            timeout=120,
        )
        # the control: under plain pytest the forgery holds
        assert plain.returncode == 0, (name, plain.stdout.decode()[-2000:])
        verdicts, _ = _judge(tmp_path / name, candidate, tests, gold)
        assert verdicts[key].outcome == "failed", (name, verdicts[key])
        assert "callable" in verdicts[key].detail, (name, verdicts[key])


_MONITORED = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("operands", sys.argv[1])
op = importlib.util.module_from_spec(spec)
spec.loader.exec_module(op)
sent = []
op._send = sent.append
M = sys.monitoring
M.use_tool_id(3, "attack")


def target():
    return 1


def on_start(code, offset):
    if code is target.__code__:
        raise ValueError("forged")


M.register_callback(3, M.events.PY_START, on_start)
M.set_events(3, M.events.PY_START)
out = {}
def called():
    op._called("s", target)()


for name, call in (("bare", target), ("watched", called), ("after", target)):
    try:
        call()
        out[name] = "returned"
    except ValueError:
        out[name] = "raised"
print(json.dumps({"out": out, "sent": sent}))
"""


def test_a_watched_call_runs_free_of_monitoring_callbacks() -> None:
    # Python 3.12's sys.monitoring: a PY_START callback that raises raises into the call it
    # watches, as a trace function does; the watched call runs with every callback cleared,
    # and they are back after it. The task images here are 3.11: a newer interpreter of the
    # machine's runs this: the OpenHands venv's, which .ci/run builds on Python 3.12.
    found = [p for p in (ROOT / ".venv-openhands/bin/python",) if p.exists()]
    found += sorted(Path.home().glob(".pyenv/versions/3.1[2-9].*/bin/python"))
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail("no Python 3.12 (.venv-openhands, which .ci/run builds)")
        pytest.skip("no Python 3.12 or newer on this machine (sys.monitoring)")
    operands_py = ROOT / "src/legorl/verify/operands.py"
    done = subprocess.run(
        [str(found[0]), "-I", "-c", _MONITORED, str(operands_py)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    # the control (bare) and the callback put back (after) raise; the watched call returns
    assert got["out"] == {"bare": "raised", "watched": "returned", "after": "raised"}, got
    assert got["sent"] == [{"event": "w", "site": "s", "n": 1}], got


_PYTHON_INSIDE_THE_SENDER = """
import contextlib, importlib.util, json, signal, sys
spec = importlib.util.spec_from_file_location("operands", sys.argv[1])
op = importlib.util.module_from_spec(spec)
spec.loader.exec_module(op)
records = []
op.install(records.append, c_sender=sys.argv[2] == "on")
ran = []


def spy(name, real):
    def call(*args, **kwargs):
        ran.append(name)
        return real(*args, **kwargs)

    return call


signal.signal(signal.SIGUSR1, lambda *_: None)  # a handler of the judged process's own
for name in ("_int_to_enum", "_enum_to_int"):
    setattr(signal, name, spy("signal." + name, getattr(signal, name)))
contextlib.suppress = spy("contextlib.suppress", contextlib.suppress)
op.check("s", 15)
print(json.dumps({"ran": sorted(set(ran)), "sent": len(records)}))
"""


def test_the_hushed_sender_calls_no_function_the_judged_process_can_replace() -> None:
    # Round 96: ``signal.getsignal``, a Python wrapper the sender called inside ``_quiet`` after
    # it had cleared the hooks, looked up ``signal._int_to_enum`` at call time; the judged
    # process replaced it with a function that set a trace function again, which emptied the
    # sender's note of an operand's classes. The sender now calls ``_signal``'s C functions
    # and puts the hooks back with no ``contextlib.suppress``. The control: with
    # ``c_sender`` off, the replaced function runs inside the sender.
    operands_py = ROOT / "src/legorl/verify/operands.py"

    def run(switch: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _PYTHON_INSIDE_THE_SENDER, str(operands_py), switch],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert run("on") == {"ran": [], "sent": 1}
    assert "signal._int_to_enum" in run("off")["ran"]


def test_a_watched_call_started_again_and_a_replaced_encoder_count_for_nothing() -> None:
    # Round 18: a helper started the watched call again (a second ``ws``) to drop the record
    # of what the test's callable did, and a replaced ``json.dumps`` rewrote the guard's
    # ``tampered`` record before it was signed.
    import json

    from legorl.verify import pytest_report

    def run(*records: dict) -> list[tuple[str, ...]] | None:
        events = assertions.by_test(
            [{"event": "tb", "key": "t"}, *records, {"event": "a", "site": "s", "v": []}]
        )
        return events["t"].events[0].calls

    raised = {"event": "w", "site": "s", "r": [["builtins", "TypeError"]]}
    assert run({"event": "ws", "site": "s"}, raised) == [("r", "builtins.TypeError")]
    again = run({"event": "ws", "site": "s"}, {"event": "w", "site": "s", "n": 1})
    assert again == [("n",)]
    started_again = run(
        {"event": "ws", "site": "s"},
        {"event": "w", "site": "s", "n": 1},
        {"event": "ws", "site": "s"},
        raised,
    )
    assert started_again == [("?",), ("r", "builtins.TypeError")]
    assert run() is None  # no watched call: nothing pinned
    read, write = os.pipe()
    emit = pytest_report.channel(b"key", write)
    real = json.dumps
    json.dumps = lambda *a, **k: real({"event": "start"}, **k)  # type: ignore[assignment]
    try:
        emit({"event": "tampered", "where": "report"})
    finally:
        json.dumps = real
    os.close(write)
    written = os.read(read, 4096).decode()
    os.close(read)
    assert '"tampered"' in written and '"start"' not in written


def test_a_tests_record_ends_only_with_its_begins_token() -> None:
    # A red-team row (reasoned in rounds 17 and 18): the code under test called the sender's
    # own ``test`` to end a test's record early, so that the real outcome after it landed in
    # no test; or began another test to divert it.
    def run(*middle: dict, paired: bool = True) -> assertions.TestEvents:
        records = [
            {"event": "tb", "key": "t", "n": "tok"},
            {"event": "a", "site": "s", "v": []},
            *middle,
            {"event": "te", "exc": None, "n": "tok"},
        ]
        return assertions.by_test(records, paired=paired)["t"]

    honest = run({"event": "a", "site": "s2", "v": []})
    assert honest.ended and honest.exc is None and len(honest.events) == 2
    cut = [{"event": "te", "exc": None, "n": "forged"}, {"event": "a", "site": "s2", "v": []}]
    assert run(*cut).exc == "an end its begin did not send"
    assert run(*cut, paired=False).exc is None  # the control: the record cut short, unseen
    diverted = [{"event": "tb", "key": "other", "n": "x"}, {"event": "a", "site": "s2", "v": []}]
    diverted.append({"event": "te", "exc": None, "n": "x"})
    assert run(*diverted).exc == "another test began inside it"
    same_key = [{"event": "tb", "key": "t", "n": "y"}, {"event": "te", "exc": None, "n": "y"}]
    assert run(*same_key).exc is None  # a test that calls another runs under its own key
    # Round 27: a begin and end under the open test's key sent between a check's watched call
    # and its event, then the record of the call the gold run made, in place of the real one.
    check = {"event": "a", "site": "w", "v": []}
    real = [{"event": "ws", "site": "w"}, {"event": "w", "site": "w", "n": 1}]
    forged = [{"event": "ws", "site": "w"}, {"event": "w", "site": "w", "r": [["builtins", "E"]]}]
    dropped = run(*real, *same_key, *forged, check)
    assert dropped.events[-1].calls == [("?",), ("r", "builtins.E")]  # a call nobody made
    control = run(*real, *same_key, *forged, check, paired=False)
    assert control.events[-1].calls == [("r", "builtins.E")]  # the forged call alone
    # Round 28: the begin's token guessed (its source replaced), an end sent from inside the
    # test before the assertion it was in was done, that assertion sent with the gold value.
    early = [{"event": "te", "exc": None, "n": "tok"}, {"event": "a", "site": "s2", "v": []}]
    assert run(*early).exc == "an assertion's event came after the test ended"
    assert run(*early, paired=False).exc is None  # the control: the real event dropped


def test_the_runs_log_is_read_only_as_a_regular_file_and_never_waited_on(tmp_path: Path) -> None:
    # Round 20: the judged user put a named pipe at the log's path; ``tail`` waited a minute.
    from legorl.verify.runner import _TAIL

    def tail(path: Path, cap: int = 5) -> bytes:
        argv = [sys.executable, "-I", "-S", "-B", "-c", _TAIL, str(path), str(cap)]
        return subprocess.run(argv, capture_output=True, timeout=20, check=True).stdout

    log = tmp_path / "run.log"
    log.write_bytes(b"0123456789")
    assert tail(log) == b"56789" and tail(log, 100) == b"0123456789"
    pipe = tmp_path / "pipe.log"
    os.mkfifo(pipe)
    assert tail(pipe) == b""  # returns at once: a pipe nobody writes is no log
    link = tmp_path / "link.log"
    link.symlink_to(log)
    assert tail(link) == b"" and tail(tmp_path / "missing.log") == b""


def test_a_type_check_matches_the_gold_runs_class_not_its_name(tmp_path: Path) -> None:
    # Round 17 (its kind): an isinstance or raised class is judged by class names; a class of
    # the patch's own named ``int`` met ``isinstance(x, int)``. The class a type check
    # matches must be the one the gold run's matched.
    tests = """
    import pytest
    from lib import area


    def test_type():
        assert isinstance(area(2, 2), int)
        with pytest.raises(TypeError):
            area("a", None)
    """
    key = f"{TESTS}::test_type"
    verdicts, _ = _judge(tmp_path / "gold", GOLD, tests)
    assert verdicts[key].outcome == "passed", verdicts[key]
    namesake = "class int:\n    pass\n\n\ndef area(w, h):\n    w * h\n    return int()\n"
    verdicts, outcomes = _judge(tmp_path / "namesake", namesake, tests)
    assert outcomes[key] == "passed"  # the control: the in-process outcome is fooled
    assert verdicts[key].outcome == "failed" and "class" in verdicts[key].detail, verdicts[key]


def test_a_class_is_named_from_the_interpreters_own_modules(tmp_path: Path) -> None:
    # Round 51 (toolz-real-9): the sender looked a class's name up through ``sys.modules``,
    # read when it named the class, so code under test rebound it to a dict subclass whose
    # lookup served a module in which the expected class's name led to a class of its own:
    # that class passed ``isinstance(x, Real)`` in the judged run. The same through a module
    # whose class makes ``__dict__`` a property, and through a key of the namespace whose
    # ``__eq__`` a lookup calls. The interpreter's own table and a module's own namespace are
    # read now, as taken before any code under test ran, and only their exact str keys.
    tests = """
    from lib import Real, make


    def test_type():
        assert isinstance(make(), Real)
    """
    lib = "class Real:\n    pass\n\n\n"
    gold = lib + "def make():\n    return Real()\n"
    base = lib + "def make():\n    return object()\n"
    impostor = lib + textwrap.dedent(
        """\
        import sys, types


        class _Impostor:
            pass


        _Impostor.__qualname__, _Impostor.__module__ = "Real", "lib"


        def make():
            return _Impostor()


        def _fake():
            fake = types.ModuleType("lib")
            fake.Real = _Impostor
            return fake
        """
    )
    view = impostor + textwrap.dedent(
        """\


        class _View(dict):
            def __getitem__(self, name):
                return _fake() if name == "lib" else dict.__getitem__(self, name)


        sys.modules = _View(sys.modules)
        """
    )
    own_dict = impostor + textwrap.dedent(
        """\


        class _Module(types.ModuleType):
            @property
            def __dict__(self):
                return {"Real": _Impostor}


        sys.modules[__name__].__class__ = _Module
        """
    )
    # A key of the module's namespace that is not an exact str, whose hash meets the name's
    # and whose __eq__ says yes only to the sender's lookup, put there before the real class.
    collider = textwrap.dedent(
        """\
        import sys


        class _Key(str):
            def __hash__(self):
                return str.__hash__("Real")

            def __eq__(self, other):
                return other == "Real" and sys._getframe(1).f_code.co_name != "<module>"


        class _Impostor:
            pass


        _Impostor.__qualname__, _Impostor.__module__ = "Real", "lib"
        globals()[_Key("Real2")] = _Impostor


        class Real:
            pass


        def make():
            return _Impostor()
        """
    )
    key = f"{TESTS}::test_type"
    verdicts, _ = _judge(tmp_path / "gold", gold, tests, gold, base)
    assert verdicts[key].outcome == "passed", verdicts[key]
    for name, candidate in (("view", view), ("own_dict", own_dict), ("collider", collider)):
        verdicts, _ = _judge(tmp_path / name, candidate, tests, gold, base)
        assert verdicts[key].outcome == "failed", (name, verdicts[key])


def test_literals_leave_the_test_file_and_the_judge_holds_them() -> None:
    plan = rewrite.plan_files(
        REQUIRED, {TESTS: textwrap.dedent(LIB_TESTS)}, django=False, pytest=True, inproc=set()
    )
    text = plan.files[TESTS]
    for literal in ("15", "expected = 12", "0.3", "10)", "9)"):
        assert literal not in text, literal
    held = [v for s in plan.sites.values() for h, v in s.held if h]
    assert 15 in held and 12 in held and 10 in held and 9 in held
    assert any(isinstance(v, rewrite.Approx) and v.expected == 0.3 for v in held)


def test_a_check_written_with_a_stray_comma_is_still_a_judged_site() -> None:
    # Round 109: ``self.assertEqual(a, b),`` is a one-item tuple of the check, which runs it
    # all the same; the rewriter left it in process.
    source = """
        import unittest

        from lib import area


        class T(unittest.TestCase):
            def test_equal(self):
                self.assertEqual(area(3, 5), 15),
    """
    test = f"{TESTS}::T::test_equal"
    plan = rewrite.plan_files([test], {TESTS: textwrap.dedent(source)}, django=False,
                              pytest=True, inproc=set())  # fmt: skip
    (site,) = plan.sites.values()
    assert site.mode == "judge" and site.counted, site
    assert 15 in [v for h, v in site.held if h] and "15" not in plan.files[TESTS]


def test_equality_that_lies_never_reaches_the_judge(tmp_path: Path) -> None:
    # A float whose __eq__ is always true, and a str subclass that lies in every way it can:
    # both become their exact base type from their own data before they leave the process.
    liars = """
        class Always(float):
            def __eq__(self, other):
                return True
            __hash__ = float.__hash__
            def __gt__(self, other):
                return True

        def area(w, h):
            return Always(-1.0)
    """
    verdicts, outcomes = _judge(tmp_path, liars)
    failed = {t for t, v in verdicts.items() if v.outcome != "passed"}
    assert {f"{TESTS}::test_area", f"{TESTS}::TestUnit::test_equal"} <= failed
    control = {t for t in (f"{TESTS}::test_area", f"{TESTS}::TestUnit::test_equal")}
    assert all(outcomes[t] == "passed" for t in control)  # in process, the lie wins


def test_a_computed_expected_value_is_the_gold_runs(tmp_path: Path) -> None:
    # area(2, 3) == area(3, 2) holds for a constant function: the gold run's 6 pins it.
    verdicts, outcomes = _judge(tmp_path, "def area(w, h):\n    return 0\n")
    symmetric = verdicts[f"{TESTS}::test_symmetric"]
    assert symmetric.outcome == "failed" and "gold run" in symmetric.detail
    assert outcomes[f"{TESTS}::test_symmetric"] == "passed"  # the control


def test_a_value_the_tests_own_equality_takes_meets_the_gold_runs(tmp_path: Path) -> None:
    # Round 79: the gold fix answered 4.0, a correct fix 4, and the task's own tests passed on
    # both; the gold pin took only the gold run's exact type, so the fix scored 0.
    verdicts, outcomes = _judge(tmp_path / "float", "def area(w, h):\n    return float(w * h)\n")
    for name in ("test_area", "test_symmetric"):
        assert verdicts[f"{TESTS}::{name}"].outcome == "passed"
        assert outcomes[f"{TESTS}::{name}"] == "passed"
    # ``isinstance(area(2, 2), int)`` still tells them apart, as the test does.
    assert verdicts[f"{TESTS}::test_type"].outcome == "failed"
    # The control: a value the test's ``==`` does not take for the gold run's still fails.
    verdicts, outcomes = _judge(tmp_path / "off", "def area(w, h):\n    return w * h + 0.5\n")
    symmetric = verdicts[f"{TESTS}::test_symmetric"]
    assert symmetric.outcome == "failed" and "gold run" in symmetric.detail
    assert outcomes[f"{TESTS}::test_symmetric"] == "passed"


def test_a_test_whose_assertions_are_skipped_fails(tmp_path: Path) -> None:
    # The code under test silences the sender: no events, while every test passes in process.
    silencer = GOLD + "import builtins\nbuiltins.__legorl__.check = lambda *a: None\n"
    verdicts, outcomes = _judge(tmp_path, silencer)
    assert verdicts[f"{TESTS}::test_area"].outcome == "mismatch"
    assert outcomes[f"{TESTS}::test_area"] == "passed"


def test_forged_events_with_a_guessed_value_fail(tmp_path: Path) -> None:
    # The code under test sends its own event for the site instead of the real value.
    forger = GOLD.replace("return w * h", "return 14") + "\n"
    verdicts, _ = _judge(tmp_path, forger)
    assert verdicts[f"{TESTS}::test_area"].outcome == "failed"


def test_plain_data_is_rebuilt_from_the_base_types_own_data() -> None:
    sys.path.insert(0, str(ROOT / "src" / "legorl" / "verify"))
    try:
        import operands
    finally:
        sys.path.pop(0)

    class Liar(str):
        def __str__(self) -> str:
            return "lie"

        def __getitem__(self, key: object) -> str:
            return "lie"

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    class Big(int):
        def __pos__(self) -> int:
            return 99

    value = operands.plain({"k": [Liar("abc"), (Big(5),)]})
    assert value == {"k": ["abc", (5,)]}
    assert type(value["k"][0]) is str and type(value["k"][1][0]) is int
    try:
        operands.plain(object())
    except operands.NotPlain:
        pass
    else:
        raise AssertionError("an object is not plain data")


def test_tagged_values_are_rebuilt_by_the_judge_and_compared_as_python_does() -> None:
    # Round 33 (from the code): a date crossed as the tuple ("\0date", y, m, d), so a tuple of
    # the code under test's spelled that way equalled the date; a naive and an aware datetime
    # ordered by their tags where Python refuses; an OrderedDict crossed as a dict and lost its
    # order. A tag now leads with ``...``, which no plain value holds, and the judge rebuilds the
    # value as its type.
    import collections
    import datetime as dt

    from legorl.verify import assertions
    from legorl.verify.rewrite import Site

    sys.path.insert(0, str(ROOT / "src" / "legorl" / "verify"))
    try:
        import operands
    finally:
        sys.path.pop(0)

    def judged(op: str, a: object, b: object) -> bool:
        event = assertions.decode({"site": "s", "v": [operands._pack(a), operands._pack(b)]})
        assert event is not None and all(event.plain), event
        site = Site("s", op, [(False, None), (False, None)])
        return assertions.holds(site, event.values, event)

    day = dt.date(2020, 1, 1)
    for a, b in [
        (day, dt.date(2020, 1, 1)),
        (dt.datetime(2020, 1, 1, 12), dt.datetime(2020, 1, 1, 12)),
        (
            dt.datetime(2020, 1, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2))),
            dt.datetime(2020, 1, 1, 10, tzinfo=dt.UTC),
        ),
        (dt.time(1, 2, 3), dt.time(1, 2, 3)),
        (dt.timedelta(days=1, seconds=5), dt.timedelta(seconds=86405)),
        ([day, {"k": (day,)}], [day, {"k": (day,)}]),
    ]:
        assert judged("eq", a, b) and a == b
    # Python's own answers where the tags used to decide otherwise.
    for spoof in [("\0date", 2020, 1, 1), ("date", 2020, 1, 1)]:
        assert not judged("eq", spoof, day) and spoof != day
    assert "x" in operands._pack((..., "date", 2020, 1, 1))  # ``...`` is no plain data
    naive, aware = dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 2, tzinfo=dt.UTC)
    assert not judged("lt", naive, aware) and not judged("eq", naive, aware)
    assert not judged("lt", dt.date(2020, 1, 1), dt.datetime(2020, 1, 2))
    assert judged("lt", dt.date(2020, 1, 1), dt.date(2020, 1, 2))
    one = collections.OrderedDict([("a", 1), ("b", 2)])
    two = collections.OrderedDict([("b", 2), ("a", 1)])
    assert not judged("eq", one, two) and one != two
    assert judged("eq", one, {"b": 2, "a": 1}) and one == {"b": 2, "a": 1}
    two.move_to_end("b")  # the odict's own order, not its dict's
    assert judged("eq", one, two) and one == two
    # A malformed tag reads as no plain data.
    for bad in [(..., "date", 2020, 13, 1), (..., "odict", [[1]]), (..., "nope"), (...,)]:
        event = assertions.decode(
            {"site": "s", "v": [{"m": binascii.b2a_base64(marshal.dumps(bad, 2)).decode()}]}
        )
        assert event is not None and event.plain == [False], bad


def test_class_names_are_types_own_not_a_metaclasss() -> None:
    # Round 16 (from the code): a metaclass's ``__mro__`` or ``__module__`` property made a
    # RuntimeError's class names, which isinstance checks and raised classes are judged by,
    # read as a ValueError's.
    from legorl.verify import operands

    class Lying(type):
        @property
        def __mro__(cls):  # type: ignore[override]
            return (cls, ValueError, BaseException, object)

        __module__ = property(lambda cls: "builtins")  # type: ignore[assignment]

    class Forged(RuntimeError, metaclass=Lying):
        pass

    assert ValueError in Forged.__mro__ and Forged.__module__ == "builtins"  # the lie itself
    names = operands.mro(Forged())
    assert names[0] == [__name__, "test_class_names_are_types_own_not_a_metaclasss.<locals>.Forged"]
    assert ["builtins", "RuntimeError"] in names and ["builtins", "ValueError"] not in names
    sent: list[dict] = []
    operands._emit[0] = sent.append
    try:
        with operands.raises("s", contextlib.suppress(Exception)):
            raise Forged
    finally:
        operands._emit[0] = None
    assert sent[0]["v"][0]["t"] == names


def test_unittest_and_django_names_locate_their_functions() -> None:
    unit = "test_escape (utils_tests.test_html.TestUtilsHtml.test_escape)"
    assert rewrite.locate(unit, django=True, pytest=False) == (
        "tests/utils_tests/test_html.py",
        "TestUtilsHtml.test_escape",
        "utils_tests.test_html.TestUtilsHtml.test_escape",
    )
    assert rewrite.locate("t/test_a.py::TestX::test_y[1-2]", django=False, pytest=True) == (
        "t/test_a.py",
        "TestX.test_y",
        "t/test_a.py::TestX::test_y[1-2]",
    )


def test_a_root_pytest_module_does_not_run_and_is_named(tmp_path: Path) -> None:
    repo = _repo(tmp_path, GOLD.replace("w * h", "w + h"))
    (repo / "pytest.py").write_text("raise SystemExit('the fake ran')\n")
    proc = _boot(repo, "-q", "-p", "no:cacheprovider", "tests")
    results = PytestReportParser().parse(proc.stdout, KEY.encode())
    log = (tmp_path / "run.log").read_text()
    assert "the fake ran" not in log + proc.stdout.decode() + proc.stderr.decode()
    assert results.finished and results.shadowed == ["pytest"]
    assert results.outcomes[f"{TESTS}::test_type"] == "passed"
    assert results.outcomes[f"{TESTS}::test_area"] == "failed"
    assert proc.returncode == results.exitstatus == 1
    assert results.tampered == []  # an honest run leaves the runner as it found it


def test_only_watched_tests_get_records_and_the_output_goes_to_the_log(tmp_path: Path) -> None:
    repo = _repo(tmp_path, GOLD.replace("w * h", "w + h"))
    proc = _boot(repo, "-rA", "tests", watch=[f"{TESTS}::test_type"])
    results = PytestReportParser().parse(proc.stdout, KEY.encode())
    assert results.outcomes == {f"{TESTS}::test_type": "passed"}
    assert results.others_failed >= 1  # test_area, counted in the finish record
    log = (tmp_path / "run.log").read_text()
    assert b"PASSED" not in proc.stdout and f"PASSED {TESTS}::test_type" in log


def test_the_grader_code_is_never_a_file_in_the_repository(tmp_path: Path) -> None:
    repo = _repo(tmp_path, GOLD)
    _boot(repo, "-q", "tests")
    names = {p.name for p in repo.rglob("*")}
    assert not names & {"bootstrap.py", "pytest_report.py", "operands.py", "audit.py"}
    assert json.loads(_bundle({})).keys() == {"modules", "options"}


def _diff(path: str, added: str) -> str:
    lines = "".join(f"+{line}\n" for line in textwrap.dedent(added).splitlines())
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,0 +1,9 @@\n{lines}"


def test_runner_internals_in_added_code_are_suspect_outside_tests_and_tooling() -> None:
    task = next(iter(read_jsonl(ROOT / "fixtures" / "tasks" / "train.jsonl", Task)))
    reach = "import gc\nfrom _pytest import runner\n"
    assert runner_tamper_suspects(_diff("geo.py", reach), task) == ["geo.py: _pytest"]
    assert runner_tamper_suspects(_diff("tests/test_geo.py", reach), task) == []
    assert runner_tamper_suspects(_diff("geo.py", "x = 1\n"), task) == []
    assert runner_tamper_suspects(_diff("bin/run", reach), task) == ["bin/run: _pytest"]
    assert runner_tamper_suspects(_diff("site.pth", reach), task) == ["site.pth: _pytest"]
    # notes and data run nowhere (round 100: a .gitignore naming .pytest_cache/ was flagged)
    assert runner_tamper_suspects(_diff(".gitignore", ".pytest_cache/\n"), task) == []
    assert runner_tamper_suspects(_diff("docs/notes.md", reach), task) == []
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


def test_a_marshalled_operand_is_checked_before_it_is_loaded() -> None:
    import marshal

    plain = [None, 2**100, 1.5, "é" * 300, b"xy", [1, (2, {3})], {"a": {1: [2]}, 2: ()}]
    assert all(assertions.marshal_sound(marshal.dumps(v, 2)) for v in plain)
    # A value shared 2**40 ways takes a few hundred bytes with back-references: refused.
    shared: list = [0]
    for _ in range(40):
        shared = [shared, shared]
    assert not assertions.marshal_sound(marshal.dumps(shared))
    # A few bytes that declare a list of 2**31 - 1 items, a truncated value, a code object.
    huge = b"[\xff\xff\xff\x7f"
    code = marshal.dumps(compile("1", "x", "eval"))
    assert not any(map(assertions.marshal_sound, (huge, marshal.dumps([1, 2])[:-1], code)))
    import binascii

    event = assertions.decode(
        {"event": "a", "site": "s", "v": [{"m": binascii.b2a_base64(huge).decode()}]}
    )
    assert event is not None and event.plain == [False]


def test_the_containers_built_from_one_runs_operands_are_budgeted() -> None:
    # Round 3: 11 operands of 999,000 ``{None: None}`` each (4 MB marshalled, under the cap)
    # made verify build 2.7 GB of dicts. One run's operands now build at most CONTAINERS
    # containers; the rest read as not plain data (a failure where the gold run's were plain).
    import binascii
    import marshal

    blob = binascii.b2a_base64(marshal.dumps([{None: None}] * 150_000, 2)).decode()
    records = [{"event": "tb", "key": "k"}]
    records += [{"event": "a", "site": "s", "v": [{"m": blob}]} for _ in range(3)]
    records.append({"event": "te", "key": "k"})
    events = assertions.by_test(records)["k"].events
    assert [e.plain for e in events] == [[True], [False], [False]]
    assert assertions.CONTAINERS < 2 * 150_001
    small = {
        "event": "a",
        "site": "s",
        "v": [{"m": binascii.b2a_base64(marshal.dumps([1])).decode()}],
    }
    assert assertions.decode(small, assertions.Budget(1)).plain == [True]
    assert assertions.decode(small, assertions.Budget(0)).plain == [False]
    # Round 5: short texts are 2 bytes marshalled and 50-byte objects; values of every kind
    # are counted too (a list of 1,500,000 one-letter texts, then another: the second is over)
    texts = binascii.b2a_base64(marshal.dumps(["a"] * 1_500_000, 2)).decode()
    records = [{"event": "tb", "key": "t"}]
    records += [{"event": "a", "site": "s", "v": [{"m": texts}]} for _ in range(2)]
    records.append({"event": "te", "key": "t"})
    assert [e.plain for e in assertions.by_test(records)["t"].events] == [[True], [False]]


def test_the_walk_of_one_runs_operands_stops_at_its_budget() -> None:
    # Round 9: eleven operands of 4,190,000 Nones each (under the sender's cap) were each
    # walked whole before the budget was checked, 9 s of verify's event loop. The walk stops
    # where the values left run out, and then the run's operands are spent.
    import marshal

    budget = assertions.Budget(values=1_000)

    assert not assertions.marshal_sound(marshal.dumps([None] * 100_000, 2), budget)
    assert (budget.containers, budget.hashing, budget.values) == (0, 0, 0)
    assert not assertions.marshal_sound(marshal.dumps([1], 2), budget)
    budget = assertions.Budget(values=3)
    assert assertions.marshal_sound(marshal.dumps([1, 2], 2), budget)  # exactly three values
    assert budget.values == 0


def test_the_hashing_work_of_one_runs_operands_is_budgeted() -> None:
    # Round 4: a set of 150,000 ints that all hash to 0 (``i * (2**61 - 1)``), 2.2 MB marshalled
    # and under every byte cap, cost ``marshal.loads`` minutes of comparisons on verify's event
    # loop, which stalled every other grading of the batch. Round 5: 3,162 colliding tuples of
    # 10,001 items each (32 MB) cost as much, each comparison as long as the tuples. Sets and
    # dicts are charged their item count times their items' bytes before anything is built:
    # both read as not plain, unbuilt.
    import binascii
    import marshal

    def event(value: object) -> dict:
        blob = binascii.b2a_base64(marshal.dumps(value, 2)).decode()
        return {"event": "a", "site": "s", "v": [{"m": blob}]}

    colliding = {i * ((1 << 61) - 1) for i in range(1, 5000)}
    assert len({hash(k) for k in colliding}) == 1
    flood = event(colliding)
    assert assertions.decode(flood).plain == [False]
    long_items = {(None,) * 10_000 + (i * ((1 << 61) - 1),) for i in range(1, 101)}
    assert len({hash(k) for k in long_items}) == 1
    assert assertions.decode(event(long_items)).plain == [False]  # 100 of 10,001 items
    assert assertions.decode(event({"k": frozenset(range(3000))})).plain == [True]
    # the work is the run's: a few sets of 2,000 pass, the next past the budget does not
    budget = assertions.Budget()
    ordinary = event(set(range(2000)))
    seen = [assertions.decode(ordinary, budget).plain[0] for _ in range(3)]
    assert seen == [True, True, False]
    assert assertions.decode(event([1, 2]), budget).plain == [False]  # spent: nothing more
    assert assertions.decode(event({i: i for i in range(2000)})).plain == [True]
    # Round 36: the same keys as a tagged OrderedDict's pairs (a list, which nothing hashes
    # until the judge rebuilds the OrderedDict) are charged as a dict's.
    pairs = [[k, 0] for k in sorted(colliding)]
    assert assertions.decode(event((..., "odict", pairs))).plain == [False]
    small = [[i, i] for i in range(1000)]  # (its pairs cost more bytes than a dict's items)
    assert assertions.decode(event((..., "odict", small))).plain == [True]


def test_a_value_the_statement_shows_is_no_secret() -> None:
    # Round 4: a fix that special-cased the statement's example (``rectangle_area(3, 5)``,
    # "Expected: `15`") kept the bug and met the only check of the failing test. A held value
    # the statement shows is no secret; of a table, what counts is what the run without the
    # fix gets wrong.
    statement = "rectangle_area(3, 5) gives 8\n\nExpected: `15`\nActual: `8`, not 1.5"
    assert assertions.published(15, statement) and assertions.published(15.0, statement)
    assert assertions.published("Expected", statement) and assertions.published(1.5, statement)
    assert not assertions.published(150, statement) and not assertions.published(5.5, statement)
    assert not assertions.published(1, "1.50") and not assertions.published(15, "")
    unknown = assertions._unknown
    # the one item the bug gets wrong is the statement's example: special-casing it meets it
    assert not unknown([40, 25, 15], [40, 25, 8], statement)
    assert unknown([40, 25, 16], [40, 25, 8], statement)  # an answer nobody was shown
    # two wrong answers among right ones: the pattern is the secret, even of guessable items
    assert unknown([True, False, True, True], [True, True, True, False], "")
    assert not unknown([True, False], [False, True], "")  # flip every answer: a guess
    assert not unknown([15, 8], [9, 9], statement)  # every answer shown
    # without the unfixed run's value (it raised), the table as a whole
    assert unknown([40, 25, 0], assertions._MISSING, statement)
    # Round 14: wrong answers all shown, and the unfixed answer alone decides the right one:
    # a fix mapping the statement's Actual (8) to its Expected (15), or answering a constant,
    # meets the table
    assert not unknown([15, 15, 4, 0], [8, 8, 4, 0], statement)
    assert not unknown([False] * 4, [True, True, False, False], "")
    # the control: the same unfixed answer right in one row and wrong in another needs the fix
    assert unknown([15, 8, 4, 15], [8, 8, 4, 8], statement)
    assert unknown([False, True, False, True], [True, True, False, False], "")
    # Stop 53: right answers that differ only as 0 and 0.0 are one answer to the test's own
    # ``==``; a map of the raise (bank-3's withdrawal of the whole balance) to 0 meets both
    raised = ["ValueError", "ValueError", 3, "ValueError"]
    assert not unknown([0, 0.0, 3, 0], raised, "withdraw(50, 50) raises ValueError\nExpected: `0`")
    assert unknown([0, 0.0, 3, "ValueError"], raised, "withdraw(50, 50)\nExpected: `0`")
    assert not unknown([1.0, 2.0], [1, 2], "")  # the unfixed answers the test accepts: none wrong


def test_a_filter_answered_with_other_items_counts_only_its_wrong_items() -> None:
    # Round 15: ``[a for a in range(15, 21) if is_adult(a)] == [18, 19, 20]``; the unfixed run
    # answered ``[19, 20]``, so the same-length table rule did not apply and the whole list
    # counted as a secret, though the one item the bug gets wrong (18) is the statement's
    # example. Of lists of other lengths, and of sets, the items in one and not the other are
    # the wrong answers.
    unknown = assertions._unknown
    statement = "is_adult(18) returns False\n\nExpected: `True`"
    assert not unknown([18, 19, 20], [19, 20], statement)
    assert unknown([18, 19, 20], [19, 20], "")  # nobody was shown 18
    assert unknown([18, 19, 20, 21], [19, 20], statement)  # 21 was never shown
    assert not unknown([19, 20], [17, 19, 20], "is_adult(17) returns True")  # an extra, shown
    assert unknown([19, 20], [16, 19, 20], "is_adult(17) returns True")
    assert not unknown({18, 19, 20}, {19, 20, 21}, "18 and 21 are wrong")
    assert unknown({18, 19, 20}, {19, 20, 22}, "18 and 21 are wrong")
    assert not unknown([0, 1, 18], [1], statement)  # guesses and the example
    assert not unknown([[18], [19]], [[19]], "it drops `[18]`")  # unhashable items
    assert unknown([[18], [19]], [[19], [20]], "it drops `[18]`")
    assert unknown([18, 19], assertions._MISSING, statement)  # no unfixed answer: the whole
    # a long table's difference is counted by hash
    assert not unknown(list(range(20_000)), list(range(1, 20_000)), "is_adult(0)")


def test_a_value_the_statement_shows_in_any_spelling_is_no_secret() -> None:
    # Round 8: the real suite's statements quoted the failing test, whose expected values were
    # spelled otherwise than their repr; a fix returning them met every check, the bug kept.
    published = assertions.published
    quoted = (
        "It should pass:\n\n```python\ndef test_it(self):\n"
        "    expected = {(2, 2), (1, None), (None, 3)}\n"  # a set, in another order
        '    assert f("I have space") == [("I",), (" ",)]\n'  # double quotes
        "    assert get([1, 3], 'ABCDE') == list('BD')\n"  # a pure constructor
        '    self.assertEqual("-B\\u030A…", t.chars(3))\n'  # an escape
        "    self.assertEqual(\n        'Visit <a href=\"x\">'\n        'x</a> now',\n"  # joined
        "        urlize('x'))\n"
        "    assert out == [\n        10,\n        20,\n    ]\n```\n"  # a list over lines
    )
    assert published({(None, 3), (1, None), (2, 2)}, quoted)
    assert published([("I",), (" ",)], quoted) and published((("I",), (" ",)), quoted)
    assert published(["B", "D"], quoted) and published("-B\u030a…", quoted)
    assert published('Visit <a href="x">x</a> now', quoted) and published([10, 20], quoted)
    assert published(20, quoted)  # an item of a container shown
    assert not published({(2, 2)}, quoted) and not published(["B"], quoted)
    assert not published("Visit later", quoted) and not published(30, quoted)
    # a doctest's output line, an expression, a hex literal; a fragment that does not parse
    # is read token by token
    assert published([1, 2], "```\n>>> f()\n[1,\n 2]\n```")
    assert published(15, "it should give `3 * 5`") and published(15, "returns `0xF`")
    assert published("a b", "```\nx = f('a' ' b'  # ) unbalanced\n```")
    assert not published(16, "it should give `3 * 5`") and not published(15, "3 and 5")


def test_numbers_as_prose_writes_them_and_arithmetic_are_shown() -> None:
    # Round 12 (from the code): the statement reader took a prose number only as its repr, so
    # ``$12.00``, ``.25``, ``1,500`` or ``−2`` left 12.0, 0.25, 1500 and -2 secret, and
    # read no ``2**10``, ``1/2`` or ``dict(a=1)`` in code; a fix special-casing such an
    # example met its check with the bug kept.
    published = assertions.published
    for value, text in [
        (3.5, "it costs 3.50 now"),
        (12.0, "the total is $12.00"),
        (0.25, "a rate of .25"),
        (1500, "about 1,500 rows"),
        (-2, "it gives −2"),
        (1e21, "near 1e21"),
        (1024, "it should be `2**10`"),
        (0.5, "half: `1/2`"),
        (2, "`7 // 3`"),
        ({"a": 1}, "`dict(a=1)`"),
    ]:
        assert published(value, text), (value, text)
    # the controls: other numbers, a date's parts are no numbers, no power past the bound
    assert not published(3.4, "it costs 3.50 now") and not published(150, "about 1,500 rows")
    assert not published(2, "on 2024-02-03") and not published(3, "on 2024-02-03")
    assert not published(2**100, "`2**100`") and not published({"a": 2}, "`dict(a=1)`")
    # a closeness against a dict the statement shows
    from legorl.verify.rewrite import Approx, Site

    site = Site(id="t.py:1:1", op="approx", held=[(False, None), (True, Approx({"a": 1331}))])
    shown = "Expected: `{'a': 1331.0000000000005}`"
    assert assertions._near_known(site, Approx({"a": 1331}), shown)
    assert not assertions._near_known(site, Approx({"a": 1400}), shown)


def test_a_closeness_a_shown_number_meets_is_no_secret() -> None:
    # Round 10: the statement showed 1331.0000000000005 and the test checked approx(1331);
    # copying the statement's number meets it, so it is no secret (an equality it is not).
    from legorl.verify.rewrite import Approx, Site

    statement = "`compound(1000, 0.1, 3)` gives 2300.0\n\nExpected: `1331.0000000000005`\n"
    approx = Site(id="t.py:1:1", op="approx", held=[(False, None), (True, Approx(1331))])
    almost = Site(id="t.py:2:1", op="almost", held=[(False, None), (True, 1331)])
    almost.extra["places"] = 2
    assert assertions._near_known(approx, Approx(1331), statement)
    assert assertions._near_known(almost, 1331, statement)
    assert not assertions._near_known(approx, Approx(1400), statement)
    assert not assertions._near_known(almost, 1330, statement)
    equal = Site(id="t.py:3:1", op="eq", held=[(False, None), (True, 1331)])
    assert not assertions._near_known(equal, 1331, statement)  # equality: shown or not


def test_a_closeness_a_guess_meets_is_no_secret() -> None:
    # Round 13 (from the code): 0 meets approx(0.3, abs=0.5), approx(1e-13) (the absolute
    # tolerance is 1e-12) and assertAlmostEqual(x, 0.3, places=0); such a check counted as a
    # secret though a guess meets it.
    from legorl.verify.rewrite import Approx, Site

    def approx(expected: Approx) -> Site:
        return Site(id="t.py:1:1", op="approx", held=[(False, None), (True, expected)])

    near = assertions._near_known
    assert near(approx(Approx(0.3, abs=0.5)), Approx(0.3, abs=0.5), "")
    assert near(approx(Approx(1e-13)), Approx(1e-13), "")
    assert near(approx(Approx(-0.9, rel=0.2)), Approx(-0.9, rel=0.2), "")
    almost = Site(id="t.py:2:1", op="almost", held=[(False, None), (True, 0.3)])
    almost.extra["places"] = 0
    assert near(almost, 0.3, "")
    # the controls: tolerances no guess meets
    assert not near(approx(Approx(0.3)), Approx(0.3), "")
    assert not near(approx(Approx(2.5, abs=1.0)), Approx(2.5, abs=1.0), "")
    assert not near(approx(Approx({"a": 0.3})), Approx({"a": 0.3}), "")


def test_a_held_container_or_pattern_a_guess_meets_is_no_secret() -> None:
    # Round 11 (from the code): ``x in (0, 7919)`` is met by 0, a guess, and ``x in "a text"``
    # by any part of it; ``match=".*error"`` by messages nobody was shown. A held container
    # is a secret only when every member is; a pattern only when it is plain text.
    assert not assertions._every_member_unknown((0, 7919), "")
    assert not assertions._every_member_unknown(["shown", "secret"], "it printed `shown`")
    assert not assertions._every_member_unknown("a secret text", "")
    assert assertions._every_member_unknown((7919, 104729), "")
    assert all(c in assertions._REGEX for c in ".*|")
    assert not any(c in assertions._REGEX for c in "update expected at most 1 argument, got 2")


_BACKTRACKING_SCAN = r"""
from legorl.records import Task
from legorl.verify.scans import constant_comparisons, runner_tamper_suspects
docstring = chr(34) * 3
lines = ["see __eq__" + " " * 4000 + "x", "def __eq__(self" + " " * 3000,
         "__eq__ = " + "= " * 2000 + "lambda"] * 40
lines += ["def __eq__(self):", "    " + docstring] * 2000
nl = chr(10)
patch = nl.join(["diff --git a/n.py b/n.py", "--- a/n.py", "+++ b/n.py", "@@ -0,0 +1 @@", ""])
patch += "".join("+" + line + nl for line in lines)
task = Task(instance_id="t", repo="r/r", base_commit="0" * 40, problem_statement="",
            test_patch="", FAIL_TO_PASS=[], PASS_TO_PASS=[], version="0",
            environment_setup_commit="0" * 40)
print(len(constant_comparisons(patch)), len(runner_tamper_suspects(patch, task)))
"""


def test_the_scans_are_linear_on_lines_made_to_backtrack() -> None:
    # Round 3: ``"__eq__" + " " * 4000`` took 41 s in the old lambda pattern (cubic), on
    # verify's event loop. Now every repetition is bounded and long lines are skipped; the
    # child's timeout only guards the test (the old scan takes hours on these lines).
    done = subprocess.run(
        [sys.executable, "-c", _BACKTRACKING_SCAN], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"]


def test_printed_passes_are_read_word_by_word_and_long_lines_are_skipped() -> None:
    from legorl.verify import SCAN_LINE, printed_passes

    required = {"t.py::test_a", "t.py::test_b"}
    log = "t.py::test_a PASSED\nPASSED t.py::test_b\nnoise t.py::test_a PASSED\n"
    assert printed_passes(log, required) == {"t.py::test_a", "t.py::test_b"}
    flood = "a::" * (SCAN_LINE * 100) + " PASSED t.py::test_a\n"  # one line of 1.2 MB
    assert printed_passes(flood, required) == set()


def test_the_result_writing_scan_is_linear_on_a_diff_made_to_backtrack() -> None:
    # Round 6: a 155 KB binary patch made a 24 MB text of ``::test`` lines; the old pattern
    # (``::test\w*\W.*\b(PASSED|passed)\b``) backtracked on every line, on verify's event loop,
    # for minutes. Now each added line is read word by word (the child's timeout only guards
    # the test; the old pattern takes minutes on this diff).
    program = (
        "from legorl.verify import _writes_results\n"
        "diff = ('+' + '::test' * 680 + chr(10)) * 6000\n"
        "print(_writes_results(diff), _writes_results('+print(\"t.py::test_a PASSED\")'),\n"
        "      _writes_results('+# t.py::test_a passed'), _writes_results('+x = 1'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "False"]


def test_signed_records_past_what_they_may_cost_decoded_count_for_nothing() -> None:
    # Round 6: the judged code can sign records (the channel is in its process); one signed
    # list of 29 million numbers decoded to 1.1 GB twice. Round 101: 11 MB of lists nested
    # 400 deep, inside the old budget of brackets, commas and colons, grew the judge by 380
    # MB. A stream's records may cost DECODED_BYTES decoded in all (an upper bound from their
    # text); past that a record counts as forged.
    import hashlib
    import hmac
    import json
    import tracemalloc

    from legorl.verify.parsers import DECODED_BYTES, decoded_cost, records
    from legorl.verify.pytest_report import GENESIS, MARK

    # The bound holds on every shape JSON decodes to (measured, not assumed).
    shapes = {
        "nested lists": "[" * 400 + "]" * 400,
        "empty lists": "[" + ",".join(["[]"] * 2000) + "]",
        "empty dicts": "[" + ",".join(["{}"] * 2000) + "]",
        "one-key dicts": "[" + ",".join(['{"a":0}'] * 2000) + "]",
        "nested dicts": '{"a":' * 400 + "0" + "}" * 400,
        "small ints": "[" + ",".join(["0"] * 4000) + "]",
        "large ints": "[" + ",".join(["1234567890123"] * 4000) + "]",
        "floats": "[" + ",".join(["1.5"] * 4000) + "]",
        "strings": "[" + ",".join(['"abcdefgh"'] * 4000) + "]",
        "escaped strings": "[" + ",".join(['"\\u00e9\\n"'] * 4000) + "]",
        "long string": '"' + "x" * 100_000 + '"',
    }
    for name, text in shapes.items():
        tracemalloc.start()
        value = json.loads(text)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del value
        assert used <= decoded_cost(text.encode()), (name, used, decoded_cost(text.encode()))

    key = b"k" * 32

    def chain(bodies: list[bytes]) -> bytes:
        out, prev = [], GENESIS
        for seq, body in enumerate(bodies):
            mac = hmac.new(key, b"%d %s %s" % (seq, prev.encode(), body), hashlib.sha256)
            prev = mac.hexdigest()
            out.append(b"%s %d %s %s" % (MARK.encode(), seq, body, prev.encode()))
        return b"\n".join(out)

    small = json.dumps({"event": "finish", "exitstatus": 0}).encode()
    flood = json.dumps({"event": "tampered", "what": [0] * (DECODED_BYTES // 60)}).encode()
    found, forged = records(chain([small, flood, small]), key)
    assert [r["event"] for r in found] == ["finish"] and forged == 2  # the chain breaks there
    nested: list = [0]
    for _ in range(400):  # round 101's shape
        nested = [nested]
    deep = json.dumps({"event": "z", "p": nested}).encode()
    many = DECODED_BYTES // decoded_cost(deep) + 50
    found, forged = records(chain([deep] * many), key)
    assert len(found) > 0 and len(found) * decoded_cost(deep) <= DECODED_BYTES
    assert forged == many - len(found)  # the chain breaks at the first record past it
    found, forged = records(chain([small, small]), key)
    assert len(found) == 2 and forged == 0


def test_a_signed_record_of_the_wrong_shape_counts_for_nothing() -> None:
    # Round 101: a signed ``finish`` record with ``failed: Infinity`` raised OverflowError
    # out of the parser (the grading then failed, and the control made it the patch's 0).
    from legorl.verify.parsers import PytestReportParser

    odd = [
        {"event": "finish", "exitstatus": 0, "failed": float("inf")},
        {"event": "finish", "exitstatus": 0, "failed": "1"},
        {"event": "test", "nodeid": ["x"], "outcome": "passed", "when": "call"},
    ]
    results = PytestReportParser().read(odd, 0)
    assert results.forged_lines == 3 and not results.finished and not results.outcomes


def test_a_verdict_holds_only_small_plain_json() -> None:
    # Round 6: a signed ``tampered`` record with ``what: 2**70`` went into the verdict, and the
    # writer refused it: `legorl verify` stopped, and the rest of the batch was lost (a lone
    # surrogate in a collected test's name did the same). Whatever the judged run said, the
    # verdict is plain JSON of bounded size.
    import orjson

    from legorl.verify import VERDICT_ITEMS, VERDICT_TEXT, bounded

    raw = {
        "tampered": [2**70, -(2**80), "x\udc80y", float("nan"), object()],
        "deep": [[[[[[[[[[[["bottom"]]]]]]]]]]]],
        "long": "a" * (VERDICT_TEXT * 10),
        "many": list(range(VERDICT_ITEMS * 10)),
        7: "a key that is not text",
    }
    written = orjson.dumps(bounded(raw))  # the CLI's writer takes it
    assert len(written) < 64 * VERDICT_ITEMS
    back = orjson.loads(written)
    assert back["tampered"][:3] == ["<int of 71 bits>", "<int of 81 bits>", "x?y"]
    assert len(back["long"]) == VERDICT_TEXT
    assert back["many"][-1].endswith("more>")
    assert "bottom" not in written.decode()
    assert bounded({"a": [1, "b", None, True, 2.5]}) == {"a": [1, "b", None, True, 2.5]}


def test_the_record_reader_cuts_out_only_the_lines_that_hold_the_mark() -> None:
    # Round 7: 64 MiB of ``\xff\n`` written to the record channel made 32 million line objects
    # before one was checked (verify at 2.16 GB for one trajectory). Only lines with the mark
    # are cut out now: the reader's own allocations stay small whatever the stream holds.
    import tracemalloc

    from legorl.verify.parsers import records

    flood = b"\xff\n" * (8 << 20)
    tracemalloc.start()
    try:
        found, forged = records(flood, b"k" * 32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (found, forged) == ([], 0)
    assert peak < 1 << 20, peak  # the old splitlines() held 8 million objects (~300 MB)


def test_a_patch_past_the_size_grading_reads_is_refused_before_it_is_read() -> None:
    # Round 7: a 40 MB patch (a file of empty lines) held verify's event loop 13 s and 1.5 GB
    # in the strict reader; a rollout's diff can be 160 MB. Past MAX_PATCH it is refused, 0.
    from legorl.records import Task
    from legorl.verify.tree import MAX_PATCH, apply_model_patch

    task = Task(instance_id="t", repo="r/r", base_commit="0" * 40, problem_statement="",
                test_patch="", FAIL_TO_PASS=[], PASS_TO_PASS=[], version="0",
                environment_setup_commit="0" * 40)  # fmt: skip
    body = "+\n" * (MAX_PATCH // 2 + 10)
    patch = f"diff --git a/big b/big\nnew file mode 100644\n--- /dev/null\n+++ b/big\n@@ -0,0 +1 @@\n{body}"
    judged = asyncio.run(apply_model_patch(None, task, patch))  # type: ignore[arg-type]
    assert judged.method is None and judged.refused == "patch_too_large", judged
    assert f"{MAX_PATCH:,}" in judged.error


def test_count_equal_is_judged_as_unittest_does_and_in_bounded_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round 47 (read): the judge paired ``assertCountEqual``'s items off in quadratic time, on
    # operands the judged code makes (up to 4 MiB each). Hashable items are now counted, and
    # the unhashable rest is paired within a budget of comparisons, past which it fails.
    import unittest

    from legorl.verify import assertions

    case = unittest.TestCase()

    def python(a: list, b: list) -> bool:
        try:
            case.assertCountEqual(a, b)
        except AssertionError:
            return False
        return True

    pairs = [
        ([1, 2, 2, "x"], [2, "x", 1, 2]),
        ([1, 2, 2], [1, 1, 2]),
        ([(1, 2), [3], {"k": 1}], [{"k": 1}, (1, 2), [3]]),
        ([[3], [3], [4]], [[4], [3], [3]]),
        ([[3], [3], [4]], [[4], [4], [3]]),
        ([float("nan")], [float("nan")]),
        ([(1, [2])], [(1, [2])]),
        ([1, 2], [1, 2, 3]),
    ]
    for a, b in pairs:
        assert assertions._count_eq(a, b) == python(a, b), (a, b)
    # Exact types at the top, as the judge's equality is: 1 and True are not one item.
    assert not assertions._count_eq([1], [True]) and not assertions._count_eq([1], [1.0])
    # Linear on hashable items: a million each way is counted at once.
    big = list(range(1_000_000))
    assert assertions._count_eq(big, big[::-1])
    # The unhashable rest within the budget, and past it not equal.
    lists = [[i] for i in range(300)]
    assert assertions._count_eq(lists, lists[::-1])
    monkeypatch.setattr(assertions, "COUNT_EQ_BUDGET", 1000)
    assert not assertions._count_eq(lists, lists[::-1])  # 45,150 comparisons needed
    assert assertions._count_eq(lists[:10], lists[:10][::-1])


def test_no_code_of_the_values_classes_runs_inside_the_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round 52: code under test ran inside the sender while it packed an operand, and changed
    # what went out: datetime's classes read from the module at send time (a class whose
    # metaclass's __subclasscheck__ swapped the value's fields for the expected ones), a
    # namespace entry whose __class__ property ran when the sender asked whether it was a
    # class, a class compared with ``==`` (a metaclass's __eq__), a module dropped from
    # sys.modules so that a class of the patch's kept the name of the one a check expects,
    # an exception's __str__ editing the class names already read, a warning's message.
    # Each hook below records that it ran; the control shows Python itself calls it.
    import datetime as dt

    from legorl.verify import operands

    ran: list[str] = []

    class Meta(type):
        def __eq__(cls, other):  # type: ignore[override]
            ran.append("eq")
            return NotImplemented

        __hash__ = type.__hash__

        def __subclasscheck__(cls, other):
            ran.append("subclasscheck")
            return type.__subclasscheck__(cls, other)

    class Listy(list, metaclass=Meta):
        pass

    class Tick(dt.timedelta, metaclass=Meta):
        pass

    class Ghost:
        @property  # type: ignore[misc]
        def __class__(self):
            ran.append("class")
            return type

    Listy.__qualname__ = "ghost.inner"
    sent: list[dict] = []
    monkeypatch.setattr(operands, "_emit", [sent.append])
    fake = type(sys)("ghost")
    fake.ghost = Ghost()
    monkeypatch.setitem(sys.modules, "ghost", fake)
    Listy.__module__ = "ghost"
    # The controls: Python calls each hook.
    assert Listy in (list,) or ran == ["eq"]
    issubclass(list, Tick)
    assert isinstance(fake.ghost, type) and ran == ["eq", "subclasscheck", "class"]
    ran.clear()
    # datetime's own class swapped after the sender was loaded: its captured one is read.
    monkeypatch.setattr(dt, "timedelta", Tick)
    operands.check("s", Listy([3, 1, 2]), Tick(seconds=5))
    assert ran == [], ran
    event = assertions.decode({"site": "s", "v": sent[0]["v"]})
    assert event is not None and event.values[0] == [3, 1, 2], event
    assert event.values[1] == dt.timedelta(seconds=5)
    # A module dropped from sys.modules: a class claiming to be in it is named ``?``.
    monkeypatch.delitem(sys.modules, "decimal", raising=False)
    impostor = type("Decimal", (), {"__module__": "decimal"})
    assert operands.mro(impostor())[0] == ["?", "?"]
    # An exception's __str__ runs before the class names are read, so it cannot edit them.

    class Loud(Exception):
        def __str__(self):
            frame = sys._getframe(1)
            names = frame.f_locals.get("names")
            if isinstance(names, list):
                names[:] = [["builtins", "ValueError"]]
            ran.append("str")
            return "loud"

    sent.clear()
    with operands.raises("r", contextlib.suppress(Exception)):
        raise Loud
    assert ran == ["str"]
    assert sent[0]["v"][0]["t"][0][1].endswith(".<locals>.Loud"), sent  # not ValueError
    # A warning's message that is not a str goes out as ``?``, its __str__ never called.

    class Said:
        def __str__(self):
            ran.append("warn-str")
            return "said"

    assert operands._warning_text(UserWarning(Said())) == "?"
    assert operands._warning_text(UserWarning("plain")) == "plain" and "warn-str" not in ran


def test_the_senders_warning_recorder_uses_the_warnings_module_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round 53: ``catch_warnings`` takes the warnings module from sys.modules when it is made,
    # and code under test swapped in one whose __setattr__ ran inside the sender's recorder and
    # added a warning to its log for a block that warned nothing.
    import warnings

    from legorl.verify import operands

    ran: list[str] = []

    class Swapped(type(warnings)):  # type: ignore[misc]
        def __setattr__(self, name: str, value: object) -> None:
            ran.append(name)
            type(warnings).__setattr__(self, name, value)

    fake = Swapped("warnings")
    fake.__dict__.update(vars(warnings))
    monkeypatch.setitem(sys.modules, "warnings", fake)
    with warnings.catch_warnings(record=True):  # the control: the swapped module is used
        pass
    assert ran, "the control's hook did not run"
    ran.clear()
    sent: list[dict] = []
    monkeypatch.setattr(operands, "_emit", [sent.append])
    with operands.warns("w", contextlib.nullcontext()):
        pass
    assert ran == [], ran
    event = assertions.decode({"site": "w", "v": sent[0]["v"]})
    assert event is not None and event.values[0] == [], event


SHOWN_AS_SUM = """
class Area(int):
    def __new__(cls, w, h):
        area = int.__new__(cls, w * h)
        area.shown = w + h
        return area

    def __repr__(self):
        return repr(self.shown)

    def __add__(self, other):
        return self.shown + other

def area(w, h):
    return Area(w, h) if type(w * h) is int else w * h
"""


def test_an_operand_holding_a_class_of_its_own_is_judged_on_the_gold_runs_classes(
    tmp_path: Path,
) -> None:
    """Round 89: an ``int`` subclass whose value is the fix's and whose ``repr`` and arithmetic
    are the bug's meets every equality on its data alone. The judge takes an operand's classes
    that are not built in only where the gold run's operand held them too: the same class
    returned by the gold patch passes, and so does a built-in type other than the gold run's
    (a float area where the gold's is an int, which the test's ``==`` takes)."""
    tests = """
        from lib import area


        def test_area():
            assert area(3, 5) == 15


        def test_area_held_local():
            expected = [5, 10, 15]
            assert [area(w, 5) for w in (1, 2, 3)] == expected
    """
    required = [f"{TESTS}::test_area", f"{TESTS}::test_area_held_local"]
    verdicts, outcomes = _judge(tmp_path / "shown", SHOWN_AS_SUM, tests)
    assert all(outcomes[t] == "passed" for t in required)  # the in-process outcome: a pass
    for t in required:
        assert verdicts[t].outcome == "failed", verdicts[t]
        assert "lib.Area" in verdicts[t].detail and "gold run's held none" in verdicts[t].detail
    verdicts, _ = _judge(tmp_path / "same", SHOWN_AS_SUM, tests, gold_lib=SHOWN_AS_SUM)
    assert {t: verdicts[t].outcome for t in required} == dict.fromkeys(required, "passed")
    floats = "def area(w, h):\n    return float(w * h)\n"
    verdicts, _ = _judge(tmp_path / "float", floats, tests)
    assert {t: verdicts[t].outcome for t in required} == dict.fromkeys(required, "passed")
