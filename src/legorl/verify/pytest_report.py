"""The grading side channel (stdlib only, copied into the grading sandbox): a signed record
stream, the pytest plugin that writes test outcomes into it, and the runner's integrity guard.

    python -I -B /tmp/legorl-grade/boot-….py pytest … < key        (bootstrap.py loads this file)

Each record is one line ``LEGORL1 <seq> <json> <mac>``; the MAC is an HMAC-SHA256 of the
one-time key over the sequence number, the previous record's MAC and the body, so no record can
be dropped, reordered or replayed without breaking the chain (`parsers.py` checks it). The
bootstrap writes the stream to a duplicate of the original stdout, taken before pytest's capture
starts, so the sandbox streams each record out as it is written and nothing the run does later
can unwrite it. The key lives only inside an HMAC object held by a closure.

The guard records, before any code under test is imported, the functions that run tests and
make reports (`_pytest` runner, reports, python, main, …; pluggy's hook calling; this plugin's
own hooks) with their ``__code__``; at configure, before each report and at finish it compares,
and the first difference becomes a signed ``tampered`` record.

Legacy launch (the ``isolated_runner`` defence off): ``python -m pytest -p legorl_pytest_report``
with ``LEGORL_REPORT`` naming the sink (``fd`` or a file path) and the key on stdin.
"""

from __future__ import annotations

import hmac
import importlib
import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

MARK = "LEGORL1"
GENESIS = "0" * 64
GUARDED_MODULES = (
    "_pytest.runner",
    "_pytest.reports",
    "_pytest.python",
    "_pytest.main",
    "_pytest.nodes",
    "_pytest.unittest",
    "_pytest.skipping",
    "_pytest.outcomes",
    "_pytest.fixtures",
    "pluggy._hooks",
    "pluggy._manager",
    "pluggy._callers",
    "pluggy._result",
)
GUARDED_HOOKS = (
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_pyfunc_call",
    "pytest_collectreport",
    "pytest_make_collect_report",
    "pytest_sessionfinish",
    "pytest_report_teststatus",
)

Emit = Callable[[dict], None]


def channel(key: bytes, fd: int) -> Emit:
    """A writer of chained, signed records to ``fd``; the key is not kept, only a keyed HMAC."""
    keyed = hmac.new(key, digestmod="sha256")
    state: list = [0, GENESIS]
    # taken now, before any code under test runs: a record's body is what the record was
    # (round 18: a replaced ``json.dumps`` rewrote the guard's ``tampered`` record)
    encode, write = _encoder(), os.write

    def emit(record: dict) -> None:
        body = encode(record)
        mac = keyed.copy()
        mac.update(f"{state[0]} {state[1]} {body}".encode())
        digest = mac.hexdigest()
        # The leading newline keeps a record whole after stray output without one.
        data = f"\n{MARK} {state[0]} {body} {digest}\n".encode()
        state[0] += 1
        state[1] = digest
        while data:
            data = data[write(fd, data) :]

    return emit


def _encoder() -> Callable[[Any], str]:
    """Compact JSON with sorted keys (what ``json.dumps(sort_keys=True, separators=(",",
    ":"))`` writes) for a record's plain values, made only of references taken when it is
    made: nothing the code under test replaces later (``json.dumps``, ``sorted``, ``type``)
    changes what a record says."""
    quote = json.encoder.encode_basestring_ascii
    kind, keys, join, subclass = type, sorted, str.join, issubclass
    as_int, as_float = int.__repr__, float.__repr__
    numbers = {float("inf"): "Infinity", float("-inf"): "-Infinity"}

    def encode(value: Any) -> str:
        if value is None:
            return "null"
        if value is True or value is False:
            return "true" if value else "false"
        t = kind(value)
        if subclass(t, str):
            return quote(value)
        if subclass(t, int):
            return as_int(value)
        if subclass(t, float):
            if value != value:
                return "NaN"
            return numbers.get(value) or as_float(value)
        if subclass(t, (list, tuple)):
            return "[" + join(",", [encode(v) for v in value]) + "]"
        if subclass(t, dict):
            pairs = [quote(k) + ":" + encode(value[k]) for k in keys(value)]
            return "{" + join(",", pairs) + "}"
        raise TypeError(f"a record holds a {t.__name__}")

    return encode


def _functions(owner: Any) -> list[tuple[str, Any]]:
    found = []
    for name, value in vars(owner).items():
        for part in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
            if isinstance(part, types.FunctionType):
                found.append((name, part))
    return found


#: More of our own code for every Guard made after it is set: (label, namespace) pairs whose
#: functions and classes are guarded (the operand sender, `operands.guarded`), and (label,
#: getter) pairs whose value must stay the object it was.
SPACES: list[tuple[str, Any]] = []
PINS: list[tuple[str, Any]] = []


class Guard:
    """What the runner's report-making code was before the code under test could touch it."""

    def __init__(
        self, extra: dict[str, Any], *, modules: tuple[str, ...] = GUARDED_MODULES
    ) -> None:
        self.entries: list[tuple[str, Any, str, Any, Any]] = []  # label, owner, name, obj, code
        self.class_keys: list[tuple[str, Any, frozenset]] = []  # label, class, _behaviour()
        self.pins = [(label, get, get()) for label, get in PINS]
        for label, space in SPACES:
            items = space if type(space) is dict else vars(space)
            for name, value in list(items.items()):
                if isinstance(value, types.FunctionType):
                    self._add(f"{label}.{name}", space, name, value)
                elif isinstance(value, type):
                    # the class the name holds stays the one it held (``json.JSONEncoder``)
                    self.pins.append((f"{label}.{name}", lambda i=items, n=name: i.get(n), value))
                    if any(fn.__globals__ is items for _, fn in _functions(value)):
                        self.class_keys.append((f"{label}.{name}", value, _behaviour(value)))
                        for attr, fn in _functions(value):
                            self._add(f"{label}.{name}.{attr}", value, attr, fn)
        for modname in modules:
            try:
                module = importlib.import_module(modname)
            except ImportError:
                continue
            for name, value in list(vars(module).items()):
                if isinstance(value, types.FunctionType) and value.__module__ == modname:
                    self._add(f"{modname}.{name}", module, name, value)
                elif isinstance(value, type) and value.__module__ == modname:
                    self.class_keys.append((f"{modname}.{name}", value, frozenset()))
                    for attr, fn in _functions(value):
                        self._add(f"{modname}.{name}.{attr}", value, attr, fn)
        for label, fn in extra.items():
            self._add(label, None, "", fn)
        self.hooks: dict[str, tuple[Any, frozenset]] = {}  # hook -> (caller, its impls)
        self.manager: Any = None
        self.inner: Any = None

    def _add(self, label: str, owner: Any, name: str, fn: Any) -> None:
        self.entries.append((label, owner, name, fn, fn.__code__))

    def watch(self, manager: Any) -> None:
        """Hook callers, their implementations and the classes' attribute names as configured
        (plugins and initial conftests in, pytest's own lazy attributes set), just before
        collection imports the first test module."""
        self.snapshot()
        self.manager = manager
        self.inner = manager._inner_hookexec
        for hook in GUARDED_HOOKS:
            caller = getattr(manager.hook, hook, None)
            if caller is not None:
                impls = frozenset((id(i.plugin), i.function) for i in caller.get_hookimpls())
                self.hooks[hook] = (caller, impls)

    def snapshot(self, extra_classes: dict[str, type] | None = None) -> None:
        """The guarded classes' attribute names as they are now (and ``extra_classes``)."""
        self.class_keys = [(label, cls, _behaviour(cls)) for label, cls, _ in self.class_keys]
        for label, cls in (extra_classes or {}).items():
            self.class_keys.append((label, cls, _behaviour(cls)))

    def changed(self) -> list[str]:
        bad = [label for label, get, was in self.pins if get() is not was]
        for label, owner, name, fn, code in self.entries:
            if owner is None:
                current = fn
            else:
                current = (owner if type(owner) is dict else vars(owner)).get(name)
            current = getattr(current, "__func__", getattr(current, "fget", current))
            if current is not fn or fn.__code__ is not code:
                bad.append(label)
        for label, cls, keys in self.class_keys:
            if keys and _behaviour(cls) != keys:
                bad.append(f"{label}.__dict__")
        if self.manager is not None:
            if self.manager._inner_hookexec is not self.inner:
                bad.append("pluggy.PluginManager._inner_hookexec")
            for hook, (caller, impls) in self.hooks.items():
                if getattr(self.manager.hook, hook, caller) is not caller:
                    bad.append(f"hook.{hook}")
                    continue
                for impl in caller.get_hookimpls():
                    if (id(impl.plugin), impl.function) not in impls and not _conftest(impl.plugin):
                        bad.append(f"hook.{hook}:{getattr(impl, 'plugin_name', '?')}")
        return bad


def _behaviour(cls: type) -> frozenset:
    """A class's callables and descriptors by name and identity (pytest itself sets plain data
    flags on its classes as it runs; those do not change what a method does)."""
    return frozenset(
        (name, id(value))
        for name, value in vars(cls).items()
        if callable(value) or hasattr(value, "__get__")
    )


def _conftest(plugin: Any) -> bool:
    # Conftests found during collection are the repository's own (the patch cannot touch them).
    path = getattr(plugin, "__file__", None) or ""
    return (
        isinstance(plugin, types.ModuleType)
        and os.path.basename(path) == "conftest.py"
        and sys.modules.get(plugin.__name__) is plugin
    )


def make_plugin(
    emit: Emit, name: str, *, integrity: bool, watch: frozenset[str] | None = None
) -> types.ModuleType:
    """The report plugin as a module object under ``name`` (pass it to ``pytest.main``).

    With ``watch``, only those tests get records of their own (the exec output is capped); the
    others' failures are counted in the finish record."""
    from _pytest.reports import CollectReport, TestReport

    plugin = types.ModuleType(name)
    flagged: list[str] = []
    guard: list[Guard] = []
    others = {"failed": 0, "collect_errors": 0}

    def check(where: str) -> None:
        if not guard or flagged:
            return
        bad = guard[0].changed()
        if bad:
            flagged.append(where)
            emit({"event": "tampered", "where": where, "what": bad[:20]})

    def pytest_configure(config: Any) -> None:
        check("configure")
        emit({"event": "start"})

    def pytest_collection(session: Any) -> None:
        if guard:
            guard[0].watch(session.config.pluginmanager)
        check("collection")

    def pytest_collectreport(report: Any) -> None:
        check("collect")
        if type(report) is not CollectReport:
            emit({"event": "tampered", "where": "collect", "what": ["report type"]})
        if report.failed:
            if others["collect_errors"] < 20:
                emit({"event": "collect_error", "nodeid": str(report.nodeid)})
            others["collect_errors"] += 1

    def pytest_runtest_logreport(report: Any) -> None:
        check("report")
        if type(report) is not TestReport:
            flagged.append("report")
            emit({"event": "tampered", "where": "report", "what": ["report type"]})
        if watch is not None and report.nodeid not in watch:
            others["failed"] += report.outcome == "failed"
        elif report.when == "call" or report.outcome != "passed":
            # Setup/teardown only matter when they did not pass (an error, or a skip).
            record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
            emit({"event": "test", **{k: str(v) for k, v in record.items()}})

    def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
        check("finish")
        emit({"event": "finish", "exitstatus": int(exitstatus), **others})

    hooks = (
        pytest_configure,
        pytest_collection,
        pytest_collectreport,
        pytest_runtest_logreport,
        pytest_sessionfinish,
    )
    for hook in hooks:
        setattr(plugin, hook.__name__, hook)
    if integrity:
        extra = {f"plugin.{h.__name__}": h for h in hooks}
        guard.append(Guard({**extra, "plugin.check": check, "channel.emit": emit}))
    return plugin


def read_key() -> bytes:
    """The one-time key: the first line on stdin."""
    key = b""
    while not key.endswith(b"\n"):
        try:
            chunk = os.read(0, 1)
        except OSError:
            break
        if not chunk:
            break
        key += chunk
    return key.strip()


def _legacy() -> None:
    # Loaded by name with `-p`: read the key now, before pytest's capture points fd 0 at
    # /dev/null and before any test module is imported.
    sink = os.environ.pop("LEGORL_REPORT", "")
    key = read_key()
    if not sink or not key:
        return  # no key, no report: every test then counts as missing
    # A duplicate of stdout is not inherited by children, and pytest's capture moves fd 1,
    # never this one.
    fd = os.dup(1) if sink == "fd" else os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    integrity = os.environ.pop("LEGORL_INTEGRITY", "1") == "1"
    plugin = make_plugin(channel(key, fd), __name__ + "_hooks", integrity=integrity)
    for name, value in vars(plugin).items():
        if name.startswith("pytest_"):
            globals()[name] = value


if __name__ in ("legorl_pytest_report", "pytest_report") and "LEGORL_REPORT" in os.environ:
    _legacy()
