"""The grading side channel for ``unittest``-based runners (stdlib only, copied into the grading
sandbox): Django's ``tests/runtests.py``, ``python -m unittest``, any script that runs
``unittest`` suites.

    python -I -B /tmp/legorl-grade/boot-….py unittest SINK [OPTIONS] -- tests/runtests.py ARGS < key

`install` replaces ``unittest.TestCase.run`` before the repository joins ``sys.path``. Each test
then runs against a recorder of ours (a slotted ``TestResult`` subclass that lives only in this
module's closures), which keeps what the test's own machinery reported, signs the worst outcome
into the same chained stream as the pytest plugin (`pytest_report.channel`), and only then
replays the calls onto the runner's result object, so the runner prints and counts as it always
does. A test whose outcome never reached our recorder has no record and counts as missing.
Names are spelled the way the runner prints them: ``test_x (module.Class)`` (Django, and what
SWE-bench's lists hold), with ``module.Class.test_x``, Python 3.11's ``test_x
(module.Class.test_x)`` and the docstring's first line recorded as aliases.

The integrity guard (`pytest_report.Guard` over ``unittest``'s own modules, our closures and
the recorder class) compares before each record and at the finish; the first difference is a
signed ``tampered`` record. Errors the runner reports outside any test (a ``setUpClass`` or
module fixture failing) are counted in the finish record, so the exit-code cross-check sees
them.
"""

import sys
import unittest

GUARDED_MODULES = (
    "unittest.case",
    "unittest.result",
    "unittest.runner",
    "unittest.suite",
    "unittest.loader",
    "unittest.main",
    "unittest.util",
)
#: An expected failure is not a pass: the test failed, and what marked it expected may be the
#: code under test (``__unittest_expecting_failure__`` set on the method as its class is
#: built); the official Django parser does not count it either.
_RANK = {"error": 0, "failed": 1, "xfailed": 2, "skipped": 3, "passed": 4}


def names(test):
    """Every spelling of one test's name a runner prints, canonical (Django's) first."""
    cls = type(test)
    method = getattr(test, "_testMethodName", "")
    dotted = f"{cls.__module__}.{cls.__qualname__}"
    spelled = [f"{method} ({dotted})", f"{dotted}.{method}", f"{method} ({dotted}.{method})"]
    doc = getattr(getattr(test, method, None), "__doc__", None)
    if doc and doc.strip():
        spelled.append(doc.strip().splitlines()[0].strip())
    return spelled


def install(emit, guard_class, *, integrity, watch=None, xfail="xfailed"):
    """Put our ``TestCase.run`` in place; returns ``finish(exitstatus)`` for the bootstrap.
    ``xfail``: the outcome an expected failure gets (``passed`` only for a control)."""
    original_run = unittest.TestCase.run
    base = unittest.result.TestResult
    original_add_error, original_add_failure = base.addError, base.addFailure
    flagged: list[str] = []
    guard: list = []
    others = {"failed": 0}

    class Recorder(unittest.TestResult):
        __slots__ = ("calls", "outcome")

        def __init__(self):
            super().__init__()
            self.calls = []
            self.outcome = None

        def _worse(self, outcome):
            if self.outcome is None or _RANK[outcome] < _RANK[self.outcome]:
                self.outcome = outcome

        def startTest(self, test):
            self.calls.append(("startTest", (test,)))

        def stopTest(self, test):
            self.calls.append(("stopTest", (test,)))

        def addSuccess(self, test):
            self._worse("passed")
            self.calls.append(("addSuccess", (test,)))

        def addFailure(self, test, err):
            self._worse("failed")
            self.calls.append(("addFailure", (test, err)))

        def addError(self, test, err):
            self._worse("error")
            self.calls.append(("addError", (test, err)))

        def addSkip(self, test, reason):
            self._worse("skipped")
            self.calls.append(("addSkip", (test, reason)))

        def addExpectedFailure(self, test, err):
            self._worse(xfail)
            self.calls.append(("addExpectedFailure", (test, err)))

        def addUnexpectedSuccess(self, test):
            self._worse("failed")
            self.calls.append(("addUnexpectedSuccess", (test,)))

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self._worse("failed" if issubclass(err[0], test.failureException) else "error")
            self.calls.append(("addSubTest", (test, subtest, err)))

        def addDuration(self, test, elapsed):
            self.calls.append(("addDuration", (test, elapsed)))

    def check(where):
        if not guard or flagged:
            return
        bad = guard[0].changed()
        if bad:
            flagged.append(where)
            emit({"event": "tampered", "where": where, "what": bad[:20]})

    def run(self, result=None):
        if result is None:
            return original_run(self, result)
        recorder = Recorder()
        try:
            original_run(self, recorder)
        finally:
            check("report")
            spelled = names(self)
            outcome = recorder.outcome or "error"
            shadowed = sorted(set(vars(recorder)) & set(vars(Recorder)))
            if shadowed:
                # Methods replaced on the recorder object itself: the outcome is not ours.
                outcome = "error"
                emit({"event": "tampered", "where": "report", "what": shadowed})
            if watch is not None and not watch.intersection(spelled):
                others["failed"] += outcome in ("failed", "error")
            else:
                emit(
                    {
                        "event": "test",
                        "nodeid": spelled[0],
                        "aliases": spelled[1:],
                        "when": "call",
                        "outcome": outcome,
                    }
                )
            for name, args in recorder.calls:
                method = getattr(result, name, None)
                if method is not None:
                    method(*args)
        return result

    def add_error(self, test, err):
        # Errors outside any test (class or module fixtures, a runner's own checks).
        if not isinstance(test, unittest.TestCase) and not isinstance(self, Recorder):
            others["failed"] += 1
        return original_add_error(self, test, err)

    def add_failure(self, test, err):
        if not isinstance(test, unittest.TestCase) and not isinstance(self, Recorder):
            others["failed"] += 1
        return original_add_failure(self, test, err)

    def finish(exitstatus):
        check("finish")
        emit({"event": "finish", "exitstatus": int(exitstatus), **others})

    unittest.TestCase.run = run  # type: ignore[method-assign]
    base.addError, base.addFailure = add_error, add_failure  # type: ignore[method-assign]
    if integrity:
        ours = {
            "run": run,
            "add_error": add_error,
            "add_failure": add_failure,
            "check": check,
            "finish": finish,
            "emit": emit,
        }
        for name, value in vars(Recorder).items():
            if callable(value):
                ours[f"Recorder.{name}"] = value
        made = guard_class(
            {f"unittest_report.{k}": v for k, v in ours.items()}, modules=GUARDED_MODULES
        )
        made.snapshot(extra_classes={"unittest_report.Recorder": Recorder})
        guard.append(made)
    emit({"event": "start"})
    return finish


def exit_code(exc):
    """The process exit status a ``SystemExit`` stands for."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
