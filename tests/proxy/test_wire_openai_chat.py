"""OpenAI Chat wire: OpenCode- and OpenHands-shaped requests parse into the right ``ChatRequest``,
bad ones get OpenAI's error shape, and bodies and chunks have the API's fields. (The SDK reading
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
    Completion,
    Event,
    Finish,
    Message,
    StreamHead,
    TextDelta,
    ToolCall,
    Usage,
)
from legorl.proxy.wire import openai_chat

DATA = Path(__file__).parent / "data"
USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-test", **fields}).encode()


def test_opencode_request() -> None:
    raw = json.loads((DATA / "opencode_chat.json").read_bytes())
    req = openai_chat.parse_request((DATA / "opencode_chat.json").read_bytes())
    assert (req.api, req.model, req.stream, req.include_usage) == (
        "openai_chat",
        "legorl/tiny-qwen3",
        True,
        True,
    )
    assert (req.max_tokens, req.temperature, req.tool_choice) == (32000, 0.0, "auto")
    assert [t.name for t in req.tools] == ["bash", "read"]
    assert req.tools[0].parameters == raw["tools"][0]["function"]["parameters"]
    call = raw["messages"][2]["tool_calls"][0]
    assert req.messages == [
        Message(role="system", content=raw["messages"][0]["content"]),
        Message(role="user", content="Fix the failing test in tests/test_geometry.py"),
        Message(
            role="assistant",
            content="",
            reasoning="I should look at the test first.",
            tool_calls=[
                ToolCall(id=call["id"], name="bash", arguments=call["function"]["arguments"])
            ],
        ),
        Message(
            role="tool",
            content="F.\nFAILED tests/test_geometry.py::test_area - assert 11 == 12",
            tool_call_id=call["id"],
        ),
    ]


def test_openhands_request() -> None:
    req = openai_chat.parse_request((DATA / "openhands_chat.json").read_bytes())
    assert (req.stream, req.include_usage, req.max_tokens, req.top_p) == (False, False, 8192, 1.0)
    assert [t.name for t in req.tools] == ["terminal", "file_editor", "finish", "think"]
    assert [(m.role, m.content) for m in req.messages] == [
        (
            "system",
            "You are OpenHands agent, a helpful AI assistant that can interact with a computer "
            "to solve tasks.",
        ),
        (
            "user",
            "Fix the failing test in tests/test_geometry.py\n"
            "<RUNTIME_INFORMATION>working dir /workspace</RUNTIME_INFORMATION>",
        ),
        ("assistant", "Let me run the tests."),
        ("tool", "1 failed, 1 passed"),
    ]
    assert req.messages[2].tool_calls[0].arguments == (
        '{"command": "pytest -q", "is_input": false, "security_risk": "LOW"}'
    )
    assert req.messages[3].name == "terminal"


def test_roles_stop_seed_and_choice() -> None:
    req = openai_chat.parse_request(
        body(
            messages=[
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "reasoning": "thought"},
            ],
            stop="END",
            seed=7,
            n=1,
            max_tokens=50,
            tool_choice={"type": "function", "function": {"name": "bash"}},
            stream_options={"include_usage": True},  # without stream: no usage chunk
        )
    )
    assert [(m.role, m.content, m.reasoning) for m in req.messages] == [
        ("system", "rules", None),
        ("user", "hi", None),
        ("assistant", "", "thought"),
    ]
    assert (req.stop, req.seed, req.max_tokens, req.include_usage) == (["END"], 7, 50, False)
    assert req.tool_choice == {"type": "function", "function": {"name": "bash"}}
    assert openai_chat.parse_request(body(messages=USER, stop=["a", "b"])).stop == ["a", "b"]


def test_non_function_tools_are_dropped() -> None:
    custom = {"type": "custom", "custom": {"name": "apply_patch"}}
    fn = {"type": "function", "function": {"name": "bash"}}
    req = openai_chat.parse_request(body(messages=USER, tools=[custom, fn]))
    assert [(t.name, t.description, t.parameters) for t in req.tools] == [("bash", "", {})]


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b"{nope", "request body is not valid JSON", None),
        (b'"a string"', "request body: expected a JSON object", None),
        (json.dumps({"messages": USER}).encode(), "model: field required", "model"),
        (body(model=3, messages=USER), "model: expected a string", "model"),
        (body(), "messages: field required", "messages"),
        (body(messages="hi"), "messages: expected an array", "messages"),
        (body(messages=[]), "messages: must contain at least one message", "messages"),
        (body(messages=["hi"]), "messages[0]: expected an object", "messages[0]"),
        (body(messages=[{"content": "x"}]), "messages[0].role: field required", "messages[0].role"),
        (
            body(messages=[{"role": "function", "content": "x"}]),
            "messages[0].role: unsupported role 'function'",
            "messages[0].role",
        ),
        (
            body(messages=[*USER, {"role": "user", "content": 5}]),
            "messages[1].content: expected a string or a list of content blocks",
            "messages[1].content",
        ),
        (
            body(messages=[{"role": "user"}]),
            "messages[0].content: field required",
            "messages[0].content",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}]),
            "messages[0].content[1]: image content is not supported",
            "messages[0].content[1]",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "video"}]}]),
            "messages[0].content[0].type: unsupported content part type 'video'",
            "messages[0].content[0].type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
            "messages[0].content[0].text: expected a string",
            "messages[0].content[0].text",
        ),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": {}},
                            }
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].function.arguments: expected a string",
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            body(messages=[{"role": "tool", "content": "out"}]),
            "messages[0].tool_call_id: field required",
            "messages[0].tool_call_id",
        ),
        (body(messages=USER, n=2), "n: only n=1 is supported", "n"),
        (body(messages=USER, max_tokens=0), "max_tokens: must be at least 1", "max_tokens"),
        (
            body(messages=USER, max_completion_tokens=1.5),
            "max_completion_tokens: expected an integer",
            "max_completion_tokens",
        ),
        (body(messages=USER, temperature="0"), "temperature: expected a number", "temperature"),
        (body(messages=USER, stop=5), "stop: expected a string or an array of strings", "stop"),
        (body(messages=USER, stream=1), "stream: expected a boolean", "stream"),
        (
            body(messages=USER, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage: expected a boolean",
            "stream_options.include_usage",
        ),
        (body(messages=USER, tools={}), "tools: expected an array", "tools"),
        (
            body(messages=USER, tools=[{"type": "function", "function": {}}]),
            "tools[0].function.name: field required",
            "tools[0].function.name",
        ),
        (body(messages=USER, tool_choice="always"), "tool_choice: expected", "tool_choice"),
    ],
)
def test_bad_requests(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        openai_chat.parse_request(raw)
    err = info.value
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(message)
    assert json.loads(openai_chat.error_body(err)) == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


def test_server_errors_are_server_error() -> None:
    out = json.loads(openai_chat.error_body(ApiError(503, "engine busy", code="busy")))
    assert out == {
        "error": {"message": "engine busy", "type": "server_error", "param": None, "code": "busy"}
    }


def test_tool_call_only_answer_has_null_content() -> None:
    req = openai_chat.parse_request(body(messages=USER))
    c = Completion(
        id="chatcmpl-1",
        model="tiny",
        created=5,
        tool_calls=[ToolCall(id="call_1", name="bash", arguments='{"command": "ls"}')],
        finish=Finish(reason="tool_calls", usage=Usage(prompt_tokens=4, completion_tokens=6)),
    )
    out = json.loads(openai_chat.response_body(c, req))
    assert out["model"] == "gpt-test"  # the name the harness asked for, not the engine's
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


async def _events(events: list[Event], fail: ApiError | None = None) -> AsyncIterator[Event]:
    for ev in events:
        yield ev
    if fail is not None:
        raise fail


def _frames(req: ChatRequest, events: list[Event], fail: ApiError | None = None) -> list[str]:
    async def run() -> bytes:
        chunks = openai_chat.stream(
            _events(events, fail), req, StreamHead(id="chatcmpl-1", created=5, prompt_tokens=4)
        )
        return b"".join([c async for c in chunks])

    frames = asyncio.run(run()).decode().split("\n\n")
    assert frames[-1] == ""
    return [f.removeprefix("data: ") for f in frames[:-1]]


def test_stream_without_usage_ends_with_finish_then_done() -> None:
    req = ChatRequest(api="openai_chat", model="gpt-test", messages=[], stream=True)
    usage = Usage(prompt_tokens=4, completion_tokens=1)
    frames = _frames(req, [TextDelta("hi"), Finish(reason="length", usage=usage)])
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_stream_error_after_headers_is_an_error_chunk() -> None:
    req = ChatRequest(api="openai_chat", model="gpt-test", messages=[], stream=True)
    frames = _frames(req, [TextDelta("par")], fail=ApiError(500, "engine died"))
    assert json.loads(frames[-1]) == {
        "error": {"message": "engine died", "type": "server_error", "param": None, "code": None}
    }
