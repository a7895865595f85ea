"""Anthropic Messages wire: Claude Code-shaped requests parse into the right ``ChatRequest``, bad
ones get Anthropic's error shape, and the stream has the API's event structure. (The SDK reading
bodies and streams back: test_wire_sdk.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from legorl.proxy.chat import (
    ApiError,
    ChatRequest,
    Event,
    Finish,
    Message,
    StreamHead,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    Usage,
)
from legorl.proxy.wire import anthropic

DATA = Path(__file__).parent / "data"
BASE: dict[str, Any] = {"model": "claude-test", "max_tokens": 100}


def body(**fields: Any) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


def user(*blocks: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


def test_claude_code_request() -> None:
    raw = json.loads((DATA / "claude_code_messages.json").read_bytes())
    req = anthropic.parse_request((DATA / "claude_code_messages.json").read_bytes())
    assert (req.api, req.model, req.max_tokens, req.stream) == (
        "anthropic",
        "claude-sonnet-4-5",
        32000,
        True,
    )
    assert req.thinking  # adaptive
    assert [t.name for t in req.tools] == ["Bash", "Read", "Edit"]  # web_search is a server tool
    assert req.tools[0].parameters == raw["tools"][0]["input_schema"]
    # The billing-header block (metadata, not prompt) is dropped.
    system = "\n".join(b["text"] for b in raw["system"][1:])
    call_input = raw["messages"][2]["content"][3]["input"]
    assert req.messages == [
        Message(role="system", content=system),
        Message(
            role="user",
            content="<system-reminder>\nAs you answer the user's questions, you can use the "
            "following context.\n</system-reminder>\nFix the failing test in tests/test_geometry.py",
        ),
        Message(
            role="system",
            content="<system-reminder>The TodoWrite tool hasn't been used recently.</system-reminder>",
        ),
        Message(
            role="assistant",
            content="I'll run the tests.",
            reasoning="Run the test first to see the failure.",
            tool_calls=[
                ToolCall(
                    id="toolu_01A09q90qw90lq917835lq9",
                    name="Bash",
                    arguments=json.dumps(call_input, separators=(",", ":")),
                )
            ],
        ),
        Message(
            role="tool",
            content="F.\nFAILED tests/test_geometry.py::test_area - assert 11 == 12",
            tool_call_id="toolu_01A09q90qw90lq917835lq9",
            name="Bash",
            is_error=True,
        ),
        Message(role="user", content="<system-reminder>Keep going.</system-reminder>"),
    ]


def test_tool_results_come_before_the_rest_of_their_message() -> None:
    req = anthropic.parse_request(
        body(
            messages=user(
                {"type": "text", "text": "and also"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "one"},
                {"type": "tool_result", "tool_use_id": "toolu_2"},
            )
        )
    )
    assert [(m.role, m.content, m.tool_call_id) for m in req.messages] == [
        ("tool", "one", "toolu_1"),
        ("tool", "", "toolu_2"),
        ("user", "and also", None),
    ]
    assert not req.messages[0].is_error


@pytest.mark.parametrize(
    ("thinking", "wanted"),
    [
        (None, False),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking(thinking: Any, wanted: bool) -> None:
    req = anthropic.parse_request(body(messages=user(), thinking=thinking))
    assert req.thinking is wanted


@pytest.mark.parametrize(
    ("choice", "neutral"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
    ],
)
def test_tool_choice(choice: Any, neutral: Any) -> None:
    assert anthropic.parse_request(body(messages=user(), tool_choice=choice)).tool_choice == neutral


def test_sampling_fields() -> None:
    req = anthropic.parse_request(
        body(messages=user(), temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"])
    )
    assert (req.temperature, req.top_p, req.stop, req.stream) == (0.5, 0.9, ["END"], False)


def test_assistant_text_and_string_system() -> None:
    req = anthropic.parse_request(
        body(
            system="Be brief.",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
        )
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
        ("assistant", "hello"),
    ]


def test_count_tokens_needs_no_max_tokens() -> None:
    req = anthropic.count_tokens_request(
        json.dumps({"model": "claude-test", "messages": user(), "stream": True}).encode()
    )
    assert req.max_tokens is None and not req.stream
    assert json.loads(anthropic.count_tokens_body(42)) == {"input_tokens": 42}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b'{"model": "x",', "request body is not valid JSON", None),
        (b"[1, 2]", "request body: expected a JSON object", None),
        (
            json.dumps({"model": "m", "messages": []}).encode(),
            "max_tokens: field required",
            "max_tokens",
        ),
        (body(), "messages: field required", "messages"),
        (body(model=None, messages=[]), "model: field required", "model"),
        (body(messages=[], max_tokens="100"), "max_tokens: expected an integer", "max_tokens"),
        (body(messages=[], max_tokens=0), "max_tokens: must be at least 1", "max_tokens"),
        (body(messages={}), "messages: expected an array", "messages"),
        (
            body(messages=[{"role": "user", "content": 5}]),
            "messages[0].content: expected a string or a list of content blocks",
            "messages[0].content",
        ),
        (
            body(messages=[{"role": "user"}]),
            "messages[0].content: field required",
            "messages[0].content",
        ),
        (
            body(messages=[{"role": "tool", "content": "x"}]),
            "messages[0].role: unsupported role 'tool'",
            "messages[0].role",
        ),
        (
            body(messages=user(IMAGE)),
            "messages[0].content[0]: image content is not supported",
            "messages[0].content[0]",
        ),
        (
            body(messages=user({"type": "document", "source": {}})),
            "messages[0].content[0]: document content is not supported",
            "messages[0].content[0]",
        ),
        (
            body(messages=user({"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]})),
            "messages[0].content[0].content[0]: image content is not supported",
            "messages[0].content[0].content[0]",
        ),
        (
            body(messages=user({"type": "tool_result", "content": "x"})),
            "messages[0].content[0].tool_use_id: field required",
            "messages[0].content[0].tool_use_id",
        ),
        (
            body(messages=user({"type": "audio"})),
            "messages[0].content[0].type: unsupported content block type 'audio'",
            "messages[0].content[0].type",
        ),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "{}"}],
                    }
                ]
            ),
            "messages[0].content[0].input: expected an object",
            "messages[0].content[0].input",
        ),
        (
            body(messages=[], system=3),
            "system: expected a string or a list of text blocks",
            "system",
        ),
        (
            body(messages=[], tools=[{"name": "Bash"}]),
            "tools[0].input_schema: field required",
            "tools[0].input_schema",
        ),
        (body(messages=[], temperature="hot"), "temperature: expected a number", "temperature"),
        (body(messages=[], stream="yes"), "stream: expected a boolean", "stream"),
        (
            body(messages=[], stop_sequences="END"),
            "stop_sequences: expected an array",
            "stop_sequences",
        ),
        (
            body(messages=[], thinking={"type": "sometimes"}),
            "thinking.type: unsupported thinking type 'sometimes'",
            "thinking.type",
        ),
    ],
)
def test_bad_requests(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        anthropic.parse_request(raw)
    err = info.value
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(message)
    assert json.loads(anthropic.error_body(err)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": err.message},
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types_follow_the_status(status: int, kind: str) -> None:
    out = json.loads(anthropic.error_body(ApiError(status, "boom")))
    assert out == {"type": "error", "error": {"type": kind, "message": "boom"}}


async def _events(events: list[Event], fail: ApiError | None = None) -> AsyncIterator[Event]:
    for ev in events:
        yield ev
    if fail is not None:
        raise fail


def _sse(events: list[Event], fail: ApiError | None = None) -> list[tuple[str, Any]]:
    req = ChatRequest(api="anthropic", model="claude-test", messages=[], stream=True)

    async def run() -> bytes:
        chunks = anthropic.stream(
            _events(events, fail), req, StreamHead(id="msg_1", created=0, prompt_tokens=7)
        )
        return b"".join([c async for c in chunks])

    out = []
    for frame in asyncio.run(run()).decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_stop_sequence_and_usage() -> None:
    usage = Usage(prompt_tokens=7, completion_tokens=3)
    frames = _sse(
        [
            ThinkingDelta("hm"),
            TextDelta("ok"),
            Finish(reason="stop", usage=usage, stop_sequence="X"),
        ]
    )
    assert [name for name, _ in frames] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in frames)
    assert frames[0][1]["message"]["usage"]["input_tokens"] == 7
    assert frames[4][1]["delta"] == {
        "type": "signature_delta",
        "signature": anthropic.thinking_signature("hm"),
    }
    assert frames[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "X"}
    assert frames[-2][1]["usage"]["output_tokens"] == 3


def test_stream_error_after_headers_is_an_error_event() -> None:
    frames = _sse([TextDelta("partial")], fail=ApiError(529, "engine overloaded"))
    assert frames[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "engine overloaded"}},
    )


def test_claude_codes_billing_header_block_is_not_part_of_the_prompt() -> None:
    # Claude Code sends it to api.anthropic.com with a checksum that changes on every call.
    def body(checksum: str) -> bytes:
        return json.dumps(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 100,
                "system": [
                    {
                        "type": "text",
                        "text": f"x-anthropic-billing-header: cc_version=2.1; cch={checksum};",
                    },
                    {"type": "text", "text": "You are Claude Code."},
                ],
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()

    first = anthropic.parse_request(body("ad13f"))
    second = anthropic.parse_request(body("ce8db"))
    assert first.messages[0].content == "You are Claude Code."
    assert first.messages == second.messages
