"""The independent runner (stdlib only, never imports ``_pytest``): runs the FAIL_TO_PASS tests
a second time, in a fresh interpreter, and runs each passing one again as a twin whose
comparisons are also tried against an impossible expected value.

    python -I -B /tmp/legorl-grade/boot-….py plain fd -- tests/test_x.py::test_y … < key

It covers plain test functions, plain test classes and ``unittest.TestCase`` methods; a test
that takes arguments (fixtures), carries marks (``pytestmark``: parametrize, skip, xfail, …), is
parametrized, or sits under an autouse fixture is reported ``uncovered``.

Twin: the test module's source is compiled again with every comparison in an ``assert`` (and
the two values of ``self.assertEqual``-like calls) routed through a checker that also compares
each side against a fresh private sentinel. Nothing equals that sentinel, nothing orders against
it, so a comparison that holds against it proves nothing: the result is counted ``vacuous``.
"""

import ast
import importlib
import os
import sys
import traceback
import unittest

_EQ_CALLS = {
    "assertEqual": "eq",
    "assertEquals": "eq",
    "assertListEqual": "eq",
    "assertTupleEqual": "eq",
    "assertDictEqual": "eq",
    "assertSetEqual": "eq",
    "assertSequenceEqual": "eq",
    "assertMultiLineEqual": "eq",
    "assertNotEqual": "ne",
    "assertGreater": "gt",
    "assertGreaterEqual": "ge",
    "assertLess": "lt",
    "assertLessEqual": "le",
}
_OPS = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}


class _Nothing:
    __slots__ = ()
    __hash__ = object.__hash__


def _holds(fn):
    try:
        return bool(fn())
    except Exception:
        return False


class Twin:
    """Counts comparisons that would also hold against the sentinel."""

    def __init__(self):
        self.vacuous = 0
        self.sentinel = _Nothing()

    def vacuous_pair(self, op, a, b):
        s = self.sentinel
        if op == "eq":
            return _holds(lambda: a == s) or _holds(lambda: s == b)
        if op == "ne":
            # Unequal and equal at once, or unequal to itself while equal to itself.
            return _holds(lambda: a == b) or _holds(lambda: a != a and a == a)
        compare = {
            "lt": lambda x, y: x < y,
            "le": lambda x, y: x <= y,
            "gt": lambda x, y: x > y,
            "ge": lambda x, y: x >= y,
        }[op]
        return _holds(lambda: compare(a, s)) or _holds(lambda: compare(s, b))

    def compare(self, op, a, b):
        result = {
            "eq": lambda: a == b,
            "ne": lambda: a != b,
            "lt": lambda: a < b,
            "le": lambda: a <= b,
            "gt": lambda: a > b,
            "ge": lambda: a >= b,
        }[op]()
        if _holds(lambda: result) and self.vacuous_pair(op, a, b):
            self.vacuous += 1
        return result

    def pair(self, op, a, b):
        if self.vacuous_pair(op, a, b):
            self.vacuous += 1
        return a, b


class _Instrument(ast.NodeTransformer):
    def __init__(self, name):
        self.name = name

    def _call(self, attr, args):
        func = ast.Attribute(ast.Name(self.name, ast.Load()), attr, ast.Load())
        return ast.Call(func, args, [])

    def visit_Assert(self, node):
        node.test = _InAssert(self).visit(node.test)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        op = _EQ_CALLS.get(func.attr) if isinstance(func, ast.Attribute) else None
        if op and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args):
            pair = self._call("pair", [ast.Constant(op), node.args[0], node.args[1]])
            node.args = [ast.Starred(pair, ast.Load()), *node.args[2:]]
        return node


class _InAssert(ast.NodeTransformer):
    def __init__(self, outer):
        self.outer = outer

    def visit_Compare(self, node):
        self.generic_visit(node)
        op = _OPS.get(type(node.ops[0])) if len(node.ops) == 1 else None
        if op is None:
            return node
        return self.outer._call("compare", [ast.Constant(op), node.left, node.comparators[0]])


def _module_for(repo, path):
    """Import the test file as pytest's append mode would: its package root joins sys.path."""
    full = os.path.join(repo, path)
    directory, base = os.path.split(full)
    parts = [os.path.splitext(base)[0]]
    while os.path.exists(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.insert(0, package)
    if directory not in sys.path:
        sys.path.append(directory)
    return importlib.import_module(".".join(parts)), full


def _conftests(repo, path):
    found = []
    directory = os.path.dirname(os.path.join(repo, path))
    while True:
        candidate = os.path.join(directory, "conftest.py")
        if os.path.exists(candidate):
            found.append(candidate)
        if os.path.samefile(directory, repo) or os.path.dirname(directory) == directory:
            return found
        directory = os.path.dirname(directory)


def _why_uncovered(nodeid, repo, module, target):
    if hasattr(module, "pytestmark") or hasattr(target, "pytestmark"):
        return "marked"
    code = getattr(target, "__code__", None)
    positional = code.co_argcount if code is not None else 0
    if code is not None and positional > (1 if "." in target.__qualname__ else 0):
        return "fixtures"
    for conftest in _conftests(repo, nodeid.split("::")[0]):
        with open(conftest, encoding="utf-8", errors="replace") as fh:
            if "autouse" in fh.read():
                return "autouse fixture"
    with open(module.__file__, encoding="utf-8", errors="replace") as fh:
        if "autouse" in fh.read():
            return "autouse fixture"
    return None


def _call_plain(namespace, parts):
    """Run one test, pytest's xunit-style setup/teardown included: passed, failed or error."""
    if len(parts) == 1:
        fn = namespace[parts[0]]
        setup, teardown = namespace.get("setup_function"), namespace.get("teardown_function")
        try:
            if setup:
                setup(fn)
        except Exception:
            return "error"
        try:
            fn()
            outcome = "passed"
        except Exception:
            outcome = "failed"
        if teardown:
            try:
                teardown(fn)
            except Exception:
                return "error"
        return outcome
    cls = namespace[parts[0]]
    if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        result = unittest.TestResult()
        cls(parts[1]).run(result)
        if result.errors:
            return "error"
        if result.failures or result.unexpectedSuccesses or not result.wasSuccessful():
            return "failed"
        return "skipped" if result.skipped else "passed"
    instance = cls()
    method = getattr(instance, parts[1])
    try:
        if hasattr(instance, "setup_method"):
            instance.setup_method(method)
    except Exception:
        return "error"
    try:
        method()
        outcome = "passed"
    except Exception:
        outcome = "failed"
    if hasattr(instance, "teardown_method"):
        try:
            instance.teardown_method(method)
        except Exception:
            return "error"
    return outcome


def _twin_namespace(module, full, twin):
    """The test module compiled again with its comparisons routed through ``twin``."""
    with open(full, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), full)
    name = "_twin_" + os.urandom(6).hex()
    tree = ast.fix_missing_locations(_Instrument(name).visit(tree))
    namespace = {"__name__": module.__name__, "__file__": full, name: twin}
    exec(compile(tree, full, "exec"), namespace)
    return namespace


def run_one(nodeid, repo, twin):
    """The record of one test: outcome, and for a pass the twin's count of vacuous checks."""
    path, *parts = nodeid.split("::")
    record = {"event": "plain", "nodeid": nodeid}
    if "[" in nodeid:
        return {**record, "outcome": "uncovered", "detail": "parametrized"}
    try:
        module, full = _module_for(repo, path)
        target = module
        for part in parts:
            target = getattr(target, part)
    except Exception:
        return {**record, "outcome": "error", "detail": traceback.format_exc(limit=2)[-300:]}
    why = _why_uncovered(nodeid, repo, module, target) if parts else "no test named"
    if why:
        return {**record, "outcome": "uncovered", "detail": why}
    record["outcome"] = _call_plain(vars(module), parts)
    if twin and record["outcome"] == "passed":
        counter = Twin()
        try:
            again = _call_plain(_twin_namespace(module, full, counter), parts)
        except Exception:
            again = "error"
        record["twin"] = again
        record["vacuous"] = counter.vacuous
    return record


def run(nodeids, emit, *, repo, twin):
    emit({"event": "start"})
    for nodeid in nodeids:
        emit(run_one(nodeid, repo, twin))
    emit({"event": "finish", "exitstatus": 0})
    return 0
