"""The judged process's half of out-of-process assertion judging (stdlib only; it reaches the
grading sandbox through the bootstrap's stdin, never as a file the judged code could change).

    __legorl__.check(SITE, value, __legorl__.HELD)      # what `assert f(3) == 15` becomes
    with __legorl__.raises(SITE, pytest.raises(E)): …   # what `with pytest.raises(E):` becomes
    with __legorl__.warns(SITE, self.assertWarns(W)): … # and `with self.assertWarns(W):`
    with __legorl__.test(self_or_None): …               # around each required test's body

The test files are rewritten by the judge (`rewrite.py`) before the run: an assertion no
longer compares anything here. Each of its operands leaves the process as exact-type plain
data, marshalled, and the judge applies the comparison in its own process against expected
values it holds (literals stripped from the source: ``HELD`` marks their places). Nothing here
raises on a wrong value: this process cannot know it is wrong.

A value of a built-in type's subclass is rebuilt as the exact base type from its underlying
data by the base type's own methods (``str.__str__``, ``int.__pos__``, ``list`` slicing, …),
never by a method the subclass could override; anything that is not plain data after that is
sent as ``None`` with its type's name, and the judge fails the comparison. Sites the judge
could not make plain for the gold patch run here as ordinary assertions (``inproc``) and are
counted as judged in process.

In the empty patch's run of a task's gold record (``onward``), a required test's own assertion
whose operands raise is sent as failed and the test goes on: the judge learns what the unfixed
code answers at the assertions after it too (`rewrite.py` wraps only those whose exception no
enclosing ``with`` or ``try`` of the test could catch).
"""

import _signal
import binascii
import builtins
import collections
import contextlib
import datetime
import gc
import marshal
import os
import signal
import sys
import threading
import warnings

HELD = object()  # a stripped operand's place: the judge holds its value
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_DEPTH = 40
# datetime's classes as they were before any code under test ran (round 52: the module was
# read at send time, and a class put there whose metaclass's ``__subclasscheck__`` ran the
# patch's code inside the sender, which swapped the value's fields for the expected ones)
_TIMEDELTA, _DATETIME, _DATE, _TIME, _TIMEZONE = (
    datetime.timedelta, datetime.datetime, datetime.date, datetime.time, datetime.timezone
)  # fmt: skip
_MOMENTS = (_TIMEDELTA, _DATETIME, _DATE, _TIME)  # sent as tagged fields, not as a class's
_ODICT = collections.OrderedDict
_ODICT_ITER = collections.OrderedDict.__iter__  # its own order, not a subclass's __iter__
_emit: list = [None]  # the channel's writer, set by the bootstrap
_onward = [False]  # the empty patch's run of a gold record: a failed assertion does not stop
_own_call = [True]  # a truth check's callable called here first (off: a control only)
_quiet_sender = [True]  # no hook of the judged process runs in the sender (off: a control only)


class NotPlain(Exception):
    pass


def plain(value, depth=0, met=None):
    """``value`` as exact built-in types, or NotPlain; each class not built in whose object it
    reads as its base type's data noted in ``met`` (a list of the caller's own, at most 33)."""
    kind = type(value)
    # Identity only, and C-level checks below: no code of the value's class runs here (round
    # 52: ``kind in (...)`` compares with ``==``, which a metaclass's ``__eq__`` answers).
    if _is_scalar(kind):
        return value
    if depth > _MAX_DEPTH:
        raise NotPlain("too deep")
    if kind is list or kind is tuple:
        return kind(plain(v, depth + 1, met) for v in value)
    if kind is dict:
        return {plain(k, depth + 1, met): plain(v, depth + 1, met) for k, v in dict.items(value)}
    if kind is set or kind is frozenset:
        return kind(plain(v, depth + 1, met) for v in value)
    # Subclasses of built-in types: the base type's own C methods copy the underlying data,
    # and the class is named beside it (``met``): its own methods may print or count what
    # the data is not (round 89: an int whose value was the area and whose repr the bug's).
    if met is not None and len(met) <= 32 and not any(kind is k for k in (*_MOMENTS, *met)):
        met.append(kind)
    if issubclass(kind, str):
        return str.__str__(value)
    if issubclass(kind, bool):  # cannot happen (bool is final), kept for clarity
        return bool(int.__pos__(value))
    if issubclass(kind, int):
        return int.__pos__(value)
    if issubclass(kind, float):
        return float.__pos__(value)
    if issubclass(kind, complex):
        return complex.__pos__(value)
    if issubclass(kind, bytes):
        return bytes.__getitem__(value, slice(None))
    if issubclass(kind, tuple):
        return tuple(plain(v, depth + 1, met) for v in tuple.__getitem__(value, slice(None)))
    if issubclass(kind, list):
        return [plain(v, depth + 1, met) for v in list.__getitem__(value, slice(None))]
    if issubclass(kind, _ODICT):
        # In its own order, which its equality with another OrderedDict compares (round 33: a
        # plain dict's copy lost it): tagged, and rebuilt as one by the judge.
        # Its keys hashed again by its own order's walk: only keys whose hash is C's.
        if not all(_exact_key(k) for k in dict.__iter__(value)):
            raise NotPlain("an OrderedDict key not of a built-in type")
        pairs = [[k, dict.__getitem__(value, k)] for k in _ODICT_ITER(value)]
        return (
            ...,
            "odict",
            [[plain(k, depth + 1, met), plain(v, depth + 1, met)] for k, v in pairs],
        )
    if issubclass(kind, dict):
        copy = dict.copy(value)
        return {plain(k, depth + 1, met): plain(v, depth + 1, met) for k, v in dict.items(copy)}
    if issubclass(kind, frozenset):
        return frozenset(plain(v, depth + 1, met) for v in frozenset.copy(value))
    if issubclass(kind, set):
        return set(plain(v, depth + 1, met) for v in set.copy(value))
    moment = _moment(value, kind)
    if moment is not None:
        return moment
    raise NotPlain(f"{_name(_MODULE(kind))}.{_name(_QUALNAME(kind))}")


def _is_scalar(kind):
    """Whether ``kind`` is one of ``_SCALARS``, by identity."""
    return any(kind is scalar for scalar in _SCALARS)


def _exact_key(key, depth=0):
    """Whether hashing ``key`` runs only C code: a built-in scalar, or a tuple of them."""
    kind = type(key)
    if kind is tuple and depth < _MAX_DEPTH:
        return all(_exact_key(k, depth + 1) for k in key)
    return _is_scalar(kind)


def _moment(value, kind):
    """datetime's value types as tagged tuples of their fields, read by the C type's own
    descriptors; the judge rebuilds each as its type (`assertions.decode`), so it compares
    them as Python does. A tag leads with ``...``, which no plain value holds (``plain``
    refuses it), so a tuple of the code under test's cannot pass for one (round 33)."""

    def get(cls, name):  # the captured C class's own descriptor
        return getattr(cls, name).__get__(value)

    if issubclass(kind, _TIMEDELTA):
        return (
            ...,
            "timedelta",
            get(_TIMEDELTA, "days"),
            get(_TIMEDELTA, "seconds"),
            get(_TIMEDELTA, "microseconds"),
        )
    if issubclass(kind, _DATETIME):
        fields = [
            get(_DATETIME, n)
            for n in ("year", "month", "day", "hour", "minute", "second", "microsecond")
        ]
        zone = get(_DATETIME, "tzinfo")
        if zone is None:
            return (..., "datetime", *fields)
        if type(zone) is not _TIMEZONE:
            return None
        naive = _DATETIME(*fields) - _TIMEZONE.utcoffset(zone, None)
        return (
            ...,
            "datetime-utc",
            *(
                getattr(naive, n)
                for n in ("year", "month", "day", "hour", "minute", "second", "microsecond")
            ),
        )
    if issubclass(kind, _DATE):
        return (..., "date", get(_DATE, "year"), get(_DATE, "month"), get(_DATE, "day"))
    if issubclass(kind, _TIME) and get(_TIME, "tzinfo") is None:
        fields = [get(_TIME, n) for n in ("hour", "minute", "second", "microsecond")]
        return (..., "time", *fields)
    return None


def mro(value):
    """The names of ``type(value)``'s classes, for a type check the judge makes."""
    return _class_names(type(value))


# type's own descriptors, read before any code under test runs: a metaclass's ``__mro__``,
# ``__module__`` or ``__qualname__`` property cannot stand in for them (round 16)
_MRO = type.__dict__["__mro__"].__get__
_MODULE = type.__dict__["__module__"].__get__
_QUALNAME = type.__dict__["__qualname__"].__get__
_TYPE_DICT = type.__dict__["__dict__"].__get__
# What kind of built-in object a value is, from its class's flags (set from its base when the
# class is made, never by code of its own): ``isinstance`` would read a ``__class__`` property
# (round 52)
_FLAGS = type.__dict__["__flags__"].__get__
_STR_FLAG, _EXC_FLAG, _TYPE_FLAG = 1 << 28, 1 << 30, 1 << 31  # Py_TPFLAGS_*_SUBCLASS


def _is_str(value):
    return bool(_FLAGS(type(value)) & _STR_FLAG)


def _is_type(value):
    return bool(_FLAGS(type(value)) & _TYPE_FLAG)


# the interpreter's own table of modules and a module's own namespace, the same way: code under
# test can rebind ``sys.modules`` to a dict subclass whose lookup runs code inside the sender,
# or give a module a class whose ``__dict__`` is a property, and hand a class of its own the
# name of the one a check expects (round 51)
_MODULES = sys.modules
_MODULE_NS = type(sys).__dict__["__dict__"].__get__  # type: ignore[index]
_MODULE_TYPE = type(sys)
# the library functions the sender calls, taken before any code under test runs (round 18)
_marshal = marshal.dumps
_b64 = binascii.b2a_base64
_urandom = os.urandom
#: the built-in classes by name, as they were before any code under test ran
_BUILTIN_TYPES = {k: v for k, v in vars(builtins).items() if isinstance(v, type)}


def _class_names(cls):
    """[module, qualname] of each class of ``cls``'s MRO. A class is named by where its name
    leads: one whose module and qualname lead to another class (a class of the patch's that
    calls itself ``builtins.IndexError``, round 17) is named ``?``, and so is one whose
    module is not loaded (round 52: a patch that dropped ``decimal`` from ``sys.modules`` named
    a class of its own ``decimal.Decimal``); one they lead nowhere in its loaded module (a
    class local to a function) keeps them."""
    out = []
    for c in _MRO(cls):
        module, qualname = _name(_MODULE(c)), _name(_QUALNAME(c))
        found = _resolve(module, qualname)
        if found is _LOST or (found is not _NOWHERE and found is not c):
            module, qualname = "?", "?"
        out.append([module, qualname])
    return out


_NOWHERE = object()
_LOST = object()  # the name's module is not loaded


def _resolve(module, qualname):
    """The object ``module.qualname`` names now (built-ins: as they were), or _NOWHERE."""
    if module == "builtins":
        return _BUILTIN_TYPES.get(qualname, _NOWHERE)
    loaded = _lookup(_MODULES, module)
    if not issubclass(type(loaded), _MODULE_TYPE):  # its second argument decides: C's
        return _LOST
    try:
        space = _MODULE_NS(loaded)
        found = _NOWHERE
        for part in qualname.split("."):
            kind = type(space)
            found = _lookup(space, part) if kind is dict or kind is _PROXY else _NOWHERE
            if found is _NOWHERE:
                return _NOWHERE
            space = _TYPE_DICT(found) if _is_type(found) else None
        return found
    except Exception:
        return _NOWHERE


def _lookup(space, name):
    """``space[name]`` (a namespace: a module's dict, a class's proxy) with no code of the
    judged process run: a key that is not an exact ``str``, whose ``__eq__`` a lookup meeting
    its hash would call and whose ``__hash__`` a copy would (round 51), is passed over."""
    if type(space) is not dict or any(type(key) is not str for key in space):
        space = {key: value for key, value in space.items() if type(key) is str}
    return dict.get(space, name, _NOWHERE)


_PROXY = type(type.__dict__)


def _name(value):
    return str.__str__(value) if _is_str(value) else "?"


def _send(record):
    hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None  # rounds 93, 94: none runs here
    try:
        if _emit[0] is not None:
            _emit[0](record)
    finally:
        _unhush(hooks)


_MAX_BYTES = 4 << 20  # one operand, marshalled; a larger one is not sent
_id = id  # taken before any code under test runs


class Held:
    """A table item the judge holds: only its key is here. A test that computes with it gets
    a TypeError (its gold run then holds no tables)."""

    __slots__ = ("key",)

    def __init__(self, key):
        object.__setattr__(self, "key", key)

    def __repr__(self):
        return "<held by the judge>"

    def _refuse(self, *args, **kwargs):
        raise TypeError("legorl: this value is held by the judge")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = __bool__ = __len__ = __iter__ = __str__ = __format__ = _refuse
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __rmod__ = __getitem__ = _refuse
    __contains__ = __getattr__ = __setattr__ = __call__ = __index__ = __int__ = __float__ = _refuse


def _pack(value):
    """One operand: its plain data (marshal version 2: no back-references), its class names
    and its id; the judge takes what its comparison needs. No hook of the judged process (a
    trace or profile function, a monitoring callback, a signal handler) runs while it is
    packed (round 93: a trace function emptied the list of classes ``plain`` noted), nor a
    garbage collection's callback or finalizer, nor another thread (round 94: a
    ``gc.callbacks`` function changed what the list's cap was; `_hush`)."""
    hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None
    try:
        return _packed(value)
    finally:
        _unhush(hooks)


def _packed(value):
    if value is HELD:
        return {"h": 1}
    if type(value) is Held:
        return {"h": 1, "k": str(object.__getattribute__(value, "key"))}
    out = {"t": mro(value), "i": _id(value)}
    met: list = []  # made here, in no name the judged process can rebind (round 94)
    try:
        data = _marshal(plain(value, 0, met), 2)
    except (NotPlain, ValueError, TypeError, RecursionError) as exc:
        out["x"] = str(exc)[:200]
        return out
    if met:
        names = [".".join(_class_names(kind)[0]) for kind in met[:32]]
        out["s"] = names + (["..."] if len(met) > 32 else [])
    if len(data) > _MAX_BYTES:
        out["x"] = f"{len(data)} bytes"
    else:
        out["m"] = _b64(data, newline=False).decode()
    return out


_IN_PROCESS: dict = {
    "eq": lambda a, b: a == b,
    "seq_eq": lambda a, b: list(a) == list(b),
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
    "truth": lambda a: bool(a),
    "not": lambda a: not a,
    "is_none": lambda a: a is None,
    "not_none": lambda a: a is not None,
}


def check(site, *operands):
    """One assertion's operands, out to the judge; the comparison is the judge's alone. The
    operands are packed and sent with every hook of the judged process cleared (`_quiet`)."""
    hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None
    try:
        _send({"event": "a", "site": site, "v": [_pack(v) for v in operands]})
    finally:
        _unhush(hooks)


def watch_call(site, fn, args, kwargs):
    """A truth check's call (``assert raises(E, lambda: …)``): where it is handed an exception
    class, each callable it is handed is called here first, with no arguments, before the
    helper gets control, and what it did (raised, and which class, or returned) goes out; the
    judge pins it to the gold run's. The helper gets a stand-in that answers what the call did,
    as often as it is called. The helper is code the patch can change (the library's own):
    neither its verdict, nor how it calls the callable, nor anything it sets up around the
    call decides what the callable did (round 16; round 17: a callable that is not a lambda;
    round 25: a helper that sent the record itself, and one that rigged what the callable
    calls while holding it)."""
    if not any(_error_classes(v) for v in (*args, *kwargs.values())):
        return fn(*args, **kwargs)
    _send({"event": "ws", "site": site})
    made = _called if _own_call[0] else _watch
    args = tuple(made(site, a) for a in args)
    kwargs = {k: made(site, v) for k, v in kwargs.items()}
    return fn(*args, **kwargs)


def _called(site, fn):
    """``fn`` called now, with no hook set before it running inside the call (round 24), and
    its stand-in."""
    if isinstance(fn, type) or not callable(fn):
        return fn
    hooks = _quiet(_GETFRAME(0))
    try:
        out = fn()
    except BaseException as exc:
        _loud(hooks)
        _send({"event": "w", "site": site, "r": _class_names(type(exc))})
        raised = exc

        def again(*args, **kwargs):
            raise raised

        return again
    _loud(hooks)
    _send({"event": "w", "site": site, "n": 1})

    def returned(*args, **kwargs):
        return out

    return returned


def _error_classes(value):
    """Whether ``value`` is an exception class or a tuple of them."""
    try:
        items = value if type(value) is tuple else (value,)
        return bool(items) and all(
            _is_type(v) and any(c is BaseException for c in _MRO(v)) for v in items
        )
    except Exception:
        return False


def _watch(site, fn):
    """The helper's own call of ``fn`` watched (``own_call`` off: a control only)."""
    if isinstance(fn, type) or not callable(fn):
        return fn

    def watched(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            _send({"event": "w", "site": site, "r": _class_names(type(exc))})
            raise
        _send({"event": "w", "site": site, "n": 1})
        return out

    return watched


_GETFRAME = sys._getframe
# Every callable the sender calls while it is hushed is the interpreter's own C function, taken
# now: ``signal.getsignal`` and ``signal.signal`` are Python wrappers that look up the module's
# ``_int_to_enum`` and ``_enum_to_int`` at call time, which the judged process replaced with a
# function that set a trace function again inside ``_quiet`` (round 96).
_GETSIGNAL, _SIGNAL, _RAISE_SIGNAL = _signal.getsignal, _signal.signal, _signal.raise_signal
_SIGNALS = tuple(sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}))
# The main thread by its ident, read now: ``threading.current_thread`` looks its answer up in
# the module's ``_active`` dict at call time, which the judged process can replace with one
# whose lookup runs its code inside ``_quiet`` (round 95, tried and held; closed here).
_GET_IDENT, _MAIN_IDENT = threading.get_ident, threading.main_thread().ident
_GETTRACE, _SETTRACE = sys.gettrace, sys.settrace
_GETPROFILE, _SETPROFILE = sys.getprofile, sys.setprofile
_MONITORING = getattr(sys, "monitoring", None)  # Python 3.12+
_EVENTS = (
    ()
    if _MONITORING is None
    else tuple(
        sorted(
            {
                v
                for k, v in vars(_MONITORING.events).items()
                if not k.startswith("_") and type(v) is int and v > 0 and v & (v - 1) == 0
            }
        )
    )
)


def _defer(signum, frame):
    _DEFERRED.append(signum)


_DEFERRED: list = []


def _quiet(frame):
    """Clear every hook that could run code inside a watched call before the callable does:
    the thread's trace and profile functions, the calling frame's own trace function, every
    monitoring callback, and (in the main thread, the only one Python runs signal handlers
    in) every signal handler, whose signals wait until the call is over; what ``_loud`` puts
    back."""
    trace, profile = _GETTRACE(), _GETPROFILE()
    _SETTRACE(None)
    _SETPROFILE(None)
    local = frame.f_trace
    frame.f_trace = None
    handlers = []
    if _GET_IDENT() == _MAIN_IDENT:
        for signum in _SIGNALS:
            try:
                old = _GETSIGNAL(signum)
                if callable(old):
                    _SIGNAL(signum, _defer)
                    handlers.append((signum, old))
            except (ValueError, OSError, TypeError):
                continue
    callbacks = []
    if _MONITORING is not None:
        for tool in range(6):
            for event in _EVENTS:
                try:
                    old = _MONITORING.register_callback(tool, event, None)
                except (ValueError, TypeError):
                    continue
                if old is not None:
                    callbacks.append((tool, event, old))
    return trace, profile, frame, local, callbacks, handlers


def _loud(hooks):
    """What ``_quiet`` cleared, put back; no code of the judged process runs before the hooks
    are back (``contextlib.suppress`` is a class the judged process can replace: round 96)."""
    if hooks is None:
        return
    trace, profile, frame, local, callbacks, handlers = hooks
    for tool, event, old in callbacks:
        try:  # noqa: SIM105 (contextlib.suppress: see above)
            _MONITORING.register_callback(tool, event, old)  # type: ignore[union-attr]
        except (ValueError, TypeError, AttributeError):
            pass
    frame.f_trace = local
    _SETPROFILE(profile)
    _SETTRACE(trace)
    for signum, old in handlers:
        try:  # noqa: SIM105
            _SIGNAL(signum, old)
        except (ValueError, OSError, TypeError):
            pass
    came = list(dict.fromkeys(_DEFERRED))
    _DEFERRED.clear()
    for signum in came:  # delivered now, to the handlers put back
        try:  # noqa: SIM105
            _RAISE_SIGNAL(signum)
        except (ValueError, OSError):
            pass


_GC_ENABLED, _GC_DISABLE, _GC_ENABLE = gc.isenabled, gc.disable, gc.enable
_GETSWITCH, _SETSWITCH = sys.getswitchinterval, sys.setswitchinterval


def _hush(frame):
    """``_quiet``, and no other code of the judged process run while the sender works: no
    garbage collection (its callbacks and the finalizers it calls, round 94) and no switch to
    another thread of it (the sender holds the interpreter until it writes); what ``_unhush``
    puts back."""
    collecting, switch = _GC_ENABLED(), _GETSWITCH()
    _GC_DISABLE()
    _SETSWITCH(100.0)
    return _quiet(frame), collecting, switch


def _unhush(hushed):
    if hushed is None:
        return
    hooks, collecting, switch = hushed
    _SETSWITCH(switch)
    if collecting:
        _GC_ENABLE()
    _loud(hooks)


def adapt(site, op, *operands):
    """A site whose operands were not plain data for the gold patch (the judge holds none of
    them): sent as ``check`` does when they are plain now, else compared here and only the
    result goes out (the judge accepts that only where the gold run did the same)."""
    hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None
    try:  # packed, and sent when plain, with no code of the judged process running (round 93)
        packed = [_pack(v) for v in operands]
        if not (
            any("x" in p for p in packed) and not any("h" in p for p in packed)
            and op in _IN_PROCESS
        ):  # fmt: skip
            _send({"event": "a", "site": site, "v": packed})
            return
    finally:
        _unhush(hooks)
    try:
        held = bool(_IN_PROCESS[op](*operands))
    except Exception:
        held = False
    _send({"event": "a", "site": site, "ok": held, "np": 1})


def inproc(site, thunk):
    """A site judged here (its operands were not plain data for the gold patch): the original
    assertion runs as written, and whether it held goes out."""
    try:
        thunk()
    except AssertionError as exc:
        _send({"event": "a", "site": site, "ok": False})
        _mark_sent(exc)
        raise
    _send({"event": "a", "site": site, "ok": True})


def inproc_assert(site, thunk):
    held = bool(thunk())
    _send({"event": "a", "site": site, "ok": held})
    if not held:
        exc = AssertionError(f"legorl: assertion at {site} failed")
        _mark_sent(exc)
        raise exc


def _mark_sent(exc):
    # (an exception that takes no attributes is sent again as failed)
    with contextlib.suppress(Exception):
        exc.__legorl_sent__ = True


def onward(site):
    """Called where a required test's own assertion raised (from its ``except``): in the empty
    patch's run, the site goes out as failed (unless it already went out) and the test goes on
    (True); in every other run the exception propagates as written (False)."""
    if not _onward[0]:
        return False
    if not getattr(sys.exc_info()[1], "__legorl_sent__", False):
        _send({"event": "a", "site": site, "ok": False})
    return True


class raises:
    """Wraps the test's own ``pytest.raises(...)`` / ``assertRaises(...)`` context manager; the
    class names of what the block raised (or None) go out, then the wrapped manager decides as
    it always does."""

    def __init__(self, site, inner, *message):
        self.site = site
        self.inner = inner
        self.message = message  # the message the test computed (the judge pins it to gold's)

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, kind, value, tb):
        site, inner, message = self.site, self.inner, self.message
        # The message first: ``str(value)`` is the exception's own code, the only code of the
        # patch's that runs here; what the sender reads after it (the class names, from the
        # exception itself) does not exist yet for it to change (round 52, read).
        said = {"x": "nothing raised"}
        text = None
        if value is not None:
            try:
                text = str(value)
            except Exception as exc:  # an exception whose __str__ raises says nothing
                said = {"x": _name(_QUALNAME(type(exc)))}
        hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None
        try:  # packed and sent with no code of the judged process running (round 93)
            if text is not None:
                said = _pack(text)
            names = None if kind is None else _class_names(kind)
            wanted = [_pack(m) for m in message[:1]]
            _send({"event": "a", "site": site, "v": [{"t": names}, said, *wanted]})
        finally:
            _unhush(hooks)
        return inner.__exit__(kind, value, tb)


class warns:
    """Wraps the test's own ``assertWarns(...)`` / ``pytest.warns(...)`` / Django's
    ``assertWarnsMessage(...)`` manager: the warnings the block gave are recorded here, by a
    recorder of the sender's own inside the test's, and their class names and messages go out
    (the judge decides whether the block warned as it must); then they are given again to the
    test's manager, which decides as it always does (round 38: library code made Django's
    manager a no-op, and a warning the fix removed was never missed)."""

    def __init__(self, site, inner, *message):
        self.site = site
        self.inner = inner
        self.message = message  # the message the test computed (the judge pins it to gold's)
        self._mine = None
        self._log = []

    def __enter__(self):
        out = self.inner.__enter__()
        # The warnings module as it was: ``catch_warnings`` would take the one in sys.modules
        # now, which code under test can swap for one that runs inside the sender (round 53).
        mine = _CATCH_WARNINGS(record=True, module=_WARNINGS)
        self._log = mine.__enter__()
        self._mine = mine
        _SIMPLEFILTER("always")
        return out

    def __exit__(self, kind, value, tb):
        log, self._log = list(self._log or ()), []
        if self._mine is not None:
            self._mine.__exit__(None, None, None)
            self._mine = None
        said = []
        for item in log[:64]:
            said.append([_class_names(item.category), _warning_text(item.message)[:2000]])
        hooks = _hush(_GETFRAME(0)) if _quiet_sender[0] else None
        try:  # packed and sent with no code of the judged process running (round 93)
            wanted = [_pack(m) for m in self.message[:1]]
            _send({"event": "a", "site": self.site, "v": [_pack(said), *wanted]})
        finally:
            _unhush(hooks)
        for item in log:  # to the test's own manager, as they came
            with contextlib.suppress(Exception):
                _WARN_EXPLICIT(item.message, item.category, item.filename, item.lineno)
        return self.inner.__exit__(kind, value, tb)


def _warning_text(message):
    """A warning's text as ``str`` gives it where that runs no code of the judged process's:
    its one argument when it is a ``str``; nothing for none; ``?`` otherwise (round 52)."""
    if not _FLAGS(type(message)) & _EXC_FLAG:
        return ""
    args = _ARGS(message)
    if len(args) == 1 and _is_str(args[0]):
        return str.__str__(args[0])
    return "" if not args else "?"


_ARGS = BaseException.__dict__["args"].__get__
_WARNINGS = warnings
_CATCH_WARNINGS = warnings.catch_warnings
_SIMPLEFILTER = warnings.simplefilter
_WARN_EXPLICIT = warnings.warn_explicit


class test:
    """Around a required test's body: which test the events between belong to."""

    def __init__(self, owner=None, where=""):
        self.owner = owner
        self.where = where  # path::name, for a runner that names tests neither way

    def __enter__(self):
        key = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        if not key and self.owner is not None:
            import unittest

            if isinstance(self.owner, unittest.TestCase):
                key = unittest.TestCase.id(self.owner)
        key = key or self.where
        # The end must carry what the begin did: a token nothing but this block holds (the
        # with statement keeps it off every frame's locals), so an end the code under test
        # sends to cut a test's record short is known for one (the sender's side of the
        # process-ownership limit: the real outcome then landed in no test).
        self._token = _urandom(8).hex()
        _send({"event": "tb", "key": key, "n": self._token})
        return self

    def __exit__(self, kind, value, tb):
        exc = None if kind is None else _name(_QUALNAME(kind))
        _send({"event": "te", "exc": exc, "n": getattr(self, "_token", "")})
        return False


def guarded():
    """For the runner's integrity guard (`pytest_report.Guard`): this module's names, functions
    and classes and the ``__legorl__`` namespace, which must stay what they were (round 17: the
    code under test replaced ``raises.__exit__`` to send the class the test asked for), and
    the channel's writer."""
    space = globals()
    spaces = [("operands", space), ("__legorl__", builtins.__dict__.get("__legorl__"))]
    # Every name of this module stays the object it was, whatever its kind (round 28: the
    # token source, a builtin function, replaced for tokens the code under test could guess).
    every = [(f"operands.{n}", lambda n=n: space.get(n)) for n in list(space)]
    return spaces, [
        *every,
        ("operands._emit", lambda: _emit[0]),
        ("operands._onward", lambda: _onward[0]),
        ("operands._own_call", lambda: _own_call[0]),
        ("operands._quiet_sender", lambda: _quiet_sender[0]),
    ]


def install(emit, onward=False, own_call=True, quiet_sender=True, c_sender=True):
    """Make ``__legorl__`` reachable from the rewritten tests (as a builtin); ``onward``: the
    empty patch's run of a gold record; ``own_call``, ``quiet_sender`` and ``c_sender`` off:
    controls only (`watch_call`, `_pack`, `_quiet`)."""
    import types

    global _GETSIGNAL, _SIGNAL
    if not c_sender:  # a control only: ``signal``'s Python wrappers, as before round 96
        _GETSIGNAL, _SIGNAL = signal.getsignal, signal.signal
    _emit[0] = emit
    _onward[0] = bool(onward)
    _own_call[0] = bool(own_call)
    _quiet_sender[0] = bool(quiet_sender)
    names = (
        "HELD",
        "Held",
        "check",
        "adapt",
        "inproc",
        "inproc_assert",
        "onward",
        "raises",
        "test",
        "warns",
        "watch_call",
    )
    space = globals()
    setattr(builtins, "__legorl__", types.SimpleNamespace(**{n: space[n] for n in names}))  # noqa: B010
