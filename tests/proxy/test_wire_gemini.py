"""Gemini wire: Gemini CLI's real request (captured from 0.61.0) parses into the right
``ChatRequest``, bad ones get Google's error shape naming the field, and the responses, the
``alt=sse`` chunks and the JSON-array stream have the API's fields; served over real HTTP by
the proxy at ``/s/{session}/v1beta/models/{model}:…``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy_harness import running_proxy, tokenizer

from legorl.proxy.chat import (
    ApiError,
    ChatRequest,
    Completion,
    Event,
    Finish,
    Message,
    StreamHead,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallEvent,
    Usage,
)
from legorl.proxy.wire import gemini

DATA = Path(__file__).parent / "data"


def body(contents: list[dict[str, Any]] | None = None, **fields: Any) -> bytes:
    if contents is None:
        contents = [user("hi")]
    return json.dumps({"contents": contents, **fields}).encode()


def user(*texts: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": t} for t in texts]}


def test_gemini_cli_request() -> None:
    raw = json.loads((DATA / "gemini_cli_generate.json").read_bytes())
    req = gemini.parse_request(
        (DATA / "gemini_cli_generate.json").read_bytes(), model="gemini-2.5-pro", stream=True
    )
    assert (req.api, req.model, req.stream, req.thinking) == (
        "gemini",
        "gemini-2.5-pro",
        True,
        True,
    )
    assert (req.temperature, req.top_p, req.max_tokens) == (1.0, 0.95, None)
    assert len(req.tools) == 16 and "run_shell_command" in [t.name for t in req.tools]
    decl = raw["tools"][0]["functionDeclarations"][0]
    assert req.tools[0].parameters == decl["parametersJsonSchema"]
    system, first, model, result = req.messages
    assert system == Message(role="system", content=raw["systemInstruction"]["parts"][0]["text"])
    context, prompt = (p["text"] for p in raw["contents"][0]["parts"])
    assert first == Message(role="user", content=f"{context}\n{prompt}")
    assert model.tool_calls == [
        ToolCall(
            id="call_1",
            name="run_shell_command",
            arguments='{"command":"echo hi > x.txt"}',
        )
    ]
    output = raw["contents"][2]["parts"][0]["functionResponse"]["response"]["output"]
    assert result == Message(
        role="tool", content=output, tool_call_id="call_1", name="run_shell_command"
    )


def test_model_turns_thoughts_and_metadata() -> None:
    contents = [
        user("go"),
        {
            "role": "model",
            "parts": [
                {"text": "let me ", "thought": True},
                {"text": "think", "thought": True},
                {"text": "I will "},
                {"text": "run it."},
                {"functionCall": {"name": "shell", "args": {"c": 1}}, "thoughtSignature": "x"},
                {"thoughtSignature": "only metadata: nothing to read"},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "shell", "response": {"error": "boom"}}},
                {"text": "and?"},
            ],
        },
        {
            "role": "model",
            "parts": [{"functionCall": {"name": "shell", "args": {}, "id": "a"}}],
        },
        {
            "role": "user",
            "parts": [{"functionResponse": {"name": "shell", "response": {"rc": 0}, "id": "a"}}],
        },
    ]
    msgs = gemini.parse_request(body(contents)).messages
    assert msgs[1].reasoning == "let me think" and msgs[1].content == "I will run it."
    # No id from the harness: one made from name and position, and its response is paired to it.
    assert msgs[1].tool_calls == [ToolCall(id="shell-1-4", name="shell", arguments='{"c":1}')]
    assert msgs[2] == Message(
        role="tool", content="boom", tool_call_id="shell-1-4", name="shell", is_error=True
    )
    assert msgs[3] == Message(role="user", content="and?")
    assert msgs[5].content == '{"rc":0}' and msgs[5].tool_call_id == "a"


def test_google_schema_becomes_json_schema() -> None:
    decl = {
        "name": "edit",
        "description": "edit a file",
        "parameters": {
            "type": "OBJECT",
            "properties": {
                "type": {"type": "STRING", "enum": ["a", "b"]},
                "lines": {"type": "ARRAY", "items": {"type": "INTEGER"}},
            },
            "required": ["type"],
        },
    }
    tools = [{"functionDeclarations": [decl]}, {"googleSearch": {}}, {"codeExecution": {}}]
    (tool,) = gemini.parse_request(body(tools=tools)).tools
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["a", "b"]},
            "lines": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["type"],
    }


@pytest.mark.parametrize(
    ("config", "choice"),
    [
        ({"mode": "AUTO"}, "auto"),
        ({"mode": "NONE"}, "none"),
        ({"mode": "ANY"}, "required"),
        ({"mode": "ANY", "allowedFunctionNames": ["edit"]}, gemini.function_choice("edit")),
        ({}, None),
    ],
)
def test_tool_config(config: dict[str, Any], choice: Any) -> None:
    toolconfig = {"functionCallingConfig": config}
    assert gemini.parse_request(body(toolConfig=toolconfig)).tool_choice == choice


def test_generation_config() -> None:
    config = {
        "maxOutputTokens": 77,
        "temperature": 0.2,
        "topP": 0.5,
        "topK": 40,
        "stopSequences": ["END"],
        "seed": 3,
        "candidateCount": 1,
    }
    req = gemini.parse_request(body(generationConfig=config))
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed) == (
        77,
        0.2,
        0.5,
        ["END"],
        3,
    )
    assert req.thinking is False  # no includeThoughts: the API's default is no thoughts back


_BAD = [
    (b"[]", "request body: expected a JSON object", None),
    (body(None, systemInstruction=3), "systemInstruction: expected an object", "systemInstruction"),
    (json.dumps({}).encode(), "contents: field required", "contents"),
    (
        body([{"role": "user", "parts": [{"madeUp": "x"}]}]),
        "contents[0].parts[0].madeUp: unknown part field",
        "contents[0].parts[0].madeUp",
    ),
    (
        body([{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]),
        "contents[0].parts[0].inlineData: inlineData parts are not supported",
        "contents[0].parts[0].inlineData",
    ),
    (
        body([{"role": "user", "parts": [{"text": "a", "functionCall": {"name": "f"}}]}]),
        "contents[0].parts[0]: a part holds one kind of content, got functionCall, text",
        "contents[0].parts[0]",
    ),
    (
        body([{"role": "system", "parts": []}]),
        "contents[0].role: unsupported role 'system' (user or model)",
        "contents[0].role",
    ),
    (
        body([{"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]),
        "contents[0].parts[0]: functionCall parts belong in a model turn",
        "contents[0].parts[0]",
    ),
    (
        body([{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]),
        "contents[0].parts[0].functionCall.name: field required",
        "contents[0].parts[0].functionCall.name",
    ),
    (
        body(generationConfig={"candidateCount": 2}),
        "generationConfig.candidateCount: only 1 candidate is supported",
        "generationConfig.candidateCount",
    ),
    (
        body(generationConfig={"maxOutputTokens": 0}),
        "generationConfig.maxOutputTokens: must be at least 1",
        "generationConfig.maxOutputTokens",
    ),
    (
        body(generationConfig={"temperature": "hot"}),
        "generationConfig.temperature: expected a number",
        "generationConfig.temperature",
    ),
    (
        body(generationConfig={"stopSequences": [1]}),
        "generationConfig.stopSequences: expected a string or an array of strings",
        "generationConfig.stopSequences",
    ),
    (
        body(generationConfig={"topK": "many"}),
        "generationConfig.topK: expected a number",
        "generationConfig.topK",
    ),
    (
        body(toolConfig={"functionCallingConfig": {"mode": "SOMETIMES"}}),
        "toolConfig.functionCallingConfig.mode: unsupported mode 'SOMETIMES' "
        "(AUTO, ANY, NONE, VALIDATED)",
        "toolConfig.functionCallingConfig.mode",
    ),
]


@pytest.mark.parametrize(("raw", "message", "param"), _BAD)
def test_bad_requests(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        gemini.parse_request(raw)
    err = info.value
    assert (err.status, err.message, err.param) == (400, message, param)
    shape = json.loads(gemini.error_body(err))
    assert shape == {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}


def _completion(**fields: Any) -> Completion:
    finish = fields.pop("finish", None) or Finish(
        reason="tool_calls", usage=Usage(prompt_tokens=10, completion_tokens=4)
    )
    return Completion(id="r1", model="engine", created=0, finish=finish, **fields)


def _req(**fields: Any) -> ChatRequest:
    return ChatRequest(api="gemini", model="gemini-2.5-pro", messages=[], **fields)


def test_response_body() -> None:
    call = ToolCall(id="call_9", name="shell", arguments='{"command": "ls"}')
    out = json.loads(
        gemini.response_body(_completion(text="ok", thinking="hmm", tool_calls=[call]), _req())
    )
    assert out == {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "hmm", "thought": True},
                        {"text": "ok"},
                        {
                            "functionCall": {
                                "id": "call_9",
                                "name": "shell",
                                "args": {"command": "ls"},
                            }
                        },
                    ],
                },
                "index": 0,
                "finishReason": "STOP",
            }
        ],
        "modelVersion": "gemini-2.5-pro",
        "responseId": "r1",
        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 4, "totalTokenCount": 14},
    }
    cut = Finish(reason="length", usage=Usage(prompt_tokens=1, completion_tokens=2))
    array = json.loads(
        gemini.response_body(_completion(text="x", finish=cut), _req(metadata={"array": True}))
    )
    assert isinstance(array, list) and array[0]["candidates"][0]["finishReason"] == "MAX_TOKENS"


async def _events(events: list[Event], fail: ApiError | None = None) -> AsyncIterator[Event]:
    for ev in events:
        yield ev
    if fail is not None:
        raise fail


def _chunks(events: AsyncIterator[Event]) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        stream = gemini.stream(events, _req(), StreamHead(id="r2", created=0, prompt_tokens=5))
        return [c async for c in stream]

    raw = b"".join(asyncio.run(collect()))
    assert raw.endswith(b"\n\n")
    return [json.loads(frame[len(b"data: ") :]) for frame in raw.split(b"\n\n") if frame]


def test_stream_chunks() -> None:
    call = ToolCall(id="call_1", name="shell", arguments='{"c": 1}')
    finish = Finish(reason="tool_calls", usage=Usage(prompt_tokens=5, completion_tokens=7))
    events: list[Event] = [
        ThinkingDelta("plan"),
        TextDelta(""),
        TextDelta("Running"),
        ToolCallEvent(0, call),
        finish,
    ]
    chunks = _chunks(_events(events))
    parts = [c["candidates"][0]["content"]["parts"] for c in chunks]
    assert parts == [
        [{"text": "plan", "thought": True}],
        [{"text": "Running"}],
        [{"functionCall": {"id": "call_1", "name": "shell", "args": {"c": 1}}}],
        [],
    ]
    assert [c["candidates"][0].get("finishReason") for c in chunks] == [None, None, None, "STOP"]
    assert chunks[-1]["usageMetadata"]["totalTokenCount"] == 12
    assert all("usageMetadata" not in c for c in chunks[:-1])


def test_stream_error_after_headers_is_an_error_chunk() -> None:
    fail = ApiError(503, "engine error: gone", kind="overloaded_error")
    chunks = _chunks(_events([TextDelta("par")], fail))
    assert chunks[-1] == {
        "error": {"code": 503, "message": "engine error: gone", "status": "UNAVAILABLE"}
    }


# ---- over HTTP ----------------------------------------------------------------------------

_ROUTE = "/s/g1/v1beta/models/gemini-2.5-pro"


def test_served_over_http(tmp_path: Path) -> None:
    script = [{"text": "Hello there.", "repeat": True}]
    with (
        running_proxy(tmp_path, script) as proxy,
        httpx.Client(base_url=proxy.url, timeout=60) as client,
    ):
        plain = client.post(f"{_ROUTE}:generateContent", content=body())
        sse = client.post(f"{_ROUTE}:streamGenerateContent?alt=sse", content=body())
        array = client.post(f"{_ROUTE}:streamGenerateContent", content=body())
        counted = client.post(f"{_ROUTE}:countTokens", content=body())
        keyed = client.post(
            "/v1beta/models/m:generateContent",
            content=body(),
            headers={"x-goog-api-key": "g2"},
        )
        bad = client.post(
            f"{_ROUTE}:generateContent", content=body([user("x"), {"parts": [{"x": 1}]}])
        )
        unknown = client.post("/s/g1/v1beta/models/m:embedContent", content=body())
    assert plain.status_code == 200, plain.text
    assert plain.json()["candidates"][0]["content"]["parts"] == [{"text": "Hello there."}]
    assert sse.headers["content-type"] == "text/event-stream"
    texts = [
        p["text"]
        for frame in sse.text.split("\n\n")
        if frame
        for p in json.loads(frame[6:])["candidates"][0]["content"]["parts"]
    ]
    assert "".join(texts) == "Hello there."
    assert array.json()[0]["candidates"][0]["finishReason"] == "STOP"
    req = gemini.parse_request(body())
    assert counted.json() == {"totalTokens": tokenizer().count(req.messages, req.tools)}
    assert keyed.status_code == 200 and proxy.turns("g2")[0].api == "gemini"
    assert bad.status_code == 400
    assert bad.json()["error"] == {
        "code": 400,
        "message": "contents[1].parts[0].x: unknown part field",
        "status": "INVALID_ARGUMENT",
    }
    assert unknown.status_code == 404 and unknown.json()["error"]["status"] == "NOT_FOUND"
    turns = proxy.turns("g1")
    assert len(turns) == 3 and all(t.api == "gemini" for t in turns)
    assert turns[0].requested_model == "gemini-2.5-pro"
