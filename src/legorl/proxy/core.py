"""The proxy's core, shared by `legorl proxy serve` (HTTP server) and `legorl proxy intercept`
(mitmproxy addon): routing, wire formats, token bookkeeping, generation and recording.

    core = ProxyCore(ProxyConfig(model="fixtures/models/tiny-qwen3", out="runs/turns"), engine)
    response = await core.handle("POST", "/s/sess-1/v1/chat/completions", "", headers, body)

Routes: ``/v1/chat/completions``, ``/v1/messages`` (and ``count_tokens``), ``/v1/responses``,
and Google's ``/v1beta/models/{model}:generateContent``, ``:streamGenerateContent`` and
``:countTokens``, each under ``/s/{session}``; ``legorl.proxy.wire`` has their formats.

``handle`` never raises for a client's mistake: it answers in the calling API's error shape.
Every answered call is appended as a Turn record to ``{out}/{session}.jsonl``. On a
mixture-of-experts model served by an engine that records routing (embedded), the experts each
MoE layer chose for every token the call computed go to ``{out}/{session}.routing``
(``legorl.routing``), appended before the Turn that refers to them by rows and checksum.

Sessions come in two kinds. A session opened with ``open_session`` (the rollout, in-process or
through ``POST /admin/sessions``) is a capability: it is reachable only at the route that call
returns, ``/s/{id}~{secret}`` with 128 random bits, which the proxy checks on every request;
its bare id and API-key headers never reach it, not even after it is closed. An open session
(``open_sessions``, for a person calling the proxy by hand) is named by the client, at
``/s/{id}`` or as the API key. A route that is not a live session's gets the same 404 whether
the id exists or not. A sandbox reaches the proxy through a byte relay, so the check sits here,
where nothing between the sandbox and the decision reparses the request.

Episode budgets (``Budget``): each call's ``max_tokens`` is clamped to ``max_call_tokens``, to
the context left and to the episode's token budget left; the Turn keeps what was asked and what
was used. A session that has used ``max_turns`` calls, ``max_tokens`` sampled tokens or
``max_s`` seconds since it opened gets a 400 ``budget_exceeded`` in its API's error shape, which
no client retries, so the harness stops. That session, and one whose prompt outgrew the model's
context (``context_length_exceeded``), is marked truncated: ``close_session`` and
``DELETE /admin/sessions/{id}`` return the reason, and the rollout records the episode as
``truncated``, the policy's doing, not the environment's.

Closing a session returns the proxy's own record of it (``SessionReport``): the truncation, how
many completions reached the client, and the engine failures it answered (the engine down or
crashed; not a refusal of what a request asked, ``EngineRequestError``). The rollout decides an
episode's environment failures on this record, never on what the harness printed or how it
exited: the agent's commands run beside the harness and could forge either.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import secrets
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from legorl.protocols import (
    BASE_ADAPTER,
    ContextLengthError,
    Engine,
    EngineError,
    EngineRequestError,
    GenerationRequest,
    Placement,
    ServesAdapters,
)
from legorl.proxy.chat import (
    ApiError,
    ApiName,
    ChatRequest,
    Completion,
    Event,
    Finish,
    FinishReason,
    StreamHead,
    TextDelta,
    Usage,
)
from legorl.proxy.parse import Detokenizer, OutputParser
from legorl.proxy.session import Generated, PromptPlan, Session
from legorl.proxy.tokens import ChatTokenizer, PromptTooLong
from legorl.proxy.wire import WIRES
from legorl.records import (
    Failover,
    JsonlWriter,
    RoutingRef,
    SessionReport,
    ToolCall,
    Turn,
    TurnFlags,
    TurnOutput,
)
from legorl.routing import SUFFIX as ROUTING_SUFFIX
from legorl.routing import RoutingCapture, RoutingWriter

_OPEN_TURN_FILES = 256  # Turn files kept open at once; older ones are reopened when needed
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ROUTE = re.compile(r"^(?:/s/(?P<session>[^/]+))?(?P<rest>/.*)?$")
_NO_SECRET = secrets.token_hex(16)
_CAPABILITY = re.compile(r"^(/s/[^/~]*~)[^/]*")  # a capability route's secret, for log lines
_ENDPOINTS: dict[str, ApiName] = {
    "/v1/chat/completions": "openai_chat",
    "/chat/completions": "openai_chat",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
    "/responses": "responses",
}
# Google's API puts the model and the method in the path; the ``alt=sse`` query picks SSE.
_GEMINI = re.compile(
    r"^/v1(?:beta|alpha)?/models/(?P<model>[^/:]+):"
    r"(?P<method>generateContent|streamGenerateContent|countTokens)$"
)


@dataclass(slots=True)
class Response:
    status: int
    body: bytes | AsyncIterator[bytes]
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return not isinstance(self.body, bytes)


@dataclass(slots=True, kw_only=True)
class Budget:
    """Per-call and per-session caps; None is no cap."""

    max_call_tokens: int | None = None  # clamps each call's max_tokens
    max_turns: int | None = None  # answered calls per session, aux calls included
    max_tokens: int | None = None  # sampled tokens per session
    max_s: float | None = None  # seconds from the session's opening to a call's arrival

    def __post_init__(self) -> None:
        for name in ("max_call_tokens", "max_turns", "max_tokens", "max_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"budget {name}: must be > 0, got {value}")


#: Why a session was truncated (``close_session``'s answer), besides the Budget field names.
CONTEXT_OVERFLOW = "context_length"


#: The proxy's threads that encode prompts (each session one call and one count at a time).
ENCODING_THREADS = 2
_FAILURES_KEPT = 8  # engine failures a session's report keeps (the latest ones)


@dataclass(slots=True)
class _Spent:
    opened: float = field(default_factory=time.monotonic)
    turns: int = 0
    tokens: int = 0
    truncated: str | None = None
    completions: int = 0  # calls whose sampled tokens began to reach the client
    failures: list[str] = field(default_factory=list)  # the engine's own failures, latest last
    failed_at: int = -1  # ``completions`` when the latest engine failure happened

    def engine_failed(self, err: EngineError) -> None:
        self.failures = [*self.failures, str(err)][-_FAILURES_KEPT:]
        self.failed_at = self.completions

    def report(self) -> SessionReport:
        return SessionReport(
            truncated=self.truncated,
            completions=self.completions,
            engine_failures=list(self.failures),
            failed_last=bool(self.failures) and self.failed_at == self.completions,
        )


@dataclass(slots=True, kw_only=True)
class ProxyConfig:
    model: str | Path
    served_name: str = ""  # defaults to the model folder's name
    out: str | Path | None = None  # where Turn records go; None keeps nothing
    open_sessions: bool = True  # False: only sessions registered through /admin/sessions
    admin_token: str | None = None  # None: admin routes are refused
    max_body_bytes: int = 32 * 1024 * 1024
    default_max_tokens: int = 4096  # when a request names none (OpenAI Chat may omit it)
    log_errors: bool = False  # one stderr line per client error
    budget: Budget = field(default_factory=Budget)
    # Tests only, for the controls of the isolation tests: False lets bare ids and API keys
    # reach capability sessions too, and a declared main system prompt is not bound at open.
    isolate_sessions: bool = True


class ProxyCore:
    def __init__(self, config: ProxyConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        # read once: a runtime Protocol check costs microseconds on every call otherwise
        self._adapters: ServesAdapters | None = (
            engine if isinstance(engine, ServesAdapters) else None
        )
        self.tok = ChatTokenizer(config.model)
        self.served_name = config.served_name or Path(config.model).name
        self.out = Path(config.out) if config.out is not None else None
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.sessions: dict[str, Session] = {}
        self._secrets: dict[str, str] = {}  # live capability sessions' secrets
        self._granted: set[str] = set()  # every id opened as a capability (bare ids never reach)
        self._locks: dict[str, asyncio.Lock] = {}
        self._counting: dict[str, asyncio.Lock] = {}  # a session's token counts, one at a time
        self._writers: dict[str, JsonlWriter] = {}  # one open Turn file per live session
        self._session_out: dict[str, Path] = {}  # sessions opened with their own Turn folder
        self._spent: dict[str, _Spent] = {}  # budget used by each live session
        self.stats = {"requests": 0, "errors": 0, "cancelled": 0}
        #: Where prompts are encoded: off the event loop (a long prompt takes seconds, round
        #: 72), in threads of the proxy's own, never the loop's default pool that other work of
        #: the process shares (round 73), and a session's one at a time (its lock).
        self._encoding = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="legorl-encode")

    # ---- entry point --------------------------------------------------------------------

    async def handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        """Answer one HTTP request. ``headers`` keys are lower-case."""
        self.stats["requests"] += 1
        match = _ROUTE.match(path)
        rest = (match.group("rest") or "/") if match else path
        try:
            if match is None:
                raise ApiError(404, f"no route for {path}", kind="not_found_error")
            if rest == "/" and method in ("HEAD", "GET"):
                return Response(200, b"" if method == "HEAD" else b'{"legorl": "proxy"}')
            if rest == "/healthz" and method == "GET":
                # The counts of every session's calls: the admin's, or anyone's where no
                # session is a capability (open sessions, no admin token).
                anyone = self.config.open_sessions and self.config.admin_token is None
                return self._json(200, self.health(counts=anyone or self._admin_asks(headers)))
            if rest.startswith("/admin/"):
                return await self._admin(method, rest, headers, body)
            if method == "GET" and rest in ("/v1/models", "/models"):
                return self._json(200, self._models())
            if method != "POST":
                raise ApiError(404, f"no route for {method} {rest}", kind="not_found_error")
            if len(body) > self.config.max_body_bytes:
                raise ApiError(
                    413,
                    f"request body of {len(body)} bytes exceeds the limit of "
                    f"{self.config.max_body_bytes}",
                    kind="request_too_large",
                )
            endpoint = _ENDPOINTS.get(rest)
            gemini = _GEMINI.match(rest) if endpoint is None else None
            if endpoint is None and gemini is None and rest != "/v1/messages/count_tokens":
                raise ApiError(404, f"no route for POST {rest}", kind="not_found_error")
            session = self._session(match.group("session"), headers)
            if gemini is not None:
                return await self._gemini(gemini["model"], gemini["method"], query, session, body)
            if endpoint is None:
                return await self._count_tokens(session, body)
            return await self._chat(session, WIRES[endpoint].parse_request(body))
        except ApiError as err:
            if self.config.log_errors:
                shown = _CAPABILITY.sub(r"\1…", path)  # a session's secret stays out of logs
                print(
                    f"legorl proxy: {err.status} {method} {shown}: {err.message}",
                    file=sys.stderr,
                    flush=True,
                )
            return self.error_response(path, err)

    def error_response(self, path: str, err: ApiError) -> Response:
        """``err`` in the error shape of the API that ``path`` belongs to."""
        self.stats["errors"] += 1
        api: ApiName = "openai_chat"
        if "/messages" in path:
            api = "anthropic"
        elif "/responses" in path:
            api = "responses"
        elif "/models/" in path and ":" in path.rsplit("/", 1)[-1]:
            api = "gemini"
        return Response(err.status, WIRES[api].error_body(err))

    # ---- routes -------------------------------------------------------------------------

    def health(self, *, counts: bool = True) -> dict[str, Any]:
        """The proxy's state; with ``counts``, its sessions and calls too: a sandbox reaches
        /healthz, and the counts of every session's calls are a channel between sandboxes
        (round 71: one sandbox's 500 bad calls read by another; round 72: the same through a
        rollout's in-process proxy, which has capability sessions and no admin token), so
        over HTTP they go to the admin only, or to anyone where sessions are open."""
        out = {
            "status": "ok",
            "model": self.served_name,
            "engine": self.engine.name,
            "policy_version": self.engine.policy_version,
            "open_sessions": self.config.open_sessions,
        }
        return {**out, "sessions": len(self.sessions), **self.stats} if counts else out

    def _admin_asks(self, headers: Mapping[str, str]) -> bool:
        """The request carries the admin token (never where none is set)."""
        token = self.config.admin_token
        if token is None:
            return False
        given = headers.get("authorization", "").encode()
        return secrets.compare_digest(given, f"Bearer {token}".encode())

    def _models(self) -> dict[str, Any]:
        # One body both OpenAI and Anthropic clients accept for listing models.
        item = {
            "id": self.served_name,
            "object": "model",
            "type": "model",
            "display_name": self.served_name,
            "created": 0,
            "created_at": "1970-01-01T00:00:00Z",
            "owned_by": "legorl",
        }
        return {
            "object": "list",
            "data": [item],
            "has_more": False,
            "first_id": self.served_name,
            "last_id": self.served_name,
        }

    def _session(self, from_path: str | None, headers: Mapping[str, str]) -> Session:
        """The session a request belongs to: a capability route's, or an open session's."""
        if from_path is not None and "~" in from_path:
            named, _, secret = from_path.partition("~")
            _check_id(named)
            # Compared in constant time, against a stand-in when there is no such session, so
            # neither the secret nor whether the id exists shows in the time to answer.
            expected = self._secrets.get(named)
            matches = secrets.compare_digest(secret.encode(), (expected or _NO_SECRET).encode())
            if expected is None or not matches:
                raise _unknown(named)
            return self.sessions[named]
        sid = from_path
        if sid is None:
            auth = headers.get("authorization", "")
            sid = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            sid = sid or headers.get("x-api-key") or headers.get("x-goog-api-key")
        if not sid:
            raise ApiError(
                401,
                "no session: use /s/{session}/… or send the session id as the API key",
                kind="authentication_error",
            )
        _check_id(sid)
        if sid in self._granted and self.config.isolate_sessions:
            raise _unknown(sid)
        session = self.sessions.get(sid)
        if session is None:
            if not self.config.open_sessions:
                raise _unknown(sid)
            session = self.sessions[sid] = Session(sid, self.tok)
            self._spent[sid] = _Spent()
        return session

    async def _admin(
        self, method: str, rest: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        if not self._admin_asks(headers):
            raise ApiError(401, "admin routes need the admin token", kind="authentication_error")
        data = _json_object(body) if body else {}
        if method == "POST" and rest == "/admin/weights":
            path, name = data.get("path"), data.get("adapter")
            if not isinstance(path, str):
                raise ApiError(400, "path: expected a string", param="path")
            if name is not None and not isinstance(name, str):
                raise ApiError(400, "adapter: expected a string or null", param="adapter")
            try:
                if name is None:
                    return self._json(200, {"policy_version": await self.load_weights(path)})
                version = await self.load_adapter(name, path)
            except EngineRequestError as exc:
                raise ApiError(400, str(exc), param="path") from None
            except (EngineError, NotImplementedError) as exc:
                raise ApiError(503, str(exc), kind="overloaded_error") from None
            answer = {"adapter": name, "adapter_version": version}
            return self._json(200, {**answer, "policy_version": self.engine.policy_version})
        if method == "POST" and rest == "/admin/sessions":
            sid, system = data.get("id"), data.get("main_system")
            adapter = data.get("adapter")
            if not isinstance(sid, str):
                raise ApiError(400, "id: expected a string", param="id")
            if system is not None and not isinstance(system, str):
                raise ApiError(400, "main_system: expected a string or null", param="main_system")
            if adapter is not None and not isinstance(adapter, str):
                raise ApiError(400, "adapter: expected a string or null", param="adapter")
            route = self.open_session(sid, main_system=system, adapter=adapter)
            return self._json(200, {"id": sid, "route": route})
        if method == "DELETE" and rest.startswith("/admin/sessions/"):
            sid = rest.rsplit("/", 1)[1]
            report = self.close_session(sid)
            return self._json(
                200,
                {
                    "id": sid,
                    "deleted": True,
                    "truncated": report.truncated if report is not None else None,
                    "report": report,
                },
            )
        raise ApiError(404, f"no admin route {method} {rest}", kind="not_found_error")

    async def load_weights(self, path: str) -> int:
        """Swap the engine's weights for the checkpoint at ``path`` without dropping sessions
        (``POST /admin/weights``); Turns sampled afterwards carry the returned policy version.
        A LoRA adapter folder becomes the policy's adapter on engines that serve adapters."""
        return await self.engine.load_weights(path)

    async def load_adapter(self, name: str, path: str) -> int:
        """Load the adapter folder ``path`` as ``name`` beside the policy (``POST
        /admin/weights`` with ``adapter``); sessions opened with that adapter sample with it."""
        if self._adapters is None:
            raise EngineRequestError(f"the {self.engine.name} engine serves no LoRA adapters")
        return await self._adapters.load_adapter(name, path)

    def redirect_turns(self, out: str | Path) -> None:
        """Write Turn records to ``out`` from now on (the loop gives each phase its own folder).
        Call it between runs: a live session's later Turns would land in the new folder."""
        for sid in list(self._writers):
            self._writers.pop(sid).close()
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)

    def open_session(
        self,
        sid: str,
        *,
        main_system: str | None = None,
        out: str | Path | None = None,
        adapter: str | None = None,
    ) -> str:
        """Open ``sid`` as a capability session and return its route, ``/s/{sid}~{secret}``:
        the only way to reach it. Opening an id again starts it afresh under a new secret (the
        old route stops working); an open session of that name is dropped, and a call of it
        still running records nothing. ``main_system`` binds the main system prompt now (see
        ``Session``); without it the first tool-bearing call through the route binds it.
        ``out``: this session's Turns go to that folder instead of the proxy's (phases of an
        asynchronous loop overlap, each with its own folder). ``adapter`` names the LoRA
        adapter its calls sample with (loaded with ``load_adapter``); None: the policy."""
        _check_id(sid, field="id")
        self.close_session(sid)
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            self._session_out[sid] = Path(out)
        secret = secrets.token_hex(16)
        if not self.config.isolate_sessions:
            main_system = None
        self.sessions[sid] = Session(sid, self.tok, main_system=main_system, adapter=adapter)
        self._spent[sid] = _Spent()
        self._secrets[sid] = secret
        self._granted.add(sid)
        return f"/s/{sid}~{secret}"

    def close_session(self, sid: str) -> SessionReport | None:
        """Forget a session's state and close its Turn file; its route stops working. Returns
        the proxy's record of it (``SessionReport``; its ``truncated``: a ``Budget`` field name
        or ``CONTEXT_OVERFLOW``), or None for a session it does not have."""
        spent = self._spent.pop(sid, None)
        self.sessions.pop(sid, None)
        self._secrets.pop(sid, None)
        self._locks.pop(sid, None)
        self._counting.pop(sid, None)
        self._session_out.pop(sid, None)
        writer = self._writers.pop(sid, None)
        if writer is not None:
            writer.close()
        return spent.report() if spent is not None else None

    def close(self) -> None:
        for sid in list(self._writers):
            self._writers.pop(sid).close()
        self._encoding.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, which encodes a prompt, in an encoding thread; a prompt that cannot
        fit the model's context is refused before it is encoded (``ChatTokenizer.limit``)."""
        self.tok.limit = self.engine.max_context
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._encoding, functools.partial(fn, *args))

    async def _count(self, session: Session, messages: list[Any], tools: list[Any]) -> int:
        """A token count, one a session at a time (the counting routes take no call lock)."""
        async with self._counting.setdefault(session.id, asyncio.Lock()):
            try:
                return int(await self._off_loop(self.tok.count, messages, tools))
            except PromptTooLong as exc:
                raise self._too_long(f"at least {exc.tokens}") from None

    def _too_long(self, tokens: int | str) -> ApiError:
        limit = self.engine.max_context
        return ApiError(
            400,
            f"prompt is too long: {tokens} tokens > {limit - 1} maximum "
            f"(the model's context is {limit} tokens)",
            code="context_length_exceeded",
            param="messages",
        )

    async def _count_tokens(self, session: Session, body: bytes) -> Response:
        wire = WIRES["anthropic"]
        req = wire.count_tokens_request(body)  # type: ignore[attr-defined]
        n = await self._count(session, req.messages, req.tools)
        return Response(200, wire.count_tokens_body(n))  # type: ignore[attr-defined]

    async def _gemini(
        self, model: str, method: str, query: str, session: Session, body: bytes
    ) -> Response:
        from legorl.proxy.wire import gemini

        if method == "countTokens":
            req = gemini.count_tokens_request(body, model=model)
            n = await self._count(session, req.messages, req.tools)
            return Response(200, gemini.count_tokens_body(n))
        sse = "alt=sse" in query.split("&")
        req = gemini.parse_request(body, model=model, stream=method != "generateContent" and sse)
        if method == "streamGenerateContent" and not sse:
            req.metadata["array"] = True  # without alt=sse the stream is one JSON array
        return await self._chat(session, req)

    @staticmethod
    def _json(status: int, obj: Any) -> Response:
        return Response(status, orjson.dumps(obj))

    # ---- generation ---------------------------------------------------------------------

    async def _chat(self, session: Session, req: ChatRequest) -> Response:
        wire = WIRES[req.api]
        if not req.messages:
            raise ApiError(400, "messages: at least one message is required", param="messages")
        lock = self._locks.setdefault(session.id, asyncio.Lock())
        arrived = time.time()
        await lock.acquire()
        try:
            queued = time.time() - arrived
            spent = self._spent.setdefault(session.id, _Spent())
            self._check_budget(spent)
            t0 = time.perf_counter()
            try:
                plan = await self._off_loop(session.plan, req)
            except PromptTooLong as exc:
                spent.truncated = spent.truncated or CONTEXT_OVERFLOW
                raise self._too_long(f"at least {exc.tokens}") from None
            build_s = time.perf_counter() - t0
            prompt = plan.prompt_ids
            if len(prompt) >= self.engine.max_context:
                spent.truncated = spent.truncated or CONTEXT_OVERFLOW
                raise self._too_long(len(prompt))
            meta = {"arrived": arrived, "queue_s": queued, "prompt_build_s": build_s}
            events = self._generate(session, req, plan, prompt, meta, lock, spent)
            rid = wire.response_id()
            created = int(arrived)
            if req.stream:
                head = StreamHead(id=rid, created=created, prompt_tokens=len(prompt))
                stream = wire.stream(events, req, head)
                return Response(
                    200,
                    stream,
                    content_type="text/event-stream",
                    headers={"cache-control": "no-cache"},
                )
            async with contextlib.aclosing(events):  # a call ended early frees its request
                collected = [ev async for ev in events]
            completion = Completion.collect(collected, id=rid, model=req.model, created=created)
            return Response(200, wire.response_body(completion, req))
        except BaseException:
            if lock.locked() and not req.stream:
                lock.release()
            raise

    async def _generate(
        self,
        session: Session,
        req: ChatRequest,
        plan: PromptPlan,
        prompt: list[int],
        meta: dict[str, float],
        lock: asyncio.Lock,
        spent: _Spent,
    ) -> AsyncGenerator[Event, None]:
        """Sample, parse and stream events; record the Turn once the completion is whole.

        Holds the session lock until done, so calls of one session never interleave."""
        try:
            async for ev in self._sample(session, req, plan, prompt, meta, spent):
                yield ev
        finally:
            if lock.locked():
                lock.release()

    async def _sample(
        self,
        session: Session,
        req: ChatRequest,
        plan: PromptPlan,
        prompt: list[int],
        meta: dict[str, float],
        spent: _Spent,
    ) -> AsyncIterator[Event]:
        wire = WIRES[req.api]
        budget = self.config.budget
        caps = [
            req.max_tokens or self.config.default_max_tokens,
            self.engine.max_context - len(prompt),
        ]
        if budget.max_call_tokens is not None:
            caps.append(budget.max_call_tokens)
        if budget.max_tokens is not None:
            caps.append(budget.max_tokens - spent.tokens)
        max_tokens = min(caps)
        gen_req = GenerationRequest(
            prompt_ids=prompt,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop_token_ids=self.tok.stop_ids,
            seed=req.seed,
            cache_key=f"{plan.sub.id}#{plan.segment}",
            # A non-streamed call without stop strings needs the completion only when it is
            # whole; with stop strings the stream is cut where one appears, token by token.
            stream=req.stream or bool(req.stop),
            adapter=session.adapter,
            adapter_version=session.pinned[1] if session.pinned is not None else None,
            routing=RoutingCapture() if self.out is not None else None,
        )
        parser = OutputParser(wire.tool_call_id)
        detok = Detokenizer(self.tok.decode, self.tok.special_ids)
        stops = _StopStrings(req.stop)
        ids: list[int] = []
        logprobs: list[float] = []
        version = self.engine.policy_version
        adapter = self._adapter_of(session)
        t0 = time.perf_counter()
        first_token_s = 0.0
        completed = out_started = False
        gen = self.engine.generate(gen_req)
        try:
            try:
                async for chunk in gen:
                    if not out_started:
                        out_started = True
                        spent.completions += 1  # the policy's tokens start to go out
                    if not ids:
                        first_token_s = time.perf_counter() - t0
                        # A weight swap lets running requests finish and holds queued ones, so
                        # the version at the first token is the one that sampled them all.
                        version = self.engine.policy_version
                        adapter = self._adapter_of(session, first_token=True)
                        if adapter is not None and adapter[0] in (
                            self._policy_adapter(),
                            BASE_ADAPTER,
                        ):  # a pinned policy adapter: its version; the base: version 0
                            version = adapter[1]
                    ids.extend(s.token_id for s in chunk)
                    logprobs.extend(s.logprob for s in chunk)
                    text = stops.push(detok.push([s.token_id for s in chunk]))
                    for ev in parser.feed(text):
                        yield ev
                    if stops.hit is not None:
                        break
            except ContextLengthError as err:
                spent.truncated = spent.truncated or CONTEXT_OVERFLOW
                raise ApiError(400, str(err), code="context_length_exceeded") from None
            except EngineError as err:
                if not isinstance(err, EngineRequestError):
                    spent.engine_failed(err)
                raise ApiError(503, f"engine error: {err}", kind="overloaded_error") from None
            finally:
                await gen.aclose()  # type: ignore[attr-defined]
            for ev in parser.feed(stops.flush()):
                yield ev
            for ev in parser.finish():
                yield ev
            reason: FinishReason
            if stops.hit is not None or (ids and ids[-1] in self.tok.stop_ids):
                reason = "tool_calls" if parser.calls else "stop"
            else:
                reason = "length"
            yield Finish(
                reason=reason,
                usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(ids)),
                stop_sequence=stops.hit,
            )
            completed = True
        finally:
            if completed:
                spent.turns += 1
                spent.tokens += len(ids)
                self._record(
                    session,
                    req,
                    plan,
                    ids,
                    logprobs,
                    parser,
                    reason,
                    version,
                    adapter,
                    max_tokens,
                    gen_req.placement,
                    gen_req.routing,
                    {
                        **meta,
                        "first_token_s": first_token_s,
                        "generate_s": time.perf_counter() - t0,
                    },
                )
            else:
                self.stats["cancelled"] += 1

    def _policy_adapter(self) -> str | None:
        return self._adapters.policy_adapter if self._adapters is not None else None

    def _adapter_of(self, session: Session, *, first_token: bool = False) -> tuple[str, int] | None:
        """The adapter a call of ``session`` samples with now, and its version: the version
        the session is pinned to while the engine still holds it (an engine whose
        ``keep_versions`` > 1 holds the last ones in ``held_versions``), else the current one,
        which the call's first token pins. Read when that token comes: a swap cannot fall
        between the engine's choice and this (it waits for the calls in flight)."""
        if self._adapters is None:
            return None
        name = session.adapter or self._adapters.policy_adapter
        if name is None:
            return None
        if name == BASE_ADAPTER:
            return name, 0
        current = name, self._adapters.adapter_versions.get(name, 0)
        if getattr(self._adapters, "keep_versions", 1) <= 1:
            return current
        pin = session.pinned
        held = getattr(self._adapters, "held_versions", {}).get(name, ())
        if pin is not None and pin[0] == name and pin[1] in held:
            return pin
        if first_token:  # what the engine served: the current version, which pins it
            session.pinned = current
        return current

    def _check_budget(self, spent: _Spent) -> None:
        """Refuse a call of a session whose budget is spent, and mark the session truncated."""
        budget = self.config.budget
        over: tuple[str, str] | None = None
        if budget.max_turns is not None and spent.turns >= budget.max_turns:
            over = "max_turns", f"{spent.turns} calls answered, max_turns={budget.max_turns}"
        elif budget.max_tokens is not None and spent.tokens >= budget.max_tokens:
            over = "max_tokens", f"{spent.tokens} tokens sampled, max_tokens={budget.max_tokens}"
        elif budget.max_s is not None and time.monotonic() - spent.opened >= budget.max_s:
            over = "max_s", f"{time.monotonic() - spent.opened:.1f} s, max_s={budget.max_s:g}"
        if over is None:
            return
        spent.truncated = spent.truncated or over[0]
        raise ApiError(400, f"the episode's budget is spent: {over[1]}", code="budget_exceeded")

    def _record(
        self,
        session: Session,
        req: ChatRequest,
        plan: PromptPlan,
        ids: list[int],
        logprobs: list[float],
        parser: OutputParser,
        reason: str,
        version: int,
        adapter: tuple[str, int] | None,
        max_tokens: int,
        placement: Placement,
        routing: RoutingCapture | None,
        meta: dict[str, float],
    ) -> None:
        session_id = session.id
        if self.sessions.get(session_id) is not session:
            return  # closed or reopened while this call ran: its Turn belongs to no live run
        text, thinking = "".join(parser.text), "".join(parser.thinking)
        turn_index = session.commit(plan, ids, Generated(text, thinking, list(parser.calls)))
        if self.out is None:
            return
        arrived = meta.pop("arrived")
        turn = Turn(
            session=plan.sub.id,
            turn=turn_index,
            segment=plan.segment,
            segment_reason=plan.segment_reason,
            api=req.api,
            model=self.served_name,
            requested_model=req.model,
            policy_version=version,
            adapter=adapter[0] if adapter is not None else None,
            adapter_version=adapter[1] if adapter is not None else None,
            temperature=1.0 if req.temperature is None else req.temperature,
            requested_max_tokens=req.max_tokens,
            max_tokens=max_tokens,
            prompt_offset=plan.prompt_offset,
            prompt_delta=plan.prompt_delta,
            completion_ids=ids,
            completion_logprobs=logprobs,
            finish_reason=reason,
            output=TurnOutput(
                text=text,
                thinking=thinking or None,
                tool_calls=[
                    ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parser.calls
                ],
            ),
            flags=TurnFlags(
                aux=plan.sub.aux, realigned=plan.realigned, malformed_tool_call=parser.malformed
            ),
            parent_session=session_id if plan.sub.aux else None,
            timings={k: round(v, 6) for k, v in meta.items()},
            time=arrived,
            replica=placement.replica,
            failover=Failover(
                failed=list(placement.failed),
                reprefilled_tokens=placement.reprefilled_tokens,
                resumed_at=placement.resumed_at,
                stalled_s=round(placement.stalled_s, 6),
            )
            if placement.failed
            else None,
            routing=self._write_routing(session_id, routing, plan, ids),
        )
        writer = self._writers.pop(session_id, None)
        if writer is None:
            folder = self._session_out.get(session_id, self.out)
            writer = JsonlWriter(folder / f"{session_id}.jsonl")
            if len(self._writers) >= _OPEN_TURN_FILES:
                self._writers.pop(next(iter(self._writers))).close()  # least recently used
        self._writers[session_id] = writer
        writer.write(turn)

    def _write_routing(
        self, session_id: str, capture: RoutingCapture | None, plan: PromptPlan, ids: list[int]
    ) -> RoutingRef | None:
        """Append the call's routing to the session's sidecar; the Turn's reference to it."""
        if capture is None or capture.layout is None or self.out is None:
            return None
        prompt_len = plan.prompt_offset + len(plan.prompt_delta)
        # the last sampled token was never fed back: its routing comes with the next call
        rows = capture.rows(prompt_len + len(ids) - 1 if ids else prompt_len)
        name = f"{session_id}{ROUTING_SUFFIX}"
        with RoutingWriter(self.out / name, capture.layout) as writer:
            first, sha = writer.append(rows)
        return RoutingRef(file=name, row=first, rows=len(rows), start=capture.start, sha256=sha)


class _StopStrings:
    """Cuts streamed text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        if not self.stops or self.hit is not None:
            return "" if self.hit is not None else text
        buf = self.held + text
        cut = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if cut is not None:
            self.hit, self.held = cut[1], ""
            return buf[: cut[0]]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.hit is not None else held


def _check_id(sid: str, field: str = "") -> None:
    if not _SESSION_ID.match(sid):
        where = f"{field}: " if field else ""
        raise ApiError(
            400,
            f"{where}invalid session id {sid[:40]!r}: use letters, digits, . _ -",
            param=field or None,
        )


def _unknown(sid: str) -> ApiError:
    # One answer for "no such session" and "not yours": it tells a caller nothing it did not send.
    return ApiError(404, f"unknown session {sid!r}", kind="not_found_error")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


__all__ = ["CONTEXT_OVERFLOW", "Budget", "ProxyConfig", "ProxyCore", "Response", "TextDelta"]
