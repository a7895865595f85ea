"""The official SDKs parse every body and stream the wire modules write.

A replay server (``ThreadingHTTPServer`` on 127.0.0.1, port 0) answers each SDK call the way the
proxy will: it parses the SDK's own request with the wire module, then serves a scripted event
sequence through ``response_body`` or ``stream``. The real ``openai`` and ``anthropic`` clients
then read it back, and what they parsed must match the script.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic as anthropic_sdk
import httpx
import openai
import pytest

from legorl.proxy.chat import (
    ApiError,
    ApiName,
    ChatRequest,
    Completion,
    Event,
    Finish,
    StreamHead,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallEvent,
    Usage,
)
from legorl.proxy.wire import WIRES, anthropic

ROUTES: dict[str, ApiName] = {
    "/v1/chat/completions": "openai_chat",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
}
CREATED = 1_764_500_000
USAGE = Usage(prompt_tokens=21, completion_tokens=9)
COUNTED_TOKENS = 1234

# ---- Scripts ------------------------------------------------------------------------------


def script(name: str, api: ApiName) -> list[Event]:
    """The core's events for one scenario, with tool-call ids in the API's own style."""

    def call(name: str, arguments: str) -> ToolCall:
        return ToolCall(id=WIRES[api].tool_call_id(), name=name, arguments=arguments)

    if name == "text":
        return [TextDelta("Hello"), TextDelta(", world."), Finish(reason="stop", usage=USAGE)]
    if name == "thinking_text":
        return [
            ThinkingDelta("The user greets me. "),
            ThinkingDelta("Greet back."),
            TextDelta("Hi there!"),
            Finish(reason="stop", usage=USAGE),
        ]
    if name == "thinking_tool":
        return [
            ThinkingDelta("Run the tests first."),
            ToolCallEvent(0, call("bash", '{"command": "pytest -q", "timeout": 60}')),
            Finish(reason="tool_calls", usage=USAGE),
        ]
    if name == "two_tools":
        return [
            TextDelta("Reading both files."),
            ToolCallEvent(0, call("read", '{"path": "a.py"}')),
            ToolCallEvent(1, call("read", '{"path": "b/ünï.py"}')),
            Finish(reason="tool_calls", usage=USAGE),
        ]
    if name == "length":
        return [TextDelta("This answer is cut"), Finish(reason="length", usage=USAGE)]
    raise KeyError(name)


SCRIPTS = ["text", "thinking_text", "thinking_tool", "two_tools", "length"]


@dataclass
class Answer:
    """What an SDK parsed, in neutral terms, to compare with the script."""

    text: str
    thinking: str
    calls: list[tuple[str, str, dict[str, Any]]]  # (id, name, parsed arguments)
    finish: str
    usage: tuple[int, int] | None  # (prompt, completion)


def expected(events: list[Event]) -> Answer:
    c = Completion.collect(events, id="x", model="x", created=CREATED)
    return Answer(
        text=c.text,
        thinking=c.thinking,
        calls=[(t.id, t.name, json.loads(t.arguments)) for t in c.tool_calls],
        finish=c.finish.reason,
        usage=(c.finish.usage.prompt_tokens, c.finish.usage.completion_tokens),
    )


# ---- The replay server --------------------------------------------------------------------


@dataclass
class Replay:
    url: str
    events: list[Event] = field(default_factory=list)
    requests: list[ChatRequest] = field(default_factory=list)


class _Server(ThreadingHTTPServer):
    replay: Replay


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        path = self.path.partition("?")[0]
        replay = self.server.replay
        if path == "/v1/messages/count_tokens":
            try:
                replay.requests.append(anthropic.count_tokens_request(body))
            except ApiError as err:
                self._send(err.status, anthropic.error_body(err))
                return
            self._send(200, anthropic.count_tokens_body(COUNTED_TOKENS))
            return
        api = ROUTES[path]
        wire = WIRES[api]
        try:
            req = wire.parse_request(body)
        except ApiError as err:
            self._send(err.status, wire.error_body(err))
            return
        replay.requests.append(req)
        rid = wire.response_id()
        if not req.stream:
            c = Completion.collect(replay.events, id=rid, model="tiny-qwen3", created=CREATED)
            self._send(200, wire.response_body(c, req))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        async def pump() -> None:
            async for chunk in wire.stream(
                _aiter(replay.events),
                req,
                StreamHead(id=rid, created=CREATED, prompt_tokens=USAGE.prompt_tokens),
            ):
                self.wfile.write(chunk)
                self.wfile.flush()

        asyncio.run(pump())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def _aiter(events: list[Event]) -> AsyncIterator[Event]:
    for ev in events:
        yield ev


@pytest.fixture(scope="module")
def replay() -> Iterator[Replay]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.replay = Replay(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.replay
    server.shutdown()
    server.server_close()


def _http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=10)


@pytest.fixture
def oai(replay: Replay) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{replay.url}/v1", api_key="x", max_retries=0, http_client=_http()
    ) as client:
        yield client


@pytest.fixture
def claude(replay: Replay) -> Iterator[anthropic_sdk.Anthropic]:
    with anthropic_sdk.Anthropic(
        base_url=replay.url, api_key="x", max_retries=0, http_client=_http()
    ) as client:
        yield client


# ---- OpenAI Chat --------------------------------------------------------------------------

CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
    for name in ("bash", "read")
]
CHAT_MESSAGES: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
]


def _chat_answer(message: Any, finish: str, usage: Any) -> Answer:
    return Answer(
        text=message.content or "",
        thinking=getattr(message, "reasoning_content", None) or "",
        calls=[
            (t.id, t.function.name, json.loads(t.function.arguments))
            for t in message.tool_calls or []
        ],
        finish=finish,
        usage=(usage.prompt_tokens, usage.completion_tokens),
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_openai_chat_body(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    replay.events = script(name, "openai_chat")
    r = oai.chat.completions.create(model="gpt-test", messages=CHAT_MESSAGES, tools=CHAT_TOOLS)
    assert r.model == "gpt-test" and r.object == "chat.completion"
    assert r.usage is not None and r.usage.total_tokens == 30
    choice = r.choices[0]
    assert _chat_answer(choice.message, choice.finish_reason, r.usage) == expected(replay.events)
    req = replay.requests[-1]
    assert [m.role for m in req.messages] == ["system", "user"]
    assert [t.name for t in req.tools] == ["bash", "read"] and not req.stream


@pytest.mark.parametrize("name", SCRIPTS)
def test_openai_chat_stream(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    replay.events = script(name, "openai_chat")
    chunks = list(
        oai.chat.completions.create(
            model="gpt-test",
            messages=CHAT_MESSAGES,
            tools=CHAT_TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert replay.requests[-1].include_usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.model == "gpt-test" and c.object == "chat.completion.chunk" for c in chunks)
    text, thinking, finish = [], [], None
    calls: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        delta = c.choices[0].delta
        text.append(delta.content or "")
        thinking.append(getattr(delta, "reasoning_content", None) or "")
        for t in delta.tool_calls or []:
            assert t.function is not None
            calls.setdefault(t.index, ["", "", ""])
            calls[t.index][0] += t.id or ""
            calls[t.index][1] += t.function.name or ""
            calls[t.index][2] += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    got = Answer(
        text="".join(text),
        thinking="".join(thinking),
        calls=[(i, n, json.loads(a)) for i, n, a in calls.values()],
        finish=finish or "",
        usage=(chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens),
    )
    assert got == expected(replay.events)


@pytest.mark.parametrize("name", SCRIPTS)
def test_openai_chat_stream_helper(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    """The SDK's accumulating helper rebuilds the same completion from the chunks. On a length
    finish it raises, with the completion attached, as it does against the real API."""
    replay.events = script(name, "openai_chat")
    with oai.chat.completions.stream(
        model="gpt-test",
        messages=CHAT_MESSAGES,
        tools=CHAT_TOOLS,
        stream_options={"include_usage": True},
    ) as s:
        try:
            r: Any = s.get_final_completion()
        except openai.LengthFinishReasonError as e:
            assert name == "length"
            r = e.completion
    choice = r.choices[0]
    assert _chat_answer(choice.message, choice.finish_reason, r.usage) == expected(replay.events)


def test_openai_chat_error_reaches_the_sdk(replay: Replay, oai: openai.OpenAI) -> None:
    image: Any = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.status_code == 400
    assert info.value.param == "messages[0].content[0]"
    assert info.value.type == "invalid_request_error"


# ---- Anthropic Messages -------------------------------------------------------------------

CLAUDE_TOOLS: Any = [
    {
        "name": name,
        "description": f"the {name} tool",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
    for name in ("bash", "read")
]
CLAUDE_MESSAGES: Any = [{"role": "user", "content": "hi"}]
STOP_REASONS = {"end_turn": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _claude_answer(m: Any) -> Answer:
    assert m.type == "message" and m.role == "assistant" and m.model == "claude-test"
    for block in m.content:
        if block.type == "thinking":
            assert block.signature == anthropic.thinking_signature(block.thinking)
    return Answer(
        text="".join(b.text for b in m.content if b.type == "text"),
        thinking="".join(b.thinking for b in m.content if b.type == "thinking"),
        calls=[(b.id, b.name, b.input) for b in m.content if b.type == "tool_use"],
        finish=STOP_REASONS[m.stop_reason],
        usage=(m.usage.input_tokens, m.usage.output_tokens),
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_anthropic_body(name: str, replay: Replay, claude: anthropic_sdk.Anthropic) -> None:
    replay.events = script(name, "anthropic")
    m = claude.messages.create(
        model="claude-test",
        max_tokens=1024,
        system="Be brief.",
        messages=CLAUDE_MESSAGES,
        tools=CLAUDE_TOOLS,
        thinking={"type": "enabled", "budget_tokens": 512},
    )
    assert _claude_answer(m) == expected(replay.events)
    req = replay.requests[-1]
    assert req.thinking and req.max_tokens == 1024 and not req.stream
    assert [m.role for m in req.messages] == ["system", "user"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_anthropic_stream_helper(
    name: str, replay: Replay, claude: anthropic_sdk.Anthropic
) -> None:
    replay.events = script(name, "anthropic")
    with claude.messages.stream(
        model="claude-test", max_tokens=64000, messages=CLAUDE_MESSAGES, tools=CLAUDE_TOOLS
    ) as s:
        text = "".join(s.text_stream)
        m = s.get_final_message()
    assert text == expected(replay.events).text
    assert _claude_answer(m) == expected(replay.events)
    assert replay.requests[-1].stream


@pytest.mark.parametrize("name", SCRIPTS)
def test_anthropic_raw_stream(name: str, replay: Replay, claude: anthropic_sdk.Anthropic) -> None:
    """``stream=True`` yields the typed raw events in the order the API sends them."""
    replay.events = script(name, "anthropic")
    events = list(
        claude.messages.create(
            model="claude-test", max_tokens=1024, messages=CLAUDE_MESSAGES, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    assert events[0].message.usage.input_tokens == USAGE.prompt_tokens  # type: ignore[union-attr]
    open_block = None
    for e in events:
        if e.type == "content_block_start":
            assert open_block is None
            open_block = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_block
        elif e.type == "content_block_stop":
            assert e.index == open_block
            open_block = None
    if "thinking" in name:  # block 0 is the thinking; its signature comes last, before the stop
        deltas = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
        assert set(deltas[:-1]) == {"thinking_delta"} and deltas[-1] == "signature_delta"


def test_anthropic_count_tokens(replay: Replay, claude: anthropic_sdk.Anthropic) -> None:
    n = claude.messages.count_tokens(
        model="claude-test", system="Be brief.", messages=CLAUDE_MESSAGES, tools=CLAUDE_TOOLS
    )
    assert n.input_tokens == COUNTED_TOKENS
    req = replay.requests[-1]
    assert req.max_tokens is None and [t.name for t in req.tools] == ["bash", "read"]


def test_anthropic_error_reaches_the_sdk(replay: Replay, claude: anthropic_sdk.Anthropic) -> None:
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "A"},
    }
    with pytest.raises(anthropic_sdk.BadRequestError) as info:
        claude.messages.create(
            model="claude-test", max_tokens=10, messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.status_code == 400
    assert info.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0]: image content is not supported",
        },
    }


# ---- OpenAI Responses ---------------------------------------------------------------------

RESPONSES_TOOLS: Any = [
    {
        "type": "function",
        "name": name,
        "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        "strict": False,
    }
    for name in ("bash", "read")
]


def _responses_answer(r: Any) -> Answer:
    assert r.object == "response" and r.model == "gpt-test"
    calls = [
        (o.call_id, o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"
    ]
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        finish = "length"
    else:
        assert r.status == "completed" and r.incomplete_details is None
        finish = "tool_calls" if calls else "stop"
    return Answer(
        text=r.output_text,
        thinking="".join(
            c.text for o in r.output if o.type == "reasoning" for c in o.content or []
        ),
        calls=calls,
        finish=finish,
        usage=(r.usage.input_tokens, r.usage.output_tokens),
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_responses_body(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    replay.events = script(name, "responses")
    r = oai.responses.create(
        model="gpt-test", instructions="Be brief.", input="hi", tools=RESPONSES_TOOLS
    )
    assert _responses_answer(r) == expected(replay.events)
    assert r.usage is not None and r.usage.total_tokens == 30
    assert [t.name for t in r.tools] == ["bash", "read"]  # type: ignore[union-attr]
    req = replay.requests[-1]
    assert [m.role for m in req.messages] == ["system", "user"] and not req.stream


@pytest.mark.parametrize("name", SCRIPTS)
def test_responses_stream(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    replay.events = script(name, "responses")
    events = list(
        oai.responses.create(model="gpt-test", input="hi", tools=RESPONSES_TOOLS, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type == ("response.incomplete" if name == "length" else "response.completed")
    r = final.response
    assert _responses_answer(r) == expected(replay.events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == expected(replay.events).thinking
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [o.model_dump() for o in r.output]


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s != "length"])
def test_responses_stream_helper(name: str, replay: Replay, oai: openai.OpenAI) -> None:
    """The SDK's accumulating helper follows the items; it needs ``response.completed``, which
    the API (and so the wire) replaces with ``response.incomplete`` when the limit cuts."""
    replay.events = script(name, "responses")
    with oai.responses.stream(model="gpt-test", input="hi", tools=RESPONSES_TOOLS) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        r = s.get_final_response()
    assert text == r.output_text
    assert _responses_answer(r) == expected(replay.events)


def test_responses_custom_tool_call_reaches_the_sdk(replay: Replay, oai: openai.OpenAI) -> None:
    """A call to a custom (freeform) tool, as Codex's apply_patch is: the SDK reads the item and
    its input events, and the input is the free text the model wrote."""
    patch = "*** Begin Patch\n*** Add File: ünï.txt\n+hi\n*** End Patch\n"
    tools: Any = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch."}]
    call = ToolCall(id="call_c1", name="apply_patch", arguments=json.dumps({"input": patch}))
    replay.events = [ToolCallEvent(0, call), Finish(reason="tool_calls", usage=USAGE)]
    r = oai.responses.create(model="gpt-test", input="hi", tools=tools)
    (item,) = r.output
    assert (item.type, item.call_id, item.name, item.input) == (  # type: ignore[union-attr]
        "custom_tool_call",
        "call_c1",
        "apply_patch",
        patch,
    )
    assert r.tools[0].type == "custom"
    events = list(oai.responses.create(model="gpt-test", input="hi", tools=tools, stream=True))
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done.input == patch
    assert events[-1].type == "response.completed"
    streamed = events[-1].response.output[0].model_dump()
    assert {**streamed, "id": None} == {**item.model_dump(), "id": None}  # ids are per response


def test_responses_error_reaches_the_sdk(replay: Replay, oai: openai.OpenAI) -> None:
    image: Any = {
        "type": "input_image",
        "image_url": "data:image/png;base64,AAAA",
        "detail": "auto",
    }
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="gpt-test", input=[{"role": "user", "content": [image]}])
    assert info.value.param == "input[0].content[0]"


# ---- Every wire ---------------------------------------------------------------------------


@pytest.mark.parametrize("api", list(WIRES))
def test_stream_yields_as_events_arrive(api: ApiName) -> None:
    """Bytes for an event go out before the next event exists: nothing waits for the end."""

    async def run() -> None:
        queue: asyncio.Queue[Event | None] = asyncio.Queue()

        async def events() -> AsyncIterator[Event]:
            while (ev := await queue.get()) is not None:
                yield ev

        req = ChatRequest(api=api, model="m", messages=[], stream=True)
        out = WIRES[api].stream(
            events(), req, StreamHead(id="resp_1", created=CREATED, prompt_tokens=3)
        )
        await queue.put(TextDelta("first-piece"))
        seen = b""
        while b"first-piece" not in seen:
            seen += await asyncio.wait_for(anext(out), 1)
        assert b"second-piece" not in seen
        await queue.put(TextDelta("second-piece"))
        await queue.put(Finish(reason="stop", usage=USAGE))
        await queue.put(None)
        rest = b"".join([chunk async for chunk in out])
        assert b"second-piece" in rest

    asyncio.run(run())


@pytest.mark.parametrize("api", list(WIRES))
def test_tool_call_ids_are_fresh_and_styled(api: ApiName) -> None:
    prefix = {
        "openai_chat": "call_",
        "anthropic": "toolu_",
        "responses": "call_",
        "gemini": "call_",
    }[api]
    ids = {WIRES[api].tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith(prefix) for i in ids)
