"""Out-of-process assertion judging, the judge's half: the required tests' files are rewritten
before the run so that each assertion sends its operands out as plain data (`operands.py` runs
in the judged process), and the judge applies each comparison here, against expected values the
judged process never holds.

    plan = rewrite.plan_files(…)                              # before any repository code runs
    events = by_test(records)                                 # what the run sent
    verdict = judge_test(key, events, plan, gold, covered)    # after the run

What is judged where:

* An operand the source spells as a literal (``15``, ``[1, 2]``, ``{"a": (1,)}``, ``-3``,
  ``set()``, ``pytest.approx(12)``, and a local name bound once to a literal and used only as an
  assertion's operand) is stripped from the file; the judge holds it.
* Every other operand is evaluated by the test as before and crosses the boundary as exact-type
  plain data (marshal). The comparison (``==``, ``<``, ``in``, ``is None``, truth, isinstance by
  class name, approx, unittest's ``assertX`` family, the class of what a ``raises`` block
  raised) is made here. In an equality, a computed operand must also equal what the gold patch's
  run computed at the same place, where two gold runs agree on it: an expected value the test
  computes is the gold run's, not the judged run's.
* The number and order of assertion events of each test must be the gold run's.
* A site whose operands were not plain data for the gold patch runs in the judged process as
  written (``judged_in_process``), as does a truth check whose expression compares in-process.

Coverage is fixed before the candidate's code runs, from the pristine test source and the gold
record (which holds a run of the empty patch too). A ``FAIL_TO_PASS`` test is covered when one
of the events a fix must change (``decisive``) is judged here against an expected value the
judged process never holds and cannot guess (``secret_bearing``); a ``PASS_TO_PASS`` test when
the gold run judged at least one of its assertions here. An uncovered required test is
``unverified`` (a failure) unless the task declares it uncoverable (``Task.uncoverable``).
"""

from __future__ import annotations

import binascii
import collections
import datetime
import itertools
import marshal
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import regex

from legorl.verify.rewrite import _EQ, Approx, Plan, Site
from legorl.verify.shown import published, shown_numbers

# --------------------------------------------------------------------------------------------
# Events and the judge
# --------------------------------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _NotExact(Exception):
    pass


def _rebuilt(value: Any, depth: int = 0) -> Any:
    """What marshal gave back, checked to be exact built-in types all the way down, with each
    tagged value (a tuple led by ``...``, which no plain value holds: `operands.plain` refuses
    it) rebuilt by the judge as the type it stands for, so that the judge's comparison of it
    is Python's own (round 33: a date is no tuple, a naive and an aware datetime do not order,
    two OrderedDicts compare in order); _NotExact for anything else."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if depth > 60:
        raise _NotExact
    if kind is tuple and value and value[0] is Ellipsis:
        return _tagged(value[1:], depth)
    if kind in (list, tuple, set, frozenset):
        return kind(_rebuilt(v, depth + 1) for v in value)
    if kind is dict:
        return {_rebuilt(k, depth + 1): _rebuilt(v, depth + 1) for k, v in value.items()}
    raise _NotExact


_MOMENTS: dict[str, tuple[int, Callable[..., Any]]] = {
    "date": (3, datetime.date),
    "datetime": (7, datetime.datetime),
    "datetime-utc": (7, lambda *f: datetime.datetime(*f).replace(tzinfo=datetime.UTC)),
    "time": (4, datetime.time),
    "timedelta": (3, lambda d, s, us: datetime.timedelta(days=d, seconds=s, microseconds=us)),
}


def _tagged(fields: tuple[Any, ...], depth: int) -> Any:
    """A tagged value's fields (`operands._moment`, an OrderedDict) as that value."""
    tag, rest = (fields[0], fields[1:]) if fields else (None, ())
    try:
        if type(tag) is str and tag in _MOMENTS:
            count, make = _MOMENTS[tag]
            if len(rest) == count and all(type(f) is int for f in rest):
                return make(*rest)
        pairs = rest[0] if len(rest) == 1 else None
        if (
            tag == "odict"
            and type(pairs) is list
            and all(type(p) is list and len(p) == 2 for p in pairs)
        ):
            return collections.OrderedDict(
                (_rebuilt(k, depth + 1), _rebuilt(v, depth + 1)) for k, v in pairs
            )
    except (ValueError, OverflowError, TypeError):
        pass
    raise _NotExact


#: (``.`` is ``...``, which leads a tagged value: `_rebuilt`)
_MARSHAL_FIXED = {
    ord("N"): 0,
    ord("F"): 0,
    ord("T"): 0,
    ord("."): 0,
    ord("i"): 4,
    ord("g"): 8,
    ord("y"): 16,
}
_MARSHAL_SIZED = {
    ord("s"): 4,
    ord("u"): 4,
    ord("a"): 4,
    ord("A"): 4,
    ord("z"): 1,
    ord("Z"): 1,
    ord("t"): 4,
}
_MARSHAL_SEQUENCE = {ord("("): 4, ord(")"): 1, ord("["): 4, ord("<"): 4, ord(">"): 4}


#: Containers decoded from one run's operands (about 50 MiB of them at most).
CONTAINERS = 200_000
#: The hashing work of one run's operands: the sum over its sets and dicts of their item count
#: times their items' marshalled bytes. Keys whose hashes all collide (the ints
#: ``i * (2**61 - 1)`` all hash to 0) make a set of n of them cost about n**2 / 2 comparisons
#: to build, each as long as the items compared, so a bound on bytes alone lets a few MiB stall
#: the judge for minutes; this one is a fraction of a second at worst.
HASHING = 50_000_000
#: Values of any kind decoded from one run's operands: a marshalled short text is 2 bytes and
#: a 50-byte object, so this bounds what the judge builds to about 100 MiB.
VALUES = 2_000_000


class Budget:
    """What the judge still spends on one run's operands: the containers it builds (a
    marshalled ``{None: None}`` is 4 bytes and a 232-byte dict, so a stream's cap alone bounds
    the judge's memory only about 60 times over) and the hashing work of its sets and dicts
    (``HASHING``), and the values of any kind it builds (``VALUES``)."""

    def __init__(
        self, containers: int = CONTAINERS, hashing: int = HASHING, values: int = VALUES
    ) -> None:
        self.containers = containers
        self.hashing = hashing
        self.values = values


def marshal_sound(data: bytes, budget: Budget | None = None) -> bool:
    """Whether ``data`` is one marshalled value of plain types whose every declared length fits
    in the bytes that follow, checked before ``marshal.loads`` allocates anything for it (a
    blob of a few bytes can otherwise declare a list of 2**31 items), and whose containers and
    hashing work fit in what is left of ``budget`` (taken from it when they do; without one, in
    a fresh budget)."""
    end = len(data)
    containers = hashing = values = 0
    budget = budget if budget is not None else Budget()
    most = budget.values  # the walk itself stops there: it is the judge's work too (round 9)

    def value(pos: int, depth: int) -> int | None:  # where the value at ``pos`` ends
        nonlocal containers, hashing, values
        if depth > 100 or pos >= end or values >= most:
            return None
        values += 1
        code = data[pos] & 0x7F  # the FLAG_REF bit only marks the value for back-references
        pos += 1
        if code in _MARSHAL_FIXED:
            pos += _MARSHAL_FIXED[code]
        elif code == ord("l"):
            if pos + 4 > end:
                return None
            pos += 4 + 2 * abs(int.from_bytes(data[pos : pos + 4], "little", signed=True))
        elif code in _MARSHAL_SIZED:
            width = _MARSHAL_SIZED[code]
            if pos + width > end:
                return None
            pos += width + int.from_bytes(data[pos : pos + width], "little", signed=width == 4)
        elif code in _MARSHAL_SEQUENCE:
            containers += 1
            width = _MARSHAL_SEQUENCE[code]
            if pos + width > end:
                return None
            count = int.from_bytes(data[pos : pos + width], "little", signed=width == 4)
            pos += width
            if count < 0 or count > end - pos:  # every item takes at least one byte
                return None
            start = pos
            triple = count == 3 and code in (ord("("), ord(")"))  # a tag may lead it
            items = []
            for _ in range(count):
                if triple:
                    items.append(pos)
                found = value(pos, depth + 1)
                if found is None:
                    return None
                pos = found
            if code in (ord("<"), ord(">")):  # a set or frozenset: its items are hashed
                hashing += count * (pos - start)
            if triple and data[items[0]] & 0x7F == ord(".") and data[items[2]] & 0x7F == ord("["):
                # A tagged OrderedDict's pairs (`_tagged`): its keys are hashed as a dict's
                # are (round 36: 180,000 colliding keys in a list cost nothing here, then 11
                # minutes to rebuild).
                at = items[2] + 1
                pairs = int.from_bytes(data[at : at + 4], "little", signed=True)
                hashing += max(pairs, 0) * (pos - items[2])
        elif code == ord("{"):
            containers += 1
            pairs, start = 0, pos
            while True:
                if pos >= end:
                    return None
                if data[pos] == ord("0"):  # the dict's end
                    hashing += pairs * (pos - start)
                    return pos + 1
                pairs += 1
                for _ in range(2):  # a key, then its value
                    found = value(pos, depth + 1)
                    if found is None:
                        return None
                    pos = found
        else:  # back-references ("r": a structure could share itself 2**n ways) and code objects
            return None  # code objects and the rest are not plain data
        return pos if pos <= end else None

    if value(0, 0) != end:
        if values >= most:  # past what is left: the run's operands are spent
            budget.containers = budget.hashing = budget.values = 0
        return False
    if containers > budget.containers or hashing > budget.hashing or values > budget.values:
        budget.containers = budget.hashing = budget.values = 0
        return False
    budget.containers -= containers
    budget.hashing -= hashing
    budget.values -= values
    return True


@dataclass(slots=True)
class Event:
    site: str
    values: list[Any]  # per operand: a value, or _MISSING (held, or not plain)
    plain: list[bool]  # per operand: crossed as plain data (held ones: True)
    held: list[bool]
    #: per operand: its class names (isinstance; raises: what the block raised, None if nothing)
    types: list[list[list[str]] | None] = field(default_factory=list)
    idents: list[int | None] = field(default_factory=list)  # per operand: its id (identity)
    keys: list[str | None] = field(default_factory=list)  # per operand: a table handle's key
    ok: bool | None = None  # an in-process site's own verdict
    adaptive: bool = False  # a judge site that compared in process (an operand not plain)
    #: a truth check's: what each callable the test handed its call did (`operands.watch_call`):
    #: ("r", the raised class's names) or ("n",) for a return; None when it handed none
    calls: list[tuple[str, ...]] | None = None
    #: per operand: the classes not built in whose objects it held, read as their base type's
    #: data (`operands.plain`); an empty set where there were none
    met: list[frozenset[str]] = field(default_factory=list)


_MISSING = object()
_MAX_CALLS = 64  # watched calls kept per site event


def _names(raw: Any) -> list[list[str]] | None:
    """Class names as sent ([[module, qualname], ...]); a malformed list reads as None."""
    if not isinstance(raw, list) or len(raw) > 64:
        return None
    if not all(isinstance(n, list) and len(n) == 2 and all(type(x) is str for x in n) for n in raw):
        return None
    return [[a[:200], b[:200]] for a, b in raw]


def _met(raw: Any) -> frozenset[str]:
    """The class names an operand's ``s`` lists; a malformed list reads as a class nobody
    else's run met."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or len(raw) > 64 or not all(type(n) is str for n in raw):
        return frozenset({"?malformed"})
    return frozenset(n[:400] for n in raw)


def _call(record: dict[str, Any]) -> tuple[str, ...]:
    """A ``w`` record (`operands.watch_call`): ("n",) for a return, ("r", names…) for a raise;
    malformed reads as a call nobody made."""
    if record.get("n") == 1 and "r" not in record:
        return ("n",)
    names = _names(record.get("r"))
    return ("?",) if names is None else ("r", *(f"{m}.{q}" for m, q in names))


def decode(record: dict[str, Any], budget: Budget | None = None) -> Event | None:
    """An ``a`` record from the stream, or None when it is malformed; an operand past what is
    left of ``budget`` reads as not plain."""
    site = record.get("site")
    if not isinstance(site, str):
        return None
    if "ok" in record:
        return Event(site, [], [], [], ok=record["ok"] is True, adaptive=record.get("np") == 1)
    raw = record.get("v")
    if not isinstance(raw, list):
        return None
    event = Event(site, [], [], [], types=[], idents=[], keys=[])
    for item in raw[:4]:
        if not isinstance(item, dict):
            return None
        held = item.get("h") == 1
        value: Any = _MISSING
        data = item.get("m")
        if isinstance(data, str) and not held:
            try:
                blob = binascii.a2b_base64(data)
                value = marshal.loads(blob) if marshal_sound(blob, budget) else _MISSING
            except (ValueError, EOFError, TypeError, binascii.Error):
                value = _MISSING
            if value is not _MISSING:
                try:
                    value = _rebuilt(value)
                except (_NotExact, TypeError, RecursionError):  # (TypeError: an unhashable key)
                    value = _MISSING
        ident = item.get("i")
        handle = item.get("k")
        event.keys.append(handle if held and type(handle) is str else None)
        event.values.append(value)
        event.plain.append(held or value is not _MISSING)
        event.held.append(held)
        event.types.append(_names(item.get("t")))
        event.met.append(_met(item.get("s")))
        event.idents.append(ident if type(ident) is int else None)
    return event


def _approx_ok(actual: Any, approx: Approx) -> bool:
    expected = approx.expected
    if type(expected) in (list, tuple):
        return (
            type(actual) in (list, tuple)
            and len(actual) == len(expected)
            and all(
                _approx_ok(a, Approx(e, approx.rel, approx.abs))
                for a, e in zip(actual, expected, strict=True)
            )
        )
    if type(expected) is dict:
        return (
            type(actual) is dict
            and actual.keys() == expected.keys()
            and all(
                _approx_ok(actual[k], Approx(expected[k], approx.rel, approx.abs)) for k in expected
            )
        )
    numbers = (int, float, complex)
    if type(expected) not in numbers or type(actual) not in numbers or type(actual) is bool:
        return bool(actual == expected)
    if actual == expected:
        return True
    if isinstance(expected, float) and math.isinf(expected):
        return False
    rel = 1e-6 if approx.rel is None else approx.rel
    tol_abs = 1e-12 if approx.abs is None else approx.abs
    tolerance = max(rel * abs(expected), tol_abs)
    if approx.rel is None and approx.abs is not None:
        tolerance = tol_abs
    return abs(actual - expected) <= tolerance


#: Seconds a test's own pattern may search the judged code's message: the text is the
#: patch's, and a pattern with two ``.*`` backtracks for hours on a text made for it.
SEARCH_SECONDS = 0.5


def _bounded_search(pattern: str, text: str) -> bool:
    """A search for a test's own pattern (the judge's literal) in at most 64 KiB of the
    exception's message, given ``SEARCH_SECONDS`` and letting the judge's other threads run
    meanwhile (``re`` holds the interpreter lock to the end): past the time, no match, the
    patch's failure (the text is the judged code's)."""
    try:
        found = regex.search(pattern, text[: 1 << 16], timeout=SEARCH_SECONDS, concurrent=True)
    except (regex.error, TimeoutError):
        return False
    return found is not None


#: Item comparisons ``assertCountEqual`` may make on unhashable items before it fails: the
#: operands are the judged code's (up to 4 MiB each), and pairing them off is quadratic.
COUNT_EQ_BUDGET = 10_000_000


def _count_eq(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same items as often, an item meeting one of its exact
    type and equal to it: hashable items counted in linear time, the unhashable rest paired off
    within ``COUNT_EQ_BUDGET`` comparisons (past it, not equal: round 47, read)."""
    try:
        left, right = list(a), list(b)
    except TypeError:
        return False
    if len(left) != len(right):
        return False
    counts: collections.Counter[tuple[type, Any]] = collections.Counter()
    rest_left: list[Any] = []
    rest: list[Any] = []
    for items, sign, out in ((left, 1, rest_left), (right, -1, rest)):
        for item in items:
            try:
                counts[(type(item), item)] += sign
            except TypeError:  # unhashable: a list, a dict, a set
                out.append(item)
    if any(counts.values()) or len(rest_left) != len(rest):
        return False
    budget = COUNT_EQ_BUDGET
    for item in rest_left:
        for i, other in enumerate(rest):
            budget -= 1
            if budget < 0:
                return False
            if type(item) is type(other) and item == other:
                del rest[i]
                break
        else:
            return False
    return not rest


#: Comparisons made on what the operands are, not on their plain data.
_BY_TYPE = {"isinstance", "notisinstance", "raises"}
_BY_ID = {"same", "not_same"}


def holds(site: Site, values: list[Any], event: Event) -> bool:
    """Whether the assertion holds on plain values (never code of the judged process)."""
    op = site.op
    try:
        if op in _BY_ID and any(is_held for is_held, _ in site.held):
            # Identity with a literal the judge holds (``assertIs(x, True)``): its exact value.
            same = type(values[0]) is type(values[1]) and values[0] == values[1]
            return same == (op == "same")
        if op in _BY_ID:
            a_id, b_id = event.idents[0], event.idents[1]
            if a_id is None or b_id is None:
                return False
            return (a_id == b_id) == (op == "same")
        wanted = _wanted_message(site, event) if op in _COMPUTED_AT else _MISSING
        if op == "raises" and _checks_message(site):
            said = event.values[1] if len(event.values) > 1 else _MISSING
            if not _message_meets(site, wanted, said):
                return False
        if op == "warns":
            if _checks_message(site) and type(wanted) is not str:
                return False
            return bool(_warned(site, values[0], wanted))
        if op in _BY_TYPE:
            types = event.types[0] if event.types else None
            if types is None:
                return False
            names = {qual.rsplit(".", 1)[-1] for _, qual in types}
            found = any(t in names for t in site.types)
            return found if op != "notisinstance" else not found
        a: Any = values[0]
        b: Any = values[1] if len(values) > 1 else None
        if op == "eq":
            return bool(a == b)
        if op == "seq_eq":
            return type(a) in (list, tuple) and type(b) in (list, tuple) and list(a) == list(b)
        if op == "count_eq":
            return _count_eq(a, b)
        if op == "ne":
            return bool(a != b)
        if op == "lt":
            return bool(a < b)
        if op == "le":
            return bool(a <= b)
        if op == "gt":
            return bool(a > b)
        if op == "ge":
            return bool(a >= b)
        if op == "in":
            return bool(a in b)
        if op == "notin":
            return bool(a not in b)
        if op == "truth":
            return bool(a)
        if op == "not":
            return not a
        if op == "is_none":
            return a is None
        if op == "not_none":
            return a is not None
        if op == "is_const":
            return a is b
        if op == "not_const":
            return a is not b
        if op in ("approx", "not_approx"):
            target = (
                b
                if isinstance(b, Approx)
                else Approx(b, site.extra.get("rel"), site.extra.get("abs"))
            )
            return _approx_ok(a, target) != (op == "not_approx")
        if op in ("almost", "not_almost"):
            if a == b:
                close = True
            elif "delta" in site.extra:
                close = abs(a - b) <= site.extra["delta"]
            else:
                close = round(abs(a - b), site.extra.get("places", 7)) == 0
            return close != (op == "not_almost")
    except (TypeError, ValueError, ArithmeticError, RecursionError, AttributeError):
        return False
    return False


def _checks_message(site: Site) -> bool:
    """Whether a raises or warns site checks its message: one the judge holds (a literal) or
    one the test computes, sent beside the block's outcome (round 39)."""
    return "message" in site.extra or bool(site.extra.get("computed"))


#: Where a raises or warns event carries the message the test computed.
_COMPUTED_AT = {"raises": 2, "warns": 1}


def _wanted_message(site: Site, event: Event) -> Any:
    """The message a raises or warns site checks: the judge's literal, or the one the test
    computed (its operand; pinned to the gold run's in `_event_failure`); else _MISSING."""
    if "message" in site.extra:
        return site.extra["message"]
    at = _COMPUTED_AT.get(site.op)
    if site.extra.get("computed") and at is not None and len(event.values) > at:
        return event.values[at]
    return _MISSING


def _message_meets(site: Site, wanted: Any, said: Any) -> bool:
    """Whether a raised or warned message ``said`` meets the site's check of ``wanted``: a
    part of it (Django's ``…Message``) or a pattern found in it (``…Regex``, ``match=``)."""
    if type(said) is not str or type(wanted) is not str:
        return False
    if site.extra.get("match") == "contains":
        return wanted in said
    return _bounded_search(wanted, said)


def _warned(site: Site, said: Any, message: Any = _MISSING) -> list[tuple[str, str]]:
    """The classes (module, qualname) of the warnings a ``warns`` site's block gave that meet
    it: of a class it names (by the last part, as ``raises``), with ``message`` where the site
    checks one (`operands.warns` sends [class names, message] a warning)."""
    if type(said) is not list:
        return []
    wanted = set(site.types)
    if type(message) is not str:
        message = None
    found = []
    for item in said:
        if type(item) is not list or len(item) != 2 or type(item[1]) is not str:
            continue
        names, text = item
        if type(names) is not list or not names or type(names[0]) is not list:
            continue
        if not any(
            type(n) is list and len(n) == 2 and str(n[1]).rsplit(".", 1)[-1] in wanted
            for n in names
        ):
            continue
        if type(message) is str and not _message_meets(site, message, text):
            continue
        found.append((str(names[0][0]), str(names[0][1])))
    return found


@dataclass(slots=True)
class TestEvents:
    """What one run recorded for one test key."""

    events: list[Event] = field(default_factory=list)
    began: bool = False
    ended: bool = False
    exc: str | None = None


def by_test(records: list[dict[str, Any]], *, paired: bool = True) -> dict[str, TestEvents]:
    """The stream's assertion events grouped by the test they happened in (innermost open).
    A test's end must carry its begin's token (``paired``; off: a control only): an end that
    does not marks the innermost open test as cut short and closes nothing; so does a begin
    under another key while a test is open."""
    out: dict[str, TestEvents] = {}
    stack: list[str] = []
    tokens: list[Any] = []
    budget = Budget()
    calls: dict[str, list[tuple[str, ...]]] = {}  # site -> its watched calls since its "ws"
    last: str | None = None  # the test that ended last, while no test is open
    for record in records:
        kind = record.get("event")
        if kind in ("ws", "w") and stack and isinstance(record.get("site"), str):
            if kind == "ws":
                # One per check: a second before the check's event came (a helper that
                # started the call again to drop what the first one recorded, round 18)
                # leaves a call nobody made.
                calls[record["site"]] = [("?",)] if record["site"] in calls else []
            elif record["site"] in calls and len(calls[record["site"]]) < _MAX_CALLS:
                calls[record["site"]].append(_call(record))
            continue
        if kind == "tb":
            if not (paired and stack):
                # A begin inside an open test (one test's body calling another's) leaves the
                # open checks' calls alone: a begin and end sent around a check (round 27)
                # dropped what the check's callable really did.
                calls.clear()
            key = str(record.get("key", ""))
            if paired and stack and key != stack[-1]:
                # A test's body runs inside no other test's but its own (a test that calls
                # another runs under its own key): a begin under another key while one is open
                # diverts what comes next away from the open test.
                out.setdefault(stack[-1], TestEvents()).exc = "another test began inside it"
            stack.append(key)
            tokens.append(record.get("n"))
            out.setdefault(key, TestEvents()).began = True
        elif kind == "te" and stack:
            if paired and record.get("n") != tokens[-1]:
                out.setdefault(stack[-1], TestEvents()).exc = "an end its begin did not send"
                continue
            tokens.pop()
            key = stack.pop()
            last = None if stack else key
            entry = out.setdefault(key, TestEvents())
            entry.ended = True
            entry.exc = entry.exc or (str(record["exc"]) if record.get("exc") else None)
        elif kind == "a" and stack:
            event = decode(record, budget)
            if event is not None:
                event.calls = calls.pop(event.site, None)
                out.setdefault(stack[-1], TestEvents()).events.append(event)
        elif kind == "a" and paired and last is not None:
            # An assertion's event after every test has ended belongs to the test that ended
            # last: its end came before its own assertions were done (round 28: an end sent
            # from inside the test, with the assertion it was in sent as the gold run's).
            out[last].exc = out[last].exc or "an assertion's event came after the test ended"
    return out


def nonplain_sites(runs: list[dict[str, TestEvents]]) -> set[str]:
    """Sites where an operand did not cross as plain data (for the gold patch)."""
    found = set()
    for run in runs:
        for entry in run.values():
            for event in entry.events:
                if event.ok is None and not all(event.plain):
                    found.add(event.site)
    return found


def unplain_handles(run: dict[str, TestEvents]) -> frozenset[str]:
    """Table handles sent beside an operand that was not plain data."""
    found: set[str] = set()
    for entry in run.values():
        for event in entry.events:
            if event.ok is None and not all(event.plain):
                found.update(k for k in event.keys if k)
    return frozenset(found)


@dataclass(slots=True)
class Gold:
    """What the gold patch's two runs recorded: the expected event sequence and values."""

    runs: list[dict[str, TestEvents]]
    empty: dict[str, TestEvents] | None = None  # the empty patch's run (`decisive`)

    def sequence(self, key: str) -> list[str] | None:
        """The sites in order, when both runs agree (else None: unstable)."""
        seqs = [[e.site for e in run.get(key, TestEvents()).events] for run in self.runs]
        return seqs[0] if all(s == seqs[0] for s in seqs) else None

    def in_process(self, key: str, index: int) -> bool:
        """Whether a gold run judged its ``index``-th event of ``key`` in process."""
        for run in self.runs:
            events = run.get(key, TestEvents()).events
            if index < len(events) and events[index].ok is not None:
                return True
        return False

    def handle(self, key: str, index: int, operand: int) -> str | None:
        """The table handle the gold runs sent at one operand, when they all sent the same."""
        found = set()
        for run in self.runs:
            events = run.get(key, TestEvents()).events
            if index >= len(events) or operand >= len(events[index].keys):
                return None
            found.add(events[index].keys[operand])
        return found.pop() if len(found) == 1 else None

    def types(self, key: str, index: int) -> list[list[str]] | None:
        """The class names the gold runs sent at one event's first operand, when they agree."""
        found = self._agreed(key, index, lambda e: e.types[0] if e.types else None)
        return None if found is _MISSING else found

    def met(self, key: str, index: int, operand: int) -> frozenset[str]:
        """The classes not built in that the gold runs' operand held, in any of them."""
        found: frozenset[str] = frozenset()
        for run in self.runs:
            events = run.get(key, TestEvents()).events
            if index < len(events) and operand < len(events[index].met):
                found |= events[index].met[operand]
        return found

    def calls(self, key: str, index: int) -> list[tuple[str, ...]] | None:
        """What the test's callables did at one event in the gold runs, when they agree."""
        found = self._agreed(key, index, lambda e: e.calls)
        return None if found is _MISSING else found

    def _agreed(self, key: str, index: int, part: Callable[[Event], Any]) -> Any:
        """``part`` of the gold runs' ``index``-th event of ``key``, when every run has one and
        they agree; else _MISSING."""
        found = []
        for run in self.runs:
            events = run.get(key, TestEvents()).events
            if index >= len(events):
                return _MISSING
            found.append(part(events[index]))
        return found[0] if all(f == found[0] for f in found) else _MISSING

    def value(self, key: str, index: int, operand: int) -> Any:
        """The gold runs' value of one operand, when they agree and it is plain; else _MISSING."""
        found = []
        for run in self.runs:
            events = run.get(key, TestEvents()).events
            if index >= len(events) or operand >= len(events[index].values):
                return _MISSING
            found.append(events[index].values[operand])
        first = found[0]
        if first is _MISSING or any(
            v is _MISSING or type(v) is not type(first) or v != first for v in found
        ):
            return _MISSING
        return first


@dataclass(slots=True)
class Judgement:
    outcome: str  # passed | failed | unverified | mismatch | missing | raised
    events: int = 0
    judged_out: int = 0  # events judged here, on plain data
    judged_in: int = 0
    detail: str = ""
    handles: list[str] = field(default_factory=list)  # table handles of the failed event


def judge_test(
    key: str,
    run: dict[str, TestEvents],
    plan: Plan,
    gold: Gold,
    covered: bool,
    *,
    own_verdicts: bool = False,
    pin_in: bool = True,
    pin_calls: bool = True,
    pin_classes: bool = True,
) -> Judgement:
    """One test's events against the gold record. ``own_verdicts``, ``pin_in``, ``pin_calls``,
    ``pin_classes`` off: controls only (the judged process's own verdict taken at any site; a
    membership's container not pinned to the gold run's; what a test's callables did not
    pinned; an operand's classes not built in not pinned)."""
    entry = run.get(key)
    if entry is None or not entry.began:
        return Judgement("missing", detail="the test's body never ran")
    if not entry.ended or entry.exc:
        return Judgement("raised", detail=f"the test's body raised {entry.exc or '(no end)'}")
    verdict = Judgement("passed", events=len(entry.events))
    expected = gold.sequence(key)
    got = [e.site for e in entry.events]
    if expected is not None and got != expected:
        return Judgement(
            "mismatch",
            events=len(got),
            detail=f"{len(got)} assertion event(s) where the gold run had {len(expected)}"
            if len(got) != len(expected)
            else "the assertions ran in another order than in the gold run",
        )
    if expected is None and not got and covered:
        return Judgement("mismatch", detail="no assertion ran")
    for index, event in enumerate(entry.events):
        failed = _event_failure(
            key,
            index,
            event,
            plan,
            gold,
            own_verdicts=own_verdicts,
            pin_in=pin_in,
            pin_calls=pin_calls,
            pin_classes=pin_classes,
        )
        if isinstance(failed, Judgement):
            return failed
        if failed:
            verdict.judged_out += 1
        else:
            verdict.judged_in += 1
    return verdict


def _event_failure(
    key: str,
    index: int,
    event: Event,
    plan: Plan,
    gold: Gold,
    *,
    own_verdicts: bool = False,
    pin_in: bool = True,
    pin_calls: bool = True,
    pin_classes: bool = True,
) -> Judgement | bool:
    """One event judged against its site and the gold record: the failure, or whether it was
    judged out of process (True) or in process (False). A computed operand of an equality, the
    computed container of a membership and a raised message checked for a text must equal the
    gold run's (where its two runs agree): a superset meets ``member in container`` without the
    member's being known (round 9: the input with one character stripped contained the sentence
    a test looked for; round 13: a message joining the format at every count)."""
    expected = gold.sequence(key)
    site = plan.sites.get(event.site)
    if site is None:
        return Judgement(
            "failed", detail=f"an assertion event from an unknown site {event.site[:80]}"
        )
    pinned_calls = gold.calls(key, index) if expected is not None and pin_calls else None
    if pinned_calls is not None and not _calls_match(event.calls, pinned_calls):
        return Judgement(
            "failed", detail=f"{site.id}: the test's callable did not do what it did for gold"
        )
    if event.ok is not None or site.mode == "inproc":
        # A verdict the judged process made itself counts only where the plan asked for one
        # (an in-process site) or, at a site of the judge's, where the gold run's operands at
        # this very event were not plain data either.
        if (
            site.mode == "judge"
            and not own_verdicts
            and not (event.adaptive and gold.in_process(key, index))
        ):
            return Judgement("failed", detail=f"{site.id}: no plain data where the gold run's was")
        if site.mode == "inproc" and event.ok is None:
            return Judgement("failed", detail=f"{site.id}: operands sent for an in-process site")
        if event.ok is not True:
            return Judgement("failed", detail=f"{site.id}: failed (judged in process)")
        return False
    # A raises or warns event: the block's outcome (raises: the class, then the message), and
    # the message the test computed where it computes one.
    if site.op in _COMPUTED_AT:
        fits = _COMPUTED_AT[site.op] + bool(site.extra.get("computed"))
    else:
        fits = len(site.held)
    if len(event.values) != fits:
        return Judgement("failed", detail=f"{site.id}: the event's operands do not fit the site")
    values: list[Any] = []
    for i, ((is_held, held_value), value, was_plain) in enumerate(
        zip(site.held, event.values[: len(site.held)], event.plain[: len(site.held)], strict=True)
    ):
        handle = event.keys[i] if i < len(event.keys) else None
        if is_held:
            if not event.held[i] or handle is not None:
                return Judgement("failed", detail=f"{site.id}: a held operand was not left out")
            values.append(held_value)
            continue
        # A table's handle stands exactly where the gold run's stood, or nowhere.
        expected_handle = gold.handle(key, index, i) if expected is not None else None
        if handle != expected_handle or (handle is not None and handle not in plan.held):
            return Judgement("failed", detail=f"{site.id}: a held value out of its place")
        if handle is not None:
            values.append(plan.held[handle])
            continue
        if event.held[i]:
            return Judgement("failed", detail=f"{site.id}: a held operand out of its place")
        if site.op not in _BY_TYPE | _BY_ID and not was_plain:
            return Judgement(
                "failed",
                detail=f"{site.id}: an operand is not plain data",
                handles=[k for k in event.keys if k],
            )
        # An object of a class not built in is judged on its base type's data: the class is
        # the gold run's here, or its methods may show what the data is not (round 89: an int
        # equal to the area, printed and added as the bug's sum).
        met = event.met[i] if i < len(event.met) else frozenset()
        if expected is not None and pin_classes and site.op not in _BY_TYPE | _BY_ID:
            extra = met - gold.met(key, index, i)
            if extra:
                return Judgement(
                    "failed",
                    detail=f"{site.id}: an operand held a {sorted(extra)[0][:80]}, where the "
                    "gold run's held none",
                )
        if expected is not None and (site.op in _EQ or (site.op == "in" and i == 1 and pin_in)):
            pinned = gold.value(key, index, i)
            if pinned is not _MISSING and not _equal(value, pinned):
                return Judgement("failed", detail=f"{site.id}: differs from the gold run's value")
        values.append(value)
    if expected is not None and pin_in and site.op == "raises" and _checks_message(site):
        pinned = gold.value(key, index, 1)
        said = event.values[1] if len(event.values) > 1 else _MISSING
        if pinned is not _MISSING and not _equal(said, pinned):
            return Judgement("failed", detail=f"{site.id}: the message differs from the gold run's")
    if expected is not None and site.extra.get("computed") and site.op in _COMPUTED_AT:
        # The message the test computed is the gold run's: a computed expected value.
        at = _COMPUTED_AT[site.op]
        pinned = gold.value(key, index, at)
        if pinned is not _MISSING and not _equal(_wanted_message(site, event), pinned):
            return Judgement(
                "failed", detail=f"{site.id}: the expected message differs from the gold run's"
            )
    if expected is not None and pin_in and site.op in _BY_TYPE:
        # The class a type check matched is the one the gold run's matched: a class of the
        # patch's own that merely bears the name (``class IndexError(Exception)``) does not
        # stand in for the built-in one (round 17).
        wanted = {t.rsplit(".", 1)[-1] for t in site.types}
        theirs = gold.types(key, index)
        got = event.types[0] if event.types else None
        if theirs is not None and got is not None:
            gold_matched = {tuple(n) for n in theirs if n[1].rsplit(".", 1)[-1] in wanted}
            if any(tuple(n) not in gold_matched for n in got if n[1].rsplit(".", 1)[-1] in wanted):
                return Judgement(
                    "failed", detail=f"{site.id}: another class than the gold run's of that name"
                )
    if expected is not None and pin_in and site.op == "warns":
        # The warning that met it is of a class the gold run's block gave, not a namesake.
        pinned = gold.value(key, index, 0)
        wanted = _wanted_message(site, event)
        if pinned is not _MISSING and not set(_warned(site, values[0], wanted)) <= set(
            _warned(site, pinned, wanted)
        ):
            return Judgement(
                "failed", detail=f"{site.id}: another warning class than the gold run's"
            )
    if not holds(site, values, event):
        return Judgement("failed", detail=f"{site.id}: {site.op} does not hold")
    return site.counted


def _calls_match(got: list[tuple[str, ...]] | None, gold: list[tuple[str, ...]]) -> bool:
    """Each call of the test's callables returned where the gold run's returned, and raised
    where it raised, an instance of the class it raised (`operands.watch_call`)."""
    if got is None or len(got) != len(gold):
        return False
    return all(
        g == w if w == ("n",) else (g[:1] == ("r",) and len(w) > 1 and w[1] in g[1:])
        for g, w in zip(got, gold, strict=True)
    )


#: Comparisons whose expected side cannot be met without knowing it: an equality, membership,
#: closeness, a raised message. An inequality, truth, ``None``, identity or a class name can be
#: met by a guess.
_SECRET_OPS = {"eq", "seq_eq", "count_eq", "in", "approx", "almost"}


def guessable(value: Any) -> bool:
    """Whether an expected value can be met by a guess: a bool, None, 0 or ±1, an empty text,
    or a container of nothing but such values (whose pattern flipping the bug's answers
    may give)."""
    if isinstance(value, Approx):
        return guessable(value.expected)
    if value is None or type(value) is bool:
        return True
    if type(value) in (int, float):
        return value in (0, 1, -1)
    if type(value) in (str, bytes):
        return len(value) == 0
    if type(value) in (list, tuple, set, frozenset):
        return all(guessable(v) for v in value)
    if type(value) is dict:
        return all(guessable(k) and guessable(v) for k, v in value.items())
    return False


def decisive(key: str, plan: Plan, gold: Gold) -> list[int]:
    """The indices of ``key``'s gold events that the empty patch's run does not reproduce: not
    reached there, another site there, or failing there. These are what a fix must change."""
    if gold.empty is None or not gold.runs:
        return []
    wanted = gold.runs[-1].get(key, TestEvents()).events
    got = gold.empty.get(key, TestEvents()).events
    out = []
    diverged = False
    for index, event in enumerate(wanted):
        if not diverged and index < len(got) and got[index].site == event.site:
            if not isinstance(_event_failure(key, index, got[index], plan, gold), Judgement):
                continue  # reproduced without the fix
        else:
            diverged = True
        out.append(index)
    return out


def _unknown(held: Any, without_fix: Any, public: str) -> bool:
    """Whether meeting ``held`` needs something the agent was never shown. Of a table, what
    the run without the fix (``without_fix``, its value at that operand, or _MISSING) gets
    wrong: one of those items neither guessable nor in the statement, or the pattern of at
    least two wrong items among right ones (a fix special-casing the statement's one example
    changes one; flipping every answer breaks the right ones)."""
    tables = type(held) in (list, tuple) and type(without_fix) in (list, tuple)
    if tables and len(held) == len(without_fix):
        pairs = list(zip(held, without_fix, strict=True))
        wrong = [h for h, w in pairs if not _equal(h, w)]
        if any(not guessable(h) and not published(h, public) for h in wrong):
            return True
        # Every wrong answer is known; a fix that maps the unfixed answers to them (the
        # statement's Actual to its Expected) meets the table when the unfixed answer alone
        # decides the right one (round 14).
        decided = _decides(pairs)
        return not decided and 2 <= len(wrong) < len(held)
    if type(held) in _COLLECTIONS and type(without_fix) in _COLLECTIONS:
        # A collection the unfixed run answers with another number of items, or a set (a
        # filter, ``[a for a in xs if f(a)]``): the items in one and not the other are the
        # wrong answers, and one of them must be unknown; special-casing the statement's
        # examples changes exactly those (round 15).
        return any(not guessable(v) and not published(v, public) for v in _apart(held, without_fix))
    return not guessable(held) and not published(held, public)


def _decides(pairs: list[tuple[Any, Any]]) -> bool:
    """Whether the unfixed answer (each pair's second) alone decides the right one (its
    first): unfixed answers of one type and value always have right ones the test's own ``==``
    takes for each other (a map may tell ``0`` from ``0.0``, and need not tell the right
    answers ``0`` and ``0.0`` apart: stop 53, a table whose right answers differed only so).
    By hash where the answers have one (a gold table can be long), else pair by pair."""
    try:
        first: dict[Any, Any] = {}
        for held, unfixed in pairs:
            seen = first.setdefault((type(unfixed), unfixed), held)
            if not _equal(seen, held):
                return False
        return True
    except TypeError:  # an unhashable answer
        return all(
            _equal(h1, h2)
            for (h1, w1), (h2, w2) in itertools.combinations(pairs, 2)
            if _same(w1, w2)
        )


_COLLECTIONS = (list, tuple, set, frozenset)


def _apart(a: Any, b: Any) -> list[Any]:
    """The items of ``a`` and ``b`` (lists, tuples or sets) that the other lacks, counted as
    multisets under `_same` (by hash where the items have one: the gold record's tables can
    be long)."""
    try:
        counts = collections.Counter((type(v), v) for v in b)
        only_a = []
        for item in a:
            key = (type(item), item)
            if counts[key] > 0:
                counts[key] -= 1
            else:
                only_a.append(item)
        return only_a + [v for (_, v), n in counts.items() for _ in range(n)]
    except TypeError:  # an unhashable item
        pass
    rest = list(b)
    only_a = []
    for item in a:
        match = next((i for i, other in enumerate(rest) if _same(item, other)), None)
        if match is None:
            only_a.append(item)
        else:
            del rest[match]
    return only_a + rest


def _equal(a: Any, b: Any) -> bool:
    """Equal as the test's own ``==`` finds plain data: a candidate's value meets the gold
    run's where the test would take one for the other (round 79: ``4`` where the gold fix
    returns ``4.0`` is what ``assert median(xs) == 4`` accepts). Both sides are rebuilt plain
    data, so no method of the judged code's runs here."""
    return bool(a == b)


def _same(a: Any, b: Any) -> bool:
    """Equal as the judge compares plain data: of one type, and equal."""
    return type(a) is type(b) and bool(a == b)


def secret_bearing(key: str, index: int, plan: Plan, gold: Gold, public: str = "") -> bool:
    """Whether the gold run's ``index``-th event of ``key`` is judged here against an expected
    value the judged process never holds and the agent can neither guess nor read in
    ``public``, the task's statement (a fix that special-cases the statement's example must
    not meet it). Of a table, what counts is what the run without the fix gets wrong."""
    if not gold.runs or gold.in_process(key, index):
        return False
    events = gold.runs[-1].get(key, TestEvents()).events
    if index >= len(events):
        return False
    site = plan.sites.get(events[index].site)
    if site is None or site.mode != "judge" or not site.counted:
        return False
    if site.op == "raises":
        message = site.extra.get("message")
        if type(message) is not str or guessable(message) or published(message, public):
            return False
        # A pattern (``match=``) is met by messages nobody was shown: only a plain text is one.
        return site.extra.get("match") == "contains" or not any(c in _REGEX for c in message)
    if site.op not in _SECRET_OPS:
        return False
    unfixed = gold.empty.get(key, TestEvents()).events if gold.empty is not None else []
    there = unfixed[index] if index < len(unfixed) else None
    if there is not None and there.site != events[index].site:
        there = None

    def without_fix(held_at: int) -> Any:  # the unfixed run's computed side of the event
        if there is None or there.ok is not None:
            return _MISSING
        sides = [v for i, v in enumerate(there.values) if i != held_at and v is not _MISSING]
        return sides[0] if len(sides) == 1 else _MISSING

    for operand, (is_held, value) in enumerate(site.held):
        # A held container is met by any one of its members (a text by any part of it): a
        # secret only when every member is (round 11, from the code).
        if (
            is_held
            and site.op == "in"
            and operand == 1
            and not _every_member_unknown(value, public)
        ):
            continue
        if is_held and _unknown(value, without_fix(operand), public):
            return not _near_known(site, value, public)
        handle = gold.handle(key, index, operand)
        if (
            not is_held
            and handle is not None
            and handle in plan.held
            and _unknown(plan.held[handle], without_fix(operand), public)
        ):
            return not _near_known(site, plan.held[handle], public)
    return False


#: Characters that make a ``match=`` pattern match more than its own text.
_REGEX = frozenset(".^$*+?{}[]|()\\")


def _every_member_unknown(container: Any, public: str) -> bool:
    """Whether no member of a held container can be guessed or read in the statement (a text
    container never: its every part, the empty text too, is a member)."""
    if type(container) in (list, tuple, set, frozenset, dict) and container:
        return all(not guessable(v) and not published(v, public) for v in container)
    return False


#: The numbers a guess gives (``guessable``), tried against a closeness's tolerance.
_GUESSES = (0, 1, -1)


def _near_known(site: Site, held: Any, public: str) -> bool:
    """Whether a number the statement shows, or a guess, meets a closeness check against
    ``held`` (round 10: the statement showed 1331.0000000000005 and the test checked
    ``approx(1331)``; round 13: 0 meets ``approx(0.3, abs=0.5)`` and ``approx(1e-13)``)."""
    if site.op not in ("approx", "almost") or len(site.held) != 2:
        return False
    # As ``holds`` compares them: the computed side first, whichever side the held one is.
    probe = Event(site.id, [], [], [])
    known = [*_GUESSES, *shown_numbers(public)]
    return any(holds(site, [seen, held], probe) for seen in known)


def covered_tests(
    plan: Plan,
    gold: Gold,
    fail_to_pass: set[str] | frozenset[str],
    *,
    secrets: bool = True,
    public: str = "",
) -> dict[str, bool]:
    """Required test -> covered. Its function must be in the pristine source. A
    ``FAIL_TO_PASS`` test is covered when one of its decisive events (`decisive`) is judged here
    against a secret (`secret_bearing`; ``public``: the task's statement, which no secret is
    shown in); a ``PASS_TO_PASS`` test, and any test with
    ``secrets`` off (a control), when at least one of its gold run's assertions is judged here.
    A verdict the judged process makes itself can fail a test, never carry one."""
    out = {}
    for test, found in plan.found.items():
        key = plan.keys.get(test)
        ok = False
        if found and key is not None and gold.runs:
            if secrets and test in fail_to_pass:
                ok = any(
                    secret_bearing(key, i, plan, gold, public) for i in decisive(key, plan, gold)
                )
            else:
                events = gold.runs[-1].get(key, TestEvents()).events
                ok = any(
                    e.ok is None
                    and plan.sites.get(e.site) is not None
                    and plan.sites[e.site].counted
                    and plan.sites[e.site].mode == "judge"
                    for e in events
                )
        out[test] = ok
    return out
