"""OpenAI Responses wire: Codex-shaped requests parse into the right ``ChatRequest``, bad ones get
OpenAI's error shape, and the response object and events have the API's fields. (The SDK reading
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
    ToolCallEvent,
    Usage,
)
from legorl.proxy.wire import responses

DATA = Path(__file__).parent / "data"
# A turn-2 body Codex CLI 0.169 really sent, its prose trimmed; the bench replays it too.
CODEX_0169 = Path(responses.__file__).parents[2] / "bench" / "data" / "codex_0169_turn2.json"


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-test", **fields}).encode()


def text_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def call_item(call_id: str, name: str = "shell") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def test_codex_request() -> None:
    raw = json.loads((DATA / "codex_responses.json").read_bytes())
    req = responses.parse_request((DATA / "codex_responses.json").read_bytes())
    assert (req.api, req.model, req.stream, req.tool_choice) == (
        "responses",
        "tiny-qwen3",
        True,
        "auto",
    )
    # The custom (freeform) tool is one string parameter; the hosted web_search is dropped.
    assert [t.name for t in req.tools] == ["shell", "update_plan", "apply_patch"]
    assert req.tools[0].parameters == raw["tools"][0]["parameters"]
    assert req.tools[2].parameters["properties"]["input"]["type"] == "string"
    assert req.tools[2].parameters["required"] == ["input"]
    assert req.metadata["custom_tools"] == ["apply_patch"]
    assert req.metadata["parallel_tool_calls"] is False
    call = raw["input"][5]
    assert req.messages == [
        Message(role="system", content=raw["instructions"]),
        Message(role="system", content=raw["input"][0]["content"][0]["text"]),
        Message(role="user", content=raw["input"][1]["content"][0]["text"]),
        Message(role="user", content="Fix the failing test in tests/test_geometry.py"),
        Message(
            role="assistant",
            content="Running the tests.",
            reasoning="Run the tests to see what fails.",  # the text, not the summary
            tool_calls=[ToolCall(id=call["call_id"], name="shell", arguments=call["arguments"])],
        ),
        Message(
            role="tool",
            content=raw["input"][6]["output"],
            tool_call_id=call["call_id"],
            name="shell",
        ),
    ]


def test_string_input_and_limits() -> None:
    req = responses.parse_request(
        body(input="hi", max_output_tokens=64, temperature=0.2, top_p=0.5, store=False)
    )
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]
    assert (req.max_tokens, req.temperature, req.top_p, req.stream) == (64, 0.2, 0.5, False)


def test_function_calls_join_their_assistant_turn() -> None:
    req = responses.parse_request(
        body(
            input=[
                text_item("user", "go"),
                reasoning_item("plan A"),
                call_item("call_1"),
                call_item("call_2", "read"),
                {"type": "function_call_output", "call_id": "call_1", "output": "a"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "b"}],
                },
                reasoning_item("plan B"),
                text_item("assistant", "done"),
                {"role": "user", "content": "thanks"},  # an easy message: no type
            ]
        )
    )
    assert [(m.role, m.content, m.reasoning) for m in req.messages] == [
        ("user", "go", None),
        ("assistant", "", "plan A"),
        ("tool", "a", None),
        ("tool", "b", None),
        ("assistant", "done", "plan B"),
        ("user", "thanks", None),
    ]
    assert [c.id for c in req.messages[1].tool_calls] == ["call_1", "call_2"]
    assert [m.name for m in req.messages[2:4]] == ["shell", "read"]


def test_tool_choice_is_neutral() -> None:
    req = responses.parse_request(
        body(input="x", tool_choice={"type": "function", "name": "shell"})
    )
    assert req.tool_choice == {"type": "function", "function": {"name": "shell"}}


IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b"{", "request body is not valid JSON", None),
        (b"null", "request body: expected a JSON object", None),
        (json.dumps({"input": "x"}).encode(), "model: field required", "model"),
        (body(), "input: field required", "input"),
        (body(input=5), "input: expected a string or a list of input items", "input"),
        (body(input=[5]), "input[0]: expected an object", "input[0]"),
        (body(input=[{"content": "x"}]), "input[0].type: field required", "input[0].type"),
        (
            body(input=[{"type": "message", "role": "user", "content": [IMAGE]}]),
            "input[0].content[0]: image content is not supported",
            "input[0].content[0]",
        ),
        (
            body(input=[{"type": "message", "role": "user", "content": 3}]),
            "input[0].content: expected a string or a list of content parts",
            "input[0].content",
        ),
        (
            body(input=[{"type": "message", "role": "tool", "content": "x"}]),
            "input[0].role: unsupported role 'tool'",
            "input[0].role",
        ),
        (
            body(input=[{"type": "function_call", "name": "shell", "arguments": "{}"}]),
            "input[0].call_id: field required",
            "input[0].call_id",
        ),
        (
            body(input=[{"type": "function_call_output", "call_id": "c"}]),
            "input[0].output: field required",
            "input[0].output",
        ),
        (
            body(input=[{"type": "computer_call", "call_id": "c"}]),
            "input[0].type: unsupported input item type 'computer_call'",
            "input[0].type",
        ),
        (
            body(input="x", max_output_tokens="many"),
            "max_output_tokens: expected an integer",
            "max_output_tokens",
        ),
        (
            body(input="x", tools=[{"name": "shell"}]),
            "tools[0].type: field required",
            "tools[0].type",
        ),
        (
            body(input="x", tools=[{"type": "function"}]),
            "tools[0].name: field required",
            "tools[0].name",
        ),
    ],
)
def test_bad_requests(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        responses.parse_request(raw)
    err = info.value
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(message)
    assert json.loads(responses.error_body(err)) == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


def test_length_cut_is_incomplete() -> None:
    req = responses.parse_request(body(input="hi", instructions="Be brief.", max_output_tokens=5))
    c = Completion(
        id="resp_abc",
        model="tiny",
        created=9,
        text="cut sh",
        finish=Finish(reason="length", usage=Usage(prompt_tokens=3, completion_tokens=5)),
    )
    out = json.loads(responses.response_body(c, req))
    assert (out["object"], out["status"], out["model"]) == ("response", "incomplete", "gpt-test")
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (out["instructions"], out["max_output_tokens"], out["created_at"]) == ("Be brief.", 5, 9)
    assert out["output"] == [
        {
            "id": "msg_abc00",
            "type": "message",
            "status": "incomplete",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "cut sh", "annotations": [], "logprobs": []}
            ],
        }
    ]
    assert out["usage"]["total_tokens"] == 8


async def _events(events: list[Event], fail: ApiError) -> AsyncIterator[Event]:
    for ev in events:
        yield ev
    raise fail


def test_stream_error_after_headers_is_an_error_event() -> None:
    req = ChatRequest(api="responses", model="gpt-test", messages=[], stream=True)

    async def run() -> bytes:
        chunks = responses.stream(
            _events([TextDelta("par")], ApiError(500, "engine died")),
            req,
            StreamHead(id="resp_1", created=0, prompt_tokens=1),
        )
        return b"".join([c async for c in chunks])

    last = asyncio.run(run()).decode().split("\n\n")[-2]
    name, data = last.split("\n")
    assert name == "event: error"
    frame = json.loads(data.removeprefix("data: "))
    assert frame == {
        "type": "error",
        "sequence_number": frame["sequence_number"],
        "code": None,
        "message": "engine died",
        "param": None,
    }


def test_codex_0169_captured_request() -> None:
    """A turn-2 body Codex CLI 0.169 sent to `legorl proxy serve` (its prose trimmed)."""
    raw = json.loads(CODEX_0169.read_bytes())
    assert (raw["store"], raw["stream"], raw["include"]) == (
        False,
        True,
        ["reasoning.encrypted_content"],
    )
    assert "previous_response_id" not in raw and "instructions" not in raw
    req = responses.parse_request(CODEX_0169.read_bytes())
    # The namespace of sub-agent tools is dropped; the four functions stay.
    assert [t.name for t in req.tools] == [
        "exec_command",
        "write_stdin",
        "request_user_input",
        "view_image",
    ]
    assert [m.role for m in req.messages] == [
        "system",
        "system",
        "user",
        "user",
        "assistant",
        "tool",
    ]
    reasoning, call, output = raw["input"][4:]
    assistant, tool = req.messages[4:]
    assert assistant.reasoning == reasoning["content"][0]["text"]
    assert assistant.tool_calls == [
        ToolCall(id=call["call_id"], name="exec_command", arguments=call["arguments"])
    ]
    assert (tool.tool_call_id, tool.name, tool.content) == (
        call["call_id"],
        "exec_command",
        output["output"],
    )


CUSTOM_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"},
}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"


def test_custom_tool_calls_are_free_text_both_ways() -> None:
    req = responses.parse_request(
        body(
            input=[
                text_item("user", "add a file"),
                {
                    "type": "custom_tool_call",
                    "call_id": "c1",
                    "name": "apply_patch",
                    "input": PATCH,
                },
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
            ],
            tools=[CUSTOM_TOOL],
            stream=True,
        )
    )
    assert (
        "lark grammar:\nstart: patch"
        in req.tools[0].parameters["properties"]["input"]["description"]
    )
    (call,) = req.messages[1].tool_calls
    assert json.loads(call.arguments) == {"input": PATCH}
    assert (req.messages[2].role, req.messages[2].name, req.messages[2].content) == (
        "tool",
        "apply_patch",
        "Done",
    )
    # The model's call comes back as a custom_tool_call whose input is the free text.
    sampled = ToolCall(id="call_9", name="apply_patch", arguments=json.dumps({"input": PATCH}))
    c = Completion(
        id="resp_abc",
        model="tiny",
        created=0,
        tool_calls=[sampled],
        finish=Finish(reason="tool_calls", usage=Usage(prompt_tokens=3, completion_tokens=5)),
    )
    out = json.loads(responses.response_body(c, req))
    assert out["output"] == [
        {
            "id": "fc_abc00",
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "call_9",
            "name": "apply_patch",
            "input": PATCH,
        }
    ]
    assert out["tools"] == [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
    ]

    async def run() -> list[dict[str, Any]]:
        async def events() -> AsyncIterator[Event]:
            yield ToolCallEvent(0, sampled)
            yield c.finish

        chunks = responses.stream(
            events(), req, StreamHead(id="resp_abc", created=0, prompt_tokens=3)
        )
        frames = b"".join([ch async for ch in chunks]).decode().split("\n\n")
        return [json.loads(f.split("\ndata: ", 1)[1]) for f in frames if f]

    frames = asyncio.run(run())
    assert [f["type"] for f in frames] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert frames[3]["delta"] == PATCH and frames[4]["input"] == PATCH
    assert frames[2]["item"]["input"] == "" and frames[5]["item"]["input"] == PATCH


def test_unknown_previous_response_id_is_a_clear_400() -> None:
    with pytest.raises(ApiError) as info:
        responses.parse_request(body(input="x", previous_response_id="resp_never"))
    err = info.value
    assert (err.status, err.param, err.code) == (
        400,
        "previous_response_id",
        "previous_response_not_found",
    )
    assert json.loads(responses.error_body(err)) == {
        "error": {
            "message": "previous response 'resp_never' was not made by this proxy (it stores no "
            "responses): send the whole conversation as input",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    }


def test_custom_tool_history_keeps_the_raw_tokens(tmp_path: Path) -> None:
    """Through the real core: a custom tool call sent back as free text (no JSON, as Codex
    sends it) is recognised by its call id, so the next prompt reuses the sampled tokens."""
    import httpx
    from proxy_harness import running_proxy, tokenizer

    from legorl.records import segment_prompts

    sampled = f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': PATCH}})}"
    script = [{"text": sampled + "\n</tool_call>"}, {"text": "Patched."}]
    system = {"type": "message", "role": "developer", "content": "You are a coding agent."}
    first_input = [system, text_item("user", "add a file")]
    with running_proxy(tmp_path, script) as proxy:
        url = f"{proxy.url}/s/cx/v1/responses"
        first = httpx.post(url, json={"model": "m", "input": first_input, "tools": [CUSTOM_TOOL]})
        assert first.status_code == 200, first.text
        (item,) = first.json()["output"]
        assert (item["type"], item["input"]) == ("custom_tool_call", PATCH)
        history = [
            *first_input,
            {k: item[k] for k in ("type", "call_id", "name", "input")},
            {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "Done!"},
        ]
        second = httpx.post(url, json={"model": "m", "input": history, "tools": [CUSTOM_TOOL]})
        assert second.status_code == 200, second.text
        assert second.json()["output"][0]["content"][0]["text"] == "Patched."
        turns = proxy.turns("cx")
    tok = tokenizer()
    assert turns[0].completion_ids == tok.encode(script[0]["text"]) + [tok.eos_id]
    assert [t.segment for t in turns] == [0, 0]
    (_, p0), (_, p1) = segment_prompts(turns)
    raw = p0 + turns[0].completion_ids
    assert p1[: len(raw)] == raw and turns[1].prompt_offset == len(raw)


def test_unknown_previous_response_id_through_the_proxy(tmp_path: Path) -> None:
    import httpx
    from proxy_harness import running_proxy

    with running_proxy(tmp_path, [{"text": "ok", "repeat": True}]) as proxy:
        url = f"{proxy.url}/s/cx/v1/responses"
        refused = httpx.post(url, json={"model": "m", "input": "hi", "previous_response_id": "r1"})
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "previous_response_not_found"
        # The proxy is not hurt: the same session answers the whole conversation next.
        ok = httpx.post(url, json={"model": "m", "input": "hi"})
        assert ok.status_code == 200 and ok.json()["status"] == "completed"
        assert len(proxy.turns("cx")) == 1  # the refused call recorded nothing
