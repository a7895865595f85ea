"""What a task's statement shows the agent. No value it shows is a secret
(`assertions.secret_bearing`): a fix that special-cases the statement's example keeps the bug and
still meets every check against a value the statement gives away.

    published(15, task.problem_statement)      # True: the statement shows 15, however spelled

A value is shown whatever its spelling, so the statement is read for its values, not matched
against their ``repr``: a set in another order, a text in other quotes, with escapes or split
over lines, ``list('BD')`` for ``['B', 'D']``, a list broken over lines, ``0xF`` for 15. Every
fragment of the statement that parses as Python (a fenced or inline code block, one of its lines,
a bracketed span; doctest prompts dropped) is walked, and every expression in it that the judge
would hold as a literal (`rewrite.literal`, the same reading the judge gives a test's operands) is
a value shown, with the items of every container shown. Strings and numbers in fragments that do
not parse are read token by token, adjacent strings joined; arithmetic on shown numbers
(``2**10``, ``1/2``) and ``dict(a=1)`` are values too. Prose counts as well: a value's ``repr``,
a text's own characters standing as a word of their own, and any number as prose writes it
(``3.50``, ``$12.00``, ``.25``, ``1,500``, a Unicode minus, ``1e21``).

The statement is the task's, not the agent's, and is read once per task (cached).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import textwrap
import tokenize
from typing import Any

from legorl.verify.rewrite import Approx, _NotLiteral, literal

#: What of a statement is read (its first characters), and how many values it may show.
TEXT = 256 << 10
VALUES = 200_000
#: The longest bracketed span parsed on its own.
SPAN = 1 << 16

_APPROX = {"approx", "pytest.approx"}
#: A number as prose writes it: thousands separated or not, a leading dot, an exponent, a
#: hyphen or Unicode minus before it (a part of a date or a code, ``02``, is no number).
_PROSE_NUMBER = re.compile(
    r"(?<![\w.])([-\u2212]?)([1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|(?:0|[1-9]\d*)(?:\.\d+)?|\.\d+)"
    r"([eE][-+]?\d{1,3})?(?![\w]|\.\d)"
)
#: Arithmetic the statement's code may show a number by, beyond what the judge reads as a
#: literal (+, -, *): bounded, so that no statement makes the reader compute for long.
_ARITHMETIC = (ast.Pow, ast.Div, ast.FloorDiv, ast.Mod)
_POWER = 64
_FENCED = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_PROMPT = re.compile(r"^[ \t]*(?:>>>|\.\.\.)(?: |$)", re.M)
_PAIRS = {")": "(", "]": "[", "}": "{"}


def published(value: Any, public: str) -> bool:
    """Whether ``public`` (the statement the agent was given) shows ``value``: in prose, or as
    a value any fragment of its code spells (see the module's docstring)."""
    if isinstance(value, Approx):
        value = value.expected
    if not public:
        return False
    if _in_prose(value, public):
        return True
    if type(value) in (int, float) and value in _prose_numbers(public):
        return True
    try:
        return any(_same(value, seen) for seen in _shown(public))
    except RecursionError:
        return True  # a value too deep to compare is not one the judge counts as secret


def shown_numbers(public: str) -> list[Any]:
    """The numbers (and lists of them) ``public`` shows, for checks that a near value meets
    (``approx``, ``assertAlmostEqual``): a shown 1331.0000000000005 meets ``approx(1331)``."""
    if not public:
        return []
    return [v for v in _shown(public) if _numeric(v, 0)] + list(_prose_numbers(public))


def _numeric(value: Any, depth: int) -> bool:
    """A number, or a non-empty list, tuple or dict of numeric values (what approx compares)."""
    if type(value) in (int, float):
        return True
    if depth >= 4 or not value:
        return False
    if type(value) in (list, tuple):
        return all(_numeric(x, depth + 1) for x in value)
    if type(value) is dict:
        return all(_numeric(x, depth + 1) for x in value.values())
    return False


@functools.lru_cache(maxsize=64)
def _prose_numbers(public: str) -> frozenset[float]:
    """Every number ``public`` writes as prose does (see ``_PROSE_NUMBER``)."""
    out = set()
    for sign, digits, exponent in _PROSE_NUMBER.findall(public[:TEXT]):
        try:
            number = float(digits.replace(",", "") + exponent)
        except (ValueError, OverflowError):
            continue
        out.add(-number if sign else number)
    return frozenset(out)


def _in_prose(value: Any, public: str) -> bool:
    forms = {repr(value)}
    if type(value) is str:
        forms.add(value)
    elif type(value) is float and value.is_integer():
        forms.add(str(int(value)))
    for form in forms:
        if not form:
            continue
        lead = r"(?<![\w.])" if form[0].isalnum() or form[0] == "_" else ""
        tail = r"(?![\w]|\.\d)" if form[-1].isalnum() or form[-1] == "_" else ""
        if re.search(lead + re.escape(form) + tail, public):
            return True
    return False


_NUMBERS = (int, float, complex)
_SEQUENCES = (list, tuple)
_SETS = (set, frozenset)


def _same(a: Any, b: Any) -> bool:
    """Whether a fix could return ``a`` by copying ``b``: equal values, a list for a tuple."""
    if type(a) in _NUMBERS and type(b) in _NUMBERS:
        return bool(a == b)
    if type(a) in _SEQUENCES and type(b) in _SEQUENCES:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) in _SETS and type(b) in _SETS:
        return bool(a == b)
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


@functools.lru_cache(maxsize=64)
def _shown(public: str) -> tuple[Any, ...]:
    """Every value ``public`` shows in code, with the items of the containers it shows."""
    text = _PROMPT.sub("", public[:TEXT])
    found: list[Any] = []
    blocks = [m.group(2) for m in _FENCED.finditer(text)] + _INLINE.findall(text)
    for block in blocks:
        if not _walk(textwrap.dedent(block), found):
            for line in block.splitlines():
                if not _walk(line.strip(), found):
                    _tokens(line, found)
            _tokens(block, found)
    for span in _spans(text):
        _walk(span, found)
    out: list[Any] = []
    for value in found:
        _flatten(value, out, 0)
        if len(out) >= VALUES:
            break
    return tuple(out[:VALUES])


def _walk(source: str, found: list[Any]) -> bool:
    """The literals of ``source`` into ``found``; False when it does not parse."""
    if not source.strip():
        return True
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.expr) and not isinstance(node, ast.Name):
            try:
                found.append(literal(node, frozenset(), _APPROX))
            except (_NotLiteral, RecursionError, MemoryError, OverflowError):
                try:
                    found.append(_beyond_literal(node))
                except (_NotLiteral, RecursionError, MemoryError, OverflowError):
                    continue
    return True


def _beyond_literal(node: ast.expr) -> Any:
    """What the statement's code shows beyond the judge's literals: arithmetic on numbers
    (bounded powers) and ``dict`` of keywords; ``_NotLiteral`` otherwise."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC):
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > _POWER or abs(left) > 1 << _POWER:
                raise _NotLiteral
            return left**right
        try:
            if isinstance(node.op, ast.Div):
                return left / right
            return left // right if isinstance(node.op, ast.FloorDiv) else left % right
        except ZeroDivisionError:
            raise _NotLiteral from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        if node.args or any(k.arg is None for k in node.keywords):
            raise _NotLiteral
        return {k.arg: literal(k.value, frozenset(), _APPROX) for k in node.keywords}
    raise _NotLiteral


def _number(node: ast.expr) -> int | float:
    try:
        value = literal(node, frozenset(), _APPROX)
    except _NotLiteral:
        value = _beyond_literal(node)
    if type(value) not in (int, float):
        raise _NotLiteral
    return value


def _spans(text: str) -> list[str]:
    """Every bracketed span of ``text`` whose brackets match, outermost last."""
    stack: list[tuple[str, int]] = []
    out = []
    for i, ch in enumerate(text):
        if ch in "([{":
            stack.append((ch, i))
        elif ch in _PAIRS:
            while stack and stack[-1][0] != _PAIRS[ch]:
                stack.pop()  # an unmatched opener (prose) is passed over
            if stack:
                _, start = stack.pop()
                if i - start <= SPAN:
                    out.append(text[start : i + 1])
    return out


def _tokens(source: str, found: list[Any]) -> None:
    """Strings (adjacent ones joined) and numbers of ``source`` read token by token, up to
    where it stops tokenising."""
    joined: Any = None  # the strings read so far with nothing else between them
    minus = False
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING:
                try:
                    value = ast.literal_eval(tok.string)
                except (SyntaxError, ValueError, MemoryError, RecursionError):
                    continue
                found.append(value)
                if joined is not None and type(joined) is type(value):
                    joined += value
                    found.append(joined)
                else:
                    joined = value
                continue
            if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                continue
            joined = None
            if tok.type == tokenize.NUMBER:
                try:
                    number = ast.literal_eval(tok.string)
                except (SyntaxError, ValueError):
                    continue
                found.append(-number if minus else number)
                found.append(number)
            minus = tok.type == tokenize.OP and tok.string == "-"
    except (tokenize.TokenError, SyntaxError, IndentationError, ValueError):
        return


def _flatten(value: Any, out: list[Any], depth: int) -> None:
    if isinstance(value, Approx):
        value = value.expected
    out.append(value)
    if depth >= 8 or len(out) >= VALUES:
        return
    if type(value) in (list, tuple, set, frozenset):
        for item in value:
            _flatten(item, out, depth + 1)
    elif type(value) is dict:
        for k, v in value.items():
            _flatten(k, out, depth + 1)
            _flatten(v, out, depth + 1)
