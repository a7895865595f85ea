"""OpenAI Chat Completions (``POST /v1/chat/completions``), as OpenCode and OpenHands call it.

Request: ``messages`` (system/developer/user/assistant/tool; content a string or text parts;
assistant ``tool_calls`` and ``reasoning_content``), function ``tools``, ``tool_choice``,
``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``n`` (1 only),
``seed``, ``stream``, ``stream_options.include_usage``. Anything else is ignored.

Response: a ``chat.completion`` body, or ``chat.completion.chunk`` SSE ending in ``[DONE]``;
thinking goes out as ``reasoning_content`` (the vLLM/DeepSeek field OpenAI-compatible clients read).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from legorl.proxy.chat import (
    ApiError,
    ChatRequest,
    Completion,
    Event,
    Finish,
    Message,
    Role,
    StreamHead,
    TextDelta,
    ThinkingDelta,
    Tool,
    ToolCall,
    ToolCallEvent,
    Usage,
)
from legorl.proxy.wire._common import (
    PART_SEPARATOR,
    JSONObject,
    as_object,
    at,
    bad,
    dumps,
    function_choice,
    id_style,
    load_object,
    missing,
    openai_error,
    openai_error_body,
    opt_bool,
    opt_int,
    opt_list,
    opt_number,
    opt_object,
    opt_str,
    req_list,
    req_str,
    req_value,
    sse,
    str_list,
    wrong_type,
)

_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}
_UNSUPPORTED_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}


# ---- Request ------------------------------------------------------------------------------


def parse_request(body: bytes) -> ChatRequest:
    obj = load_object(body)
    model = req_str(obj, "model")
    raw_messages = req_list(obj, "messages")
    if not raw_messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    n = opt_int(obj, "n")
    if n is not None and n != 1:
        raise ApiError(400, "n: only n=1 is supported", param="n")
    max_tokens = opt_int(obj, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = opt_int(obj, "max_tokens", minimum=1)
    stream = bool(opt_bool(obj, "stream"))
    options = opt_object(obj, "stream_options") or {}
    include_usage = bool(opt_bool(options, "include_usage", "stream_options"))
    return ChatRequest(
        api="openai_chat",
        model=model,
        messages=[_message(m, at("messages", i)) for i, m in enumerate(raw_messages)],
        tools=_tools(opt_list(obj, "tools") or []),
        max_tokens=max_tokens,
        temperature=opt_number(obj, "temperature"),
        top_p=opt_number(obj, "top_p"),
        stop=str_list(obj.get("stop"), "stop"),
        stream=stream,
        include_usage=stream and include_usage,
        tool_choice=_tool_choice(obj.get("tool_choice")),
        seed=opt_int(obj, "seed"),
    )


def _message(value: Any, path: str) -> Message:
    obj = as_object(value, path)
    role = req_str(obj, "role", path)
    if role == "tool":
        return Message(
            role="tool",
            content=_content(obj.get("content"), at(path, "content")),
            tool_call_id=req_str(obj, "tool_call_id", path),
            name=opt_str(obj, "name", path),
        )
    if role not in _ROLES:
        raise bad(at(path, "role"), f"unsupported role {role!r}")
    if role != "assistant":
        return Message(role=_ROLES[role], content=_content(obj.get("content"), at(path, "content")))
    content = obj.get("content")
    reasoning = opt_str(obj, "reasoning_content", path)
    if reasoning is None and isinstance(obj.get("reasoning"), str):
        reasoning = obj["reasoning"]
    return Message(
        role="assistant",
        content="" if content is None else _content(content, at(path, "content")),
        reasoning=reasoning,
        tool_calls=[
            _tool_call(c, at(at(path, "tool_calls"), k))
            for k, c in enumerate(opt_list(obj, "tool_calls", path) or [])
        ],
    )


def _content(value: Any, path: str) -> str:
    if value is None:
        raise missing(path)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or a list of content blocks")
    texts = []
    for j, part in enumerate(value):
        part_path = at(path, j)
        part = as_object(part, part_path)
        kind = req_str(part, "type", part_path)
        if kind == "text":
            texts.append(req_str(part, "text", part_path))
        elif kind == "refusal":
            texts.append(req_str(part, "refusal", part_path))
        elif kind in _UNSUPPORTED_PARTS:
            raise bad(part_path, f"{_UNSUPPORTED_PARTS[kind]} content is not supported")
        else:
            raise bad(at(part_path, "type"), f"unsupported content part type {kind!r}")
    return PART_SEPARATOR.join(texts)


def _tool_call(value: Any, path: str) -> ToolCall:
    obj = as_object(value, path)
    kind = opt_str(obj, "type", path) or "function"
    if kind != "function":
        raise bad(at(path, "type"), f"unsupported tool call type {kind!r}")
    fn_path = at(path, "function")
    fn = as_object(req_value(obj, "function", path), fn_path)
    return ToolCall(
        id=req_str(obj, "id", path),
        name=req_str(fn, "name", fn_path),
        arguments=req_str(fn, "arguments", fn_path),
    )


def _tools(values: list[Any]) -> list[Tool]:
    tools = []
    for k, value in enumerate(values):
        path = at("tools", k)
        obj = as_object(value, path)
        if req_str(obj, "type", path) != "function":
            continue  # custom/grammar tools: nothing a chat template can show
        fn_path = at(path, "function")
        fn = as_object(req_value(obj, "function", path), fn_path)
        tools.append(
            Tool(
                name=req_str(fn, "name", fn_path),
                description=opt_str(fn, "description", fn_path) or "",
                parameters=opt_object(fn, "parameters", fn_path) or {},
            )
        )
    return tools


def _tool_choice(value: Any) -> Any:
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        fn = as_object(req_value(value, "function", "tool_choice"), "tool_choice.function")
        return function_choice(req_str(fn, "name", "tool_choice.function"))
    raise wrong_type("tool_choice", '"none", "auto", "required" or a function choice')


# ---- Responses ----------------------------------------------------------------------------


tool_call_id = id_style("call_", 24)
response_id = id_style("chatcmpl-", 29)
error_body = openai_error_body


def response_body(c: Completion, req: ChatRequest) -> bytes:
    message: JSONObject = {
        "role": "assistant",
        "content": c.text if c.text or not c.tool_calls else None,
    }
    if c.thinking:
        message["reasoning_content"] = c.thinking
    if c.tool_calls:
        message["tool_calls"] = [_call_dict(call) for call in c.tool_calls]
    return dumps(
        {
            "id": c.id,
            "object": "chat.completion",
            "created": c.created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": c.finish.reason,
                }
            ],
            "usage": _usage(c.finish.usage),
        }
    )


async def stream(
    events: AsyncIterator[Event], req: ChatRequest, head: StreamHead
) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` SSE, with the model name the harness asked for (``req.model``).
    ``head.prompt_tokens`` is unused: usage comes with ``Finish``."""
    top: JSONObject = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": req.model,
    }

    def chunk(delta: JSONObject, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        data = {**top, "choices": [choice]}
        if req.include_usage:
            data["usage"] = None
        return sse(data)

    yield chunk({"role": "assistant", "content": ""})
    finish: Finish | None = None
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                if ev.text:
                    yield chunk({"content": ev.text})
            elif isinstance(ev, ThinkingDelta):
                if ev.text:
                    yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCallEvent):
                yield chunk({"tool_calls": [{"index": ev.index, **_call_dict(ev.call)}]})
            else:
                finish = ev
    except ApiError as err:
        # Headers are gone already: the error travels in the stream, where the SDKs look for it.
        yield sse(openai_error(err))
        return
    if finish is None:
        raise RuntimeError("event stream ended without Finish")
    yield chunk({}, finish.reason)
    if req.include_usage:
        yield sse({**top, "choices": [], "usage": _usage(finish.usage)})
    yield b"data: [DONE]\n\n"


def _call_dict(call: ToolCall) -> JSONObject:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _usage(usage: Usage) -> JSONObject:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
