"""Every JSONL record legorl reads or writes, and the one reader and the one writer for them.

Records are typed dataclasses tagged with a versioned ``schema`` (``"legorl/turn@1"``). Stages
exchange them as JSON Lines: ``read_jsonl`` validates each line (known schema, required fields,
field types, cross-field invariants) and names ``file:line`` and the field in every error;
``JsonlWriter`` appends one whole line per record and flushes, so a killed writer leaves at most
one truncated last line, which the reader reports as such.

    from legorl.records import Turn, read_jsonl
    for turn in read_jsonl("runs/sess-1.jsonl", Turn):
        ...

Token storage is linear: a Turn keeps only the prompt tokens that are new to its segment
(``prompt_delta``) plus the offset they start at; ``segment_prompts`` rebuilds full prompts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import orjson

# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

Api = Literal["openai_chat", "anthropic", "responses", "gemini"]
Status = Literal[
    "ok",
    "agent_error",
    "timeout",
    "truncated",
    "harness_error",
    "harness_crash",
    "sandbox_error",
    "proxy_error",
]

#: Statuses caused by the environment, not by the agent: masked from training, never scored 0.
#: ``truncated`` is the policy's: its episode outgrew a budget or the model's context; the
#: proxy's record of the session says so (``evidence["truncated"]`` names which) and align's
#: truncation rule decides what training makes of it. ``harness_error`` is the policy's too: the
#: harness claimed an environment failure that the proxy's record of the session does not back
#: (``evidence["uncorroborated"]`` says why), so it is graded and trained like any failure.
ENVIRONMENT_FAILURES: frozenset[str] = frozenset({"harness_crash", "sandbox_error", "proxy_error"})


class Record:
    """Base of all records: a class-level ``SCHEMA`` tag and a hook for cross-field checks."""

    __slots__ = ()
    SCHEMA: ClassVar[str]

    def check(self) -> None:
        """Raise ``FieldError`` when fields disagree with each other (types are checked already)."""


class FieldError(ValueError):
    """A record field is wrong; the reader adds the file and line."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.message = message


@dataclass(slots=True, kw_only=True)
class EnvRecipe:
    """How to build a task's environment layer when no prebuilt image is named."""

    python: str = "3.11"
    packages: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Task(Record):
    """One SWE-bench instance plus how to build its environment and run its tests."""

    SCHEMA: ClassVar[str] = "legorl/task@1"
    schema: str = SCHEMA
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    version: str
    environment_setup_commit: str
    patch: str = ""  # gold patch, when known; never shown to the agent
    hints_text: str = ""
    created_at: str = ""
    image: str | None = None  # prebuilt image; otherwise `env` is built on a base layer
    env: EnvRecipe | None = None
    test_cmd: str = "python -m pytest -rA -p no:cacheprovider"
    log_parser: str = "pytest"
    source: str | None = None  # git bundle or URL of the repository, relative to the task file
    split: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    #: Required tests none of whose assertions can be judged out of process (the judge
    #: cannot rewrite them); graded on their in-process outcome alone, flagged.
    uncoverable: list[str] = field(default_factory=list)

    def check(self) -> None:
        if not self.FAIL_TO_PASS:
            raise FieldError("FAIL_TO_PASS", "must name at least one test")


@dataclass(slots=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text as the model emitted it, not re-printed


@dataclass(slots=True, kw_only=True)
class TurnOutput:
    """The completion parsed into what the harness saw."""

    text: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class TurnFlags:
    aux: bool = False  # auxiliary sub-session (title call, sub-agent): not trained by default
    realigned: int = 0  # earlier assistant messages replaced by their raw sampled tokens
    malformed_tool_call: bool = False


@dataclass(slots=True, kw_only=True)
class Failover:
    """A call whose replica failed while serving it, and was retried on another one.

    The recorded completion is what the client received: ``completion_ids[:resumed_at]`` came
    from the failed replica before it failed (a streamed call, whose tokens had already gone
    out), the rest from ``Turn.replica``, which prefilled the whole prompt (and those tokens)
    again: ``reprefilled_tokens``. Every token's log-prob is from the replica that sampled it,
    under the same policy version."""

    failed: list[str]  # the replicas that failed, in order
    reprefilled_tokens: int = 0
    resumed_at: int = 0
    stalled_s: float = 0.0  # from the failed replica's last token (or the call's start) to the next


@dataclass(slots=True, kw_only=True)
class RoutingRef:
    """Where a Turn's MoE routing lives (``legorl.routing``): ``rows`` rows from row ``row`` of
    the sidecar ``file`` (relative to the Turn file's folder), one per token position the call
    computed, starting at position ``start`` of its prompt + completion (positions before it
    were served from the engine's prefix cache); ``sha256`` of exactly those rows' bytes."""

    file: str
    row: int
    rows: int
    start: int
    sha256: str


@dataclass(slots=True, kw_only=True)
class RoutingSpan:
    """Part of a recorded routing chunk placed in a Sample: rows ``skip .. skip + count`` of
    the chunk (``file``, ``row``, ``rows``, ``sha256`` as in the Turn's ``RoutingRef``, the
    file as align found it) give positions ``at .. at + count`` of the Sample's input_ids."""

    file: str
    row: int
    rows: int
    sha256: str
    skip: int
    count: int
    at: int


@dataclass(slots=True, kw_only=True)
class Turn(Record):
    """One LLM call captured by the proxy.

    The full prompt is ``segment_tokens[:prompt_offset] + prompt_delta`` where ``segment_tokens``
    is every earlier prompt delta and completion of the same session segment, in order.
    """

    SCHEMA: ClassVar[str] = "legorl/turn@1"
    schema: str = SCHEMA
    session: str
    turn: int  # 0-based index of the call within the session
    segment: int  # 0-based; a new segment starts when history stops being an extension
    segment_reason: str | None = None  # why this turn opened a segment ("start", "compaction", …)
    api: Api
    model: str  # the served model
    requested_model: str = ""  # what the harness asked for
    policy_version: int = 0
    # the LoRA adapter that sampled it (by the name the engine loaded it under, "policy" for the
    # policy's own) and that adapter's version; None: the engine's full weights
    adapter: str | None = None
    adapter_version: int | None = None
    temperature: float = 1.0  # the sampling temperature the log-probs are taken at
    requested_max_tokens: int | None = None  # what the harness asked for (None: it named none)
    max_tokens: int | None = None  # the limit sampled under, after the proxy's caps
    prompt_offset: int  # tokens of the segment that precede prompt_delta
    prompt_delta: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    output: TurnOutput = field(default_factory=TurnOutput)
    flags: TurnFlags = field(default_factory=TurnFlags)
    parent_session: str | None = None  # for aux sub-sessions
    timings: dict[str, float] = field(default_factory=dict)
    time: float = 0.0  # unix seconds when the call arrived
    # the engine replica that sampled the completion (its URL), when the engine has replicas
    replica: str | None = None
    failover: Failover | None = None  # set when the call was retried on another replica
    routing: RoutingRef | None = None  # MoE experts chosen per computed token (legorl.routing)

    def check(self) -> None:
        if self.turn < 0 or self.segment < 0 or self.prompt_offset < 0:
            raise FieldError("turn", "turn, segment and prompt_offset must be >= 0")
        if len(self.completion_logprobs) != len(self.completion_ids):
            raise FieldError(
                "completion_logprobs",
                f"has {len(self.completion_logprobs)} values for "
                f"{len(self.completion_ids)} completion_ids",
            )
        r = self.routing
        if r is not None:
            total = self.prompt_len + len(self.completion_ids)
            if min(r.row, r.rows, r.start) < 0 or r.start + r.rows > total:
                raise FieldError(
                    "routing",
                    f"rows {r.start}..{r.start + r.rows} do not fit the call's {total} tokens",
                )

    @property
    def prompt_len(self) -> int:
        return self.prompt_offset + len(self.prompt_delta)


@dataclass(slots=True, kw_only=True)
class TokenCounts:
    prompt: int = 0
    completion: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionReport:
    """What the proxy itself saw of one session, returned when it closes (by
    ``ProxyCore.close_session``, and as ``report`` in a ``DELETE /admin/sessions/{id}`` answer).

    ``completions`` counts the calls whose sampled tokens began to reach the client (the
    policy's output, which the agent may have acted on); ``engine_failures`` the engine's own
    failures the session was answered with (the latest few); ``failed_last`` says one of them
    came after the last completion began, so the policy cannot have acted since."""

    truncated: str | None = None  # a ``Budget`` field name or ``CONTEXT_OVERFLOW``
    completions: int = 0
    engine_failures: list[str] = field(default_factory=list)
    failed_last: bool = False


@dataclass(slots=True, kw_only=True)
class Trajectory(Record):
    """One harness run on one task; verify fills ``reward``, ``verdict`` and ``hack_flags``."""

    SCHEMA: ClassVar[str] = "legorl/trajectory@1"
    schema: str = SCHEMA
    trajectory_id: str
    task_id: str
    group_id: str
    sample_index: int
    harness: str
    status: Status
    patch: str = ""
    turns: list[Turn] | None = None  # inline, or
    turns_ref: list[str] | None = None  # turn files, relative to the trajectory file
    evidence: dict[str, Any] = field(default_factory=dict)  # exit code, last log lines
    timings: dict[str, float] = field(default_factory=dict)
    tokens: TokenCounts = field(default_factory=TokenCounts)
    reward: float | None = None
    verdict: dict[str, Any] | None = None
    hack_flags: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.status in ENVIRONMENT_FAILURES and self.reward is not None:
            raise FieldError(
                "reward", f"must be null for environment failure status {self.status!r}"
            )


@dataclass(slots=True, kw_only=True)
class Sample(Record):
    """One training sequence: a segment of an episode with its loss mask."""

    SCHEMA: ClassVar[str] = "legorl/sample@1"
    schema: str = SCHEMA
    sample_id: str
    episode_id: str
    group_id: str
    segment_index: int
    segment_count: int
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 only on sampled tokens
    rollout_logprobs: list[float]  # [sum(loss_mask)], one per loss token
    reward: float
    advantage: float | None = None
    weight: float = 1.0
    policy_version: int = 0  # the version that sampled its first completion span
    aux: bool = False
    # Each completion span (one call's tokens, in order): the policy version that sampled it and
    # its loss tokens. An episode that ran across a weight sync has spans of several versions;
    # empty (files written before spans were kept): one span of ``policy_version``.
    span_versions: list[int] = field(default_factory=list)
    span_lengths: list[int] = field(default_factory=list)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among its spans: its staleness is measured from it."""
        return min(self.span_versions) if self.span_versions else self.policy_version

    def token_versions(self) -> list[int]:
        """The policy version of each loss token, [sum(loss_mask)]."""
        if not self.span_versions:
            return [self.policy_version] * len(self.rollout_logprobs)
        return [
            v for v, n in zip(self.span_versions, self.span_lengths, strict=True) for _ in range(n)
        ]

    # MoE routing of input_ids' positions (legorl.routing); None: none recorded (dense model)
    routing: list[RoutingSpan] | None = None

    def check(self) -> None:
        if len(self.span_versions) != len(self.span_lengths):
            raise FieldError(
                "span_lengths",
                f"has {len(self.span_lengths)} entries for {len(self.span_versions)} span_versions",
            )
        if self.span_lengths and sum(self.span_lengths) != sum(self.loss_mask):
            raise FieldError(
                "span_lengths",
                f"sum to {sum(self.span_lengths)}, not the {sum(self.loss_mask)} loss tokens",
            )
        for i, span in enumerate(self.routing or ()):
            if (
                min(span.row, span.skip, span.at) < 0
                or span.count < 1
                or span.skip + span.count > span.rows
                or span.at + span.count > len(self.input_ids)
            ):
                raise FieldError(f"routing[{i}]", "span does not fit its chunk or input_ids")
        if len(self.loss_mask) != len(self.input_ids):
            raise FieldError(
                "loss_mask",
                f"has {len(self.loss_mask)} entries for {len(self.input_ids)} input_ids",
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise FieldError("loss_mask", "entries must be 0 or 1")
        n_loss = sum(self.loss_mask)
        if len(self.rollout_logprobs) != n_loss:
            raise FieldError(
                "rollout_logprobs",
                f"has {len(self.rollout_logprobs)} values for {n_loss} loss tokens",
            )
        if not 0 <= self.segment_index < self.segment_count:
            raise FieldError(
                "segment_index",
                f"{self.segment_index} is outside 0..{self.segment_count - 1}",
            )


@dataclass(slots=True, kw_only=True)
class Metric(Record):
    """One scalar from training or a monitor."""

    SCHEMA: ClassVar[str] = "legorl/metric@1"
    schema: str = SCHEMA
    step: int
    name: str
    value: float | None  # null when undefined (e.g. correlation of an empty batch)
    time: float = 0.0
    source: str = "train"


@dataclass(slots=True, kw_only=True)
class Alert(Record):
    """One monitor alert, as ``legorl.monitors`` writes it to ``alerts.jsonl``."""

    SCHEMA: ClassVar[str] = "legorl/alert@1"
    schema: str = SCHEMA
    kind: str  # a legorl.monitors.AlertKind
    message: str
    step: int | None = None  # training step, for alerts raised by a metric
    trajectory_id: str | None = None  # for alerts raised by a trajectory
    value: float | None = None  # the observed figure
    threshold: float | None = None
    time: float = 0.0

    def line(self) -> str:
        where = f"step {self.step}: " if self.step is not None else ""
        if self.trajectory_id and self.kind == "hack":
            where = f"{self.trajectory_id}: "
        return f"legorl monitor: ALERT [{self.kind}] {where}{self.message}"


@dataclass(slots=True, kw_only=True)
class TrainerLogprobs(Record):
    """The trainer's recomputed log-probs for one Sample's loss tokens, in the order of
    ``Sample.rollout_logprobs`` (one per ``loss_mask == 1`` position), under the weights the
    train call started from (π_old); ``legorl inspect`` colours tokens by |Δ log-prob|."""

    SCHEMA: ClassVar[str] = "legorl/trainer_logprobs@1"
    schema: str = SCHEMA
    sample_id: str
    logprobs: list[float]  # [sum(loss_mask)]
    step: int = 0  # the optimizer step they were scored before
    policy_version: int = 0
    # MoE: positions of input_ids where the trainer's own router chose other experts than the
    # rollout's in some layer (under π_old); None: no routing recorded for the sample
    routing_differs: list[int] | None = None


RECORD_TYPES: tuple[type[Record], ...] = (
    Task,
    Turn,
    Trajectory,
    Sample,
    Metric,
    Alert,
    TrainerLogprobs,
)
SCHEMAS: dict[str, type[Record]] = {cls.SCHEMA: cls for cls in RECORD_TYPES}
#: Short names for the CLI (``--schema turn``).
SHORT_NAMES: dict[str, type[Record]] = {cls.__name__.lower(): cls for cls in RECORD_TYPES}

R = TypeVar("R", bound=Record)
T = TypeVar("T")


def segment_prompts(turns: Iterable[Turn]) -> Iterator[tuple[Turn, list[int]]]:
    """Yield each turn with its full prompt, rebuilt from the deltas of its segment.

    Turns must be in call order. Raises ``FieldError`` when a turn's ``prompt_offset`` points
    past what its segment holds.
    """
    held: dict[tuple[str, int], list[int]] = {}
    for turn in turns:
        tokens = held.setdefault((turn.session, turn.segment), [])
        if turn.prompt_offset > len(tokens):
            raise FieldError(
                "prompt_offset",
                f"turn {turn.turn} of session {turn.session!r} starts at {turn.prompt_offset} "
                f"but segment {turn.segment} holds only {len(tokens)} tokens",
            )
        del tokens[turn.prompt_offset :]
        tokens.extend(turn.prompt_delta)
        yield turn, list(tokens)
        tokens.extend(turn.completion_ids)


# --------------------------------------------------------------------------------------------
# Validation: one checker per field, built once per class from its annotations
# --------------------------------------------------------------------------------------------

Checker = Callable[[Any, str], Any]  # (value, field path) -> value converted to its type


def _fail(path: str, expected: str, value: Any) -> typing.NoReturn:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise FieldError(path, f"expected {expected}, got {type(value).__name__} {shown}")


def _checker(tp: Any) -> Checker:
    origin = get_origin(tp)
    if tp is Any:
        return lambda v, p: v
    if tp is str or tp is bool:

        def check_exact(v: Any, p: str) -> Any:
            if type(v) is not tp:
                _fail(p, tp.__name__, v)
            return v

        return check_exact
    if tp is int:

        def check_int(v: Any, p: str) -> Any:
            if type(v) is not int:
                _fail(p, "int", v)
            return v

        return check_int
    if tp is float:

        def check_float(v: Any, p: str) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            _fail(p, "number", v)

        return check_float
    if origin is Literal:
        allowed = get_args(tp)

        def check_literal(v: Any, p: str) -> Any:
            if v not in allowed:
                raise FieldError(p, f"must be one of {', '.join(map(repr, allowed))}, got {v!r}")
            return v

        return check_literal
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = _checker(args[0]) if len(args) == 1 else None
        if inner is None:
            raise TypeError(f"unsupported union {tp}")

        def check_optional(v: Any, p: str) -> Any:
            return None if v is None else inner(v, p)

        return check_optional
    if origin is list:
        (item_tp,) = get_args(tp)
        if item_tp is int or item_tp is float:
            return _number_list_checker(item_tp)
        item = _checker(item_tp)

        def check_list(v: Any, p: str) -> Any:
            if type(v) is not list:
                _fail(p, "list", v)
            return [item(x, f"{p}[{i}]") for i, x in enumerate(v)]

        return check_list
    if origin is dict or tp is dict:
        kv = get_args(tp)
        value = _checker(kv[1]) if kv else None

        def check_dict(v: Any, p: str) -> Any:
            if type(v) is not dict:
                _fail(p, "object", v)
            if value is None:
                return v
            return {k: value(x, f"{p}.{k}") for k, x in v.items()}

        return check_dict
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_builder(tp)
    raise TypeError(f"no checker for {tp!r}")


def _number_list_checker(item_tp: type) -> Checker:
    # Token ids and log-probs are most of the bytes: check them in one pass, and only walk the
    # list element by element to name the bad index.
    name = "int" if item_tp is int else "number"
    allowed = {int} if item_tp is int else {int, float}

    def check_numbers(v: Any, p: str) -> Any:
        if type(v) is not list:
            _fail(p, "list", v)
        if not set(map(type, v)) <= allowed:
            for i, x in enumerate(v):
                if not (type(x) is int or (item_tp is float and type(x) is float)):
                    _fail(f"{p}[{i}]", name, x)
        return v

    return check_numbers


_BUILDERS: dict[type, Checker] = {}


def _dataclass_builder(cls: type) -> Checker:
    if cls in _BUILDERS:
        return _BUILDERS[cls]
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name != "schema"]
    checkers = {f.name: _checker(hints[f.name]) for f in fields}
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    known = set(checkers) | {"schema"}

    def build(v: Any, p: str) -> Any:
        if type(v) is not dict:
            _fail(p or "record", "object", v)
        prefix = f"{p}." if p else ""
        for name in required:
            if name not in v:
                raise FieldError(f"{prefix}{name}", "missing required field")
        kwargs = {}
        for k, x in v.items():
            chk = checkers.get(k)
            if chk is None:
                if k in known:
                    continue
                raise FieldError(f"{prefix}{k}", f"unknown field for {cls.__name__}")
            kwargs[k] = chk(x, prefix + k)
        obj = cls(**kwargs)
        if isinstance(obj, Record):
            obj.check()
        return obj

    _BUILDERS[cls] = build
    return build


def from_dict(data: Any, expect: type[R] | tuple[type[R], ...] | None = None) -> R:
    """Build and validate a record from a decoded JSON object; raises ``FieldError``."""
    if type(data) is not dict:
        _fail("record", "a JSON object", data)
    schema = data.get("schema")
    if schema is None:
        raise FieldError("schema", "missing required field")
    cls = SCHEMAS.get(schema)
    if cls is None:
        raise FieldError(
            "schema", f"unknown schema {schema!r} (known: {', '.join(sorted(SCHEMAS))})"
        )
    if expect is not None:
        wanted = expect if isinstance(expect, tuple) else (expect,)
        if cls not in wanted:
            names = ", ".join(c.SCHEMA for c in wanted)
            raise FieldError("schema", f"expected {names}, got {schema!r}")
    return typing.cast(R, _dataclass_builder(cls)(data, ""))


def from_object(cls: type[T], data: Any, path: str) -> T:
    """A nested record (no schema tag, e.g. ``SessionReport``) from a decoded JSON object,
    checked field by field like a record's; raises ``FieldError`` naming ``path``'s field."""
    return typing.cast(T, _dataclass_builder(cls)(data, path))


def to_json(record: Record) -> bytes:
    """One record as a JSON line, without the newline."""
    return orjson.dumps(record)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class RecordError(ValueError):
    """A bad line in a JSONL file: ``file:line: field: message``."""

    def __init__(self, source: str, line: int, message: str, field_name: str | None = None):
        where = f"{source}:{line}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line
        self.field_name = field_name
        self.message = message


class JsonlReader(Iterable[R]):
    """Iterate validated records from a JSONL file, a binary stream or ``"-"`` (stdin).

    With ``skip_bad`` bad lines are counted in ``skipped`` (first errors kept in ``errors``)
    instead of raising; blank lines are ignored.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | IO[bytes],
        expect: type[R] | tuple[type[R], ...] | None = None,
        *,
        skip_bad: bool = False,
    ) -> None:
        self.source = source
        self.expect = expect
        self.skip_bad = skip_bad
        self.skipped = 0
        self.errors: list[RecordError] = []

    @property
    def name(self) -> str:
        src = self.source
        if src == "-":
            return "<stdin>"
        if isinstance(src, (str, os.PathLike)):
            return os.fspath(src)
        return str(getattr(src, "name", "<stream>"))

    def _open(self) -> tuple[IO[bytes], bool]:
        src = self.source
        if src == "-":
            return sys.stdin.buffer, False
        if isinstance(src, (str, os.PathLike)):
            return open(src, "rb"), True
        return src, False

    def __iter__(self) -> Iterator[R]:
        name = self.name
        stream, owned = self._open()
        try:
            lineno = 0
            for raw in stream:
                lineno += 1
                if not raw.strip():
                    continue
                try:
                    yield self._parse(raw, name, lineno)
                except RecordError as err:
                    if not self.skip_bad:
                        raise
                    self.skipped += 1
                    if len(self.errors) < 20:
                        self.errors.append(err)
        finally:
            if owned:
                stream.close()

    def _parse(self, raw: bytes, name: str, lineno: int) -> R:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if not raw.endswith(b"\n"):
                raise RecordError(
                    name, lineno, "truncated last line (was its writer killed?)"
                ) from None
            raise RecordError(name, lineno, f"malformed JSON: {exc}") from None
        try:
            return from_dict(data, self.expect)
        except FieldError as exc:
            schema = data.get("schema") if isinstance(data, dict) else None
            known = f" ({schema})" if schema in SCHEMAS and schema not in str(exc) else ""
            raise RecordError(name, lineno, f"{exc}{known}", exc.field_name) from None


def read_jsonl(
    source: str | os.PathLike[str] | IO[bytes],
    expect: type[R] | tuple[type[R], ...] | None = None,
    *,
    skip_bad: bool = False,
) -> JsonlReader[R]:
    """Validated records from ``source``; see ``JsonlReader``."""
    return JsonlReader(source, expect, skip_bad=skip_bad)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class JsonlWriter:
    """Append records as whole lines, flushed one by one.

    Each record goes out in one ``write`` of its full line, so a writer killed mid-way leaves at
    most one truncated last line. Opening a file whose last line is truncated (by an earlier
    killed writer) first ends that line, so the next record never glues onto it: readers still
    report it, by line number, and nothing already written is rewritten.
    """

    def __init__(self, target: str | os.PathLike[str] | IO[bytes] | None = None) -> None:
        if target is None or target == "-":
            self.name = "<stdout>"
            self._fd = sys.stdout.fileno()
            self._owned = False
            sys.stdout.flush()
        elif isinstance(target, (str, os.PathLike)):
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.name = str(path)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._owned = True
            self._end_partial_line(path)
        else:
            self.name = str(getattr(target, "name", "<stream>"))
            target.flush()
            self._fd = target.fileno()
            self._owned = False
        self.written = 0

    def _end_partial_line(self, path: Path) -> None:
        size = path.stat().st_size
        if size == 0:
            return
        with open(path, "rb") as fh:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                self._write_all(b"\n")

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def write(self, record: Record) -> None:
        self._write_all(orjson.dumps(record) + b"\n")
        self.written += 1

    def write_many(self, records: Iterable[Record]) -> int:
        n = 0
        for record in records:
            self.write(record)
            n += 1
        return n

    def close(self) -> None:
        if self._owned and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_jsonl(
    target: str | os.PathLike[str] | IO[bytes] | None, records: Iterable[Record]
) -> int:
    """Append ``records`` to ``target`` (a path, a binary stream, or stdout); returns the count."""
    with JsonlWriter(target) as writer:
        return writer.write_many(records)
