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
The sentinel judges values the code under test could have made, not the test's own
instruments: a side that the test builds right there, as a call of a class its own module
defines (toolz's ``composed == AlwaysEquals()`` checks that ``Compose.__eq__`` defers), is
skipped when every comparison method of the value's type is ``object``'s or a function compiled
by the twin from the test file itself (the very code object, not an equal one). A value the
code under test returns, or a class it swapped in under the test's name, is still judged.

Audit: before any repository code is imported, `audit` installs a ``sys.addaudithook`` hook
(which Python cannot remove) refusing what reaches the signer, which lives only in the
bootstrap's frame: object walks (``gc.get_objects``/``get_referrers``/``get_referents``), frames
(``sys._getframe``, ``sys._current_frames``, ``tb_frame``/``gi_frame``/``cr_frame``/``ag_frame``,
trace and profile functions), native memory (``_ctypes`` cannot be imported: its pointer types
read and write any address with no audit event; an ImportError, which numpy and Django's modules
that use ctypes only optionally take as its absence), this process's memory (``/proc``), child
processes (which could read it; starting one is a PermissionError), and further audit hooks
(which would see the frames of the calls let through). Frames go only to stdlib functions that
keep them (``namedtuple``, ``typing`` and ``enum`` take the caller's module name, ``logging``
its file and line, ``clear_frames`` clears them). A test during which anything was refused is
``refused``, never ``passed``. An expected failure is ``xfailed``, never ``passed``.

Known gap: numpy makes an array over any address (an object whose ``__array_interface__`` names
a data pointer), a memory write with no audit event that no hook can take from numpy's users;
with it, code under test can empty the audit hooks as the ctypes row does (the hooks' list
lies at a fixed offset from ``id(None)`` in a given interpreter build). For a repository whose
tests import numpy, the signer is within that code's reach.
"""

import _thread
import ast
import collections
import enum
import importlib
import logging
import os
import sys
import traceback
import types
import typing
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


_COMPARISONS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")


def _code_objects(code):
    """``code`` and every code object nested in it, by identity."""
    found, stack = {}, [code]
    while stack:
        item = stack.pop()
        found[id(item)] = item
        stack.extend(c for c in item.co_consts if isinstance(c, types.CodeType))
    return found


class Twin:
    """Counts comparisons that would also hold against the sentinel."""

    def __init__(self):
        self.vacuous = 0
        self.sentinel = _Nothing()
        self.codes = {}  # the twin module's code objects, by id: the test file's own code

    def own(self, value):
        """Whether every comparison method of ``value``'s type, found as Python finds it (the
        type's MRO, no attribute hooks), is ``object``'s or the test file's own code."""
        mro = type.__dict__["__mro__"].__get__(type(value))
        spaces = [type.__dict__["__dict__"].__get__(k) for k in mro]
        for name in _COMPARISONS:
            found = next((space[name] for space in spaces if name in space), None)
            if found is None or found is getattr(object, name):
                continue
            if not isinstance(found, types.FunctionType):
                return False
            code = found.__code__
            if self.codes.get(id(code)) is not code:
                return False
        return True

    def vacuous_pair(self, op, a, b, built_a=False, built_b=False):
        s = self.sentinel
        judge_a = not (built_a and self.own(a))
        judge_b = not (built_b and self.own(b))
        if op == "eq":
            return (judge_a and _holds(lambda: a == s)) or (judge_b and _holds(lambda: s == b))
        if op == "ne":
            # Unequal and equal at once, or unequal to itself while equal to itself.
            return _holds(lambda: a == b) or (judge_a and _holds(lambda: a != a and a == a))
        compare = {
            "lt": lambda x, y: x < y,
            "le": lambda x, y: x <= y,
            "gt": lambda x, y: x > y,
            "ge": lambda x, y: x >= y,
        }[op]
        return (judge_a and _holds(lambda: compare(a, s))) or (
            judge_b and _holds(lambda: compare(s, b))
        )

    def compare(self, op, a, b, built_a=False, built_b=False):
        result = {
            "eq": lambda: a == b,
            "ne": lambda: a != b,
            "lt": lambda: a < b,
            "le": lambda: a <= b,
            "gt": lambda: a > b,
            "ge": lambda: a >= b,
        }[op]()
        if _holds(lambda: result) and self.vacuous_pair(op, a, b, built_a, built_b):
            self.vacuous += 1
        return result

    def pair(self, op, a, b, built_a=False, built_b=False):
        if self.vacuous_pair(op, a, b, built_a, built_b):
            self.vacuous += 1
        return a, b


class _Instrument(ast.NodeTransformer):
    def __init__(self, name, classes=frozenset()):
        self.name = name
        self.classes = classes  # the classes the test module defines at its top level

    def _call(self, attr, args):
        func = ast.Attribute(ast.Name(self.name, ast.Load()), attr, ast.Load())
        return ast.Call(func, args, [])

    def built(self, node):
        """Whether ``node`` is the test building a value of its own class, right there."""
        own = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        return ast.Constant(own and node.func.id in self.classes)

    def compare_call(self, attr, op, left, right):
        args = [ast.Constant(op), left, right, self.built(left), self.built(right)]
        return self._call(attr, args)

    def visit_Assert(self, node):
        node.test = _InAssert(self).visit(node.test)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        op = _EQ_CALLS.get(func.attr) if isinstance(func, ast.Attribute) else None
        if op and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args):
            pair = self.compare_call("pair", op, node.args[0], node.args[1])
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
        return self.outer.compare_call("compare", op, node.left, node.comparators[0])


class Refused(RuntimeError):
    """Raised by the audit hook (a RuntimeError, so a refused ``sys.addaudithook`` is dropped)."""


_EVENTS = frozenset(
    {
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys.addaudithook",
        "sys._current_frames",
        "sys._current_exceptions",
        "sys.settrace",
        "sys.setprofile",
    }
)
#: Child processes (which could read this process's memory) do not exist in the independent
#: runner: starting one is a PermissionError, as under a sandbox without fork and exec, which
#: code that runs a tool when it can copes with (``platform.architecture`` runs ``file``).
_CHILDREN = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "pty.spawn",
    }
)
_PYTEST_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
#: The extension module behind ctypes: its pointer types read and write any address with no
#: audit event (``c_char_p(addr).value``, a Union of ``c_void_p`` and a pointer, ``py_object``
#: from an address), which would reach the signer and the hook itself. The independent runner
#: has none: importing it is an ImportError, as on a Python built without it (numpy and
#: Django's modules that need it only optionally carry on without).
NATIVE_MEMORY = frozenset({"_ctypes"})
_CTYPES_LOADING = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"})
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


def _frame_keepers():
    """Functions that take a frame and hand back only names, or clear it: code object ->
    the globals it must run with (the same code under other globals could pass the frame on)."""

    def of(*functions):
        return {f.__code__: f.__globals__ for f in functions}

    return (
        of(
            collections.namedtuple,
            typing._caller,  # type: ignore[attr-defined]
            vars(enum.EnumType)["_create_"],
        ),
        of(traceback.clear_frames),
        (of(logging.currentframe), of(logging.Logger.findCaller)),
    )


def audit(*, pytest=False, ctypes=None):
    """Install the hook; the list it appends refused event names to. ``pytest``: only what
    pytest and the runners it stands for need not (object walks, ctypes' audited memory access
    and foreign calls, loading a library let through, /proc, further hooks): that run's
    signer stays reachable through frames, so only the independent runner's verdict is trusted.
    ``ctypes``: whether ``_ctypes`` may be imported at all (by default only in ``pytest`` mode;
    the independent runner has none)."""
    native = frozenset() if (pytest if ctypes is None else ctypes) else NATIVE_MEMORY
    refused = []
    getters, attr_readers, (currentframe, find_caller) = _frame_keepers()
    inside = set()  # threads now in the hook (its own frame look-ups are let through)
    getframe, realpath, ident = sys._getframe, os.path.realpath, _thread.get_ident

    def caller_is(keepers, depth):
        frame = getframe(depth)
        return frame is not None and keepers.get(frame.f_code) is frame.f_globals

    def allowed(event, args):
        if event.startswith("ctypes."):
            # Loading a library or finding a symbol reads no memory, and real code needs it:
            # `import ctypes` loads the interpreter itself (PyDLL(None)), and numpy and Django's
            # test runner import ctypes. Every audited memory access and foreign call is refused.
            return event in _CTYPES_LOADING
        if event == "open":
            path = args[0]
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            return not (isinstance(path, str) and realpath(path).startswith("/proc/"))
        if event in (_PYTEST_EVENTS if pytest else _EVENTS) or event == "sys.addaudithook":
            return False
        if pytest:
            return True
        # Depth 3: the frame that called sys._getframe or read the attribute.
        if event == "sys._getframe":
            if caller_is(getters, 3):
                return True
            return caller_is(currentframe, 3) and caller_is(find_caller, 4)
        if event == "object.__getattr__" and args[1] in _FRAME_ATTRS:
            return caller_is(attr_readers, 3)
        return True

    def hook(event, args):
        me = ident()
        if me in inside:
            return
        # Absent, not refused: an optional import's ImportError, a tool's OSError, is the
        # honest outcome, and no pass depends on the code under test lacking them.
        if event == "import" and args[0] in native:
            raise ImportError(f"legorl grading: no {args[0]} in the independent runner")
        if event in _CHILDREN and not pytest:
            raise PermissionError(f"legorl grading: no child processes ({event})")
        inside.add(me)
        try:
            ok = allowed(event, args)
        finally:
            inside.discard(me)
        if not ok:
            refused.append(event if event != "object.__getattr__" else args[1])
            raise Refused(f"legorl grading refuses {event}")

    sys.addaudithook(hook)
    return refused


class _Result(unittest.TestResult):
    """Records failures without formatting them (formatting walks the traceback's frames)."""

    def _exc_info_to_string(self, err, test):
        return f"{err[0].__name__}: {err[1]}"[:300]


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


def _with_arg(fn, arg):
    """An xunit hook, called with its one optional argument as pytest does."""
    if fn is None:
        return lambda: None
    code = getattr(fn, "__code__", None)
    takes = code is not None and code.co_argcount > (1 if hasattr(fn, "__self__") else 0)
    return (lambda: fn(arg)) if takes else fn


def _xunit(setups, test, teardowns):
    """passed, failed, or error (a setup or teardown raised); teardowns run in reverse."""
    outcome = "passed"
    ran = []
    try:
        for setup, teardown in zip(setups, teardowns, strict=True):
            setup()
            ran.append(teardown)
        test()
    except BaseException:  # pytest's own outcomes (fail, skip) are BaseExceptions
        outcome = "failed" if len(ran) == len(setups) else "error"
    for teardown in reversed(ran):
        try:
            teardown()
        except BaseException:
            outcome = "error"
    return outcome


XFAIL = ["xfailed"]  # an expected failure's outcome (``passed`` only for a control)


def _call_plain(module, parts):
    """Run one test with pytest's xunit-style setup and teardown (module, class, method)."""
    namespace = vars(module)
    setups = [_with_arg(namespace.get("setup_module"), module)]
    teardowns = [_with_arg(namespace.get("teardown_module"), module)]
    if len(parts) == 1:
        fn = namespace[parts[0]]
        setups.append(_with_arg(namespace.get("setup_function"), fn))
        teardowns.append(_with_arg(namespace.get("teardown_function"), fn))
        return _xunit(setups, fn, teardowns)
    cls = namespace[parts[0]]
    if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        # A suite runs the class and module fixtures (setUpClass, setUpModule) as well.
        result = _Result()
        unittest.TestSuite([cls(parts[1])]).run(result)
        if result.errors:
            return "error"
        if result.failures or result.unexpectedSuccesses or not result.wasSuccessful():
            return "failed"
        if result.expectedFailures:
            return XFAIL[0]  # it failed; whatever marked the failure expected
        return "skipped" if result.skipped else "passed"
    setups.append(_with_arg(getattr(cls, "setup_class", None), cls))
    teardowns.append(_with_arg(getattr(cls, "teardown_class", None), cls))

    def test():
        instance = cls()
        _xunit_method(instance, getattr(instance, parts[1]))

    return _xunit(setups, test, teardowns)


def _xunit_method(instance, method):
    setup = _with_arg(getattr(instance, "setup_method", None), method)
    teardown = _with_arg(getattr(instance, "teardown_method", None), method)
    setup()
    try:
        method()
    finally:
        teardown()


def _twin_module(module, full, twin):
    """The test module compiled again with its comparisons routed through ``twin``."""
    with open(full, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), full)
    name = "_twin_" + os.urandom(6).hex()
    classes = frozenset(n.name for n in tree.body if isinstance(n, ast.ClassDef))
    tree = ast.fix_missing_locations(_Instrument(name, classes).visit(tree))
    code = compile(tree, full, "exec")
    twin.codes = _code_objects(code)
    again = types.ModuleType(module.__name__)
    vars(again).update(__file__=full, **{name: twin})
    exec(code, vars(again))
    return again


def run_one(nodeid, repo, twin, refused=()):
    """The record of one test: outcome, and for a pass the twin's count of vacuous checks."""
    before = len(refused)
    record = _run_one(nodeid, repo, twin)
    if len(refused) > before:
        needed = ", ".join(sorted(set(refused[before:])))
        return {**record, "outcome": "refused", "detail": f"the test needed {needed}"}
    return record


def _run_one(nodeid, repo, twin):
    path, *parts = nodeid.split("::")
    record = {"event": "plain", "nodeid": nodeid}
    if "[" in nodeid:
        return {**record, "outcome": "uncovered", "detail": "parametrized"}
    try:
        module, full = _module_for(repo, path)
        target = module
        for part in parts:
            target = getattr(target, part)
    except Exception as exc:
        return {**record, "outcome": "error", "detail": f"{type(exc).__name__}: {exc}"[:300]}
    why = _why_uncovered(nodeid, repo, module, target) if parts else "no test named"
    if why:
        return {**record, "outcome": "uncovered", "detail": why}
    record["outcome"] = _call_plain(module, parts)
    if twin and record["outcome"] == "passed":
        counter = Twin()
        try:
            again = _call_plain(_twin_module(module, full, counter), parts)
        except Exception:
            again = "error"
        record["twin"] = again
        record["vacuous"] = counter.vacuous
    return record


#: What Django's tests/runtests.py installs for every run (its ALWAYS_INSTALLED_APPS).
DJANGO_APPS = (
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sites",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.staticfiles",
)


def django_setup(repo, spec, nodeids):
    """Django's settings for its own test suite, as ``tests/runtests.py`` makes them (``spec``
    is ``FOLDER:SETTINGS``, e.g. ``tests:test_sqlite``): the folder on sys.path, the settings
    module, the always-installed apps and the apps of the tests to run, then
    ``django.setup()``. The runner script itself is not run (it imports ctypes, and what it
    runs is the run under test)."""
    folder, settings_module = spec.split(":", 1)
    sys.path.append(os.path.join(repo, folder))
    os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    import django
    from django.conf import settings

    labels = [n.split("::")[0].removeprefix(folder + "/").split("/")[0] for n in nodeids]
    apps = [*DJANGO_APPS, *(a for a in dict.fromkeys(labels) if a not in DJANGO_APPS)]
    settings.INSTALLED_APPS = apps
    django.setup()


def run(nodeids, emit, *, repo, twin, refused=(), setup=None):
    """Each test's record; ``setup`` (Django's settings) first: if it raises, every test
    gets that error (or ``refused``, when the audit hook refused something on the way)."""
    emit({"event": "start"})
    if setup is not None:
        before = len(refused)
        try:
            setup()
        except Exception as exc:
            outcome = "refused" if len(refused) > before else "error"
            detail = f"setup: {type(exc).__name__}: {exc}"[:300]
            for nodeid in nodeids:
                emit({"event": "plain", "nodeid": nodeid, "outcome": outcome, "detail": detail})
            nodeids = []
    for nodeid in nodeids:
        emit(run_one(nodeid, repo, twin, refused))
    emit({"event": "finish", "exitstatus": 0})
    return 0
