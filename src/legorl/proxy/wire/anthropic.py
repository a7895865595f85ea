"""Anthropic Messages (``POST /v1/messages`` and ``/v1/messages/count_tokens``), as Claude Code
calls it.

Request: ``system`` (a string or text blocks); ``messages`` with content a string or blocks
(``text``, ``tool_use``, ``tool_result``, ``thinking``; ``redacted_thinking`` is dropped, ``image``
and ``document`` are refused), including Claude Code's ``role: "system"`` message inside
``messages``; custom ``tools`` (server tools such as ``web_search_20250305`` are dropped),
``tool_choice``, ``thinking``, ``max_tokens`` (required), ``temperature``, ``top_p``,
``stop_sequences``, ``stream``. ``tool_result`` blocks become ``role: "tool"`` messages placed
before the rest of their user message. ``cache_control``, ``metadata``, ``context_management``,
``output_config`` and the like are ignored. ``ChatRequest.thinking`` is true for ``enabled`` and
``adaptive``, false for ``disabled`` or no ``thinking`` at all (the API's own default).

Response: a ``message`` body, or the SSE sequence ``message_start``, ``ping``,
``content_block_start``/``_delta``/``_stop`` per block, ``message_delta``, ``message_stop``.
Thinking blocks are signed with the SHA-256 of their text (the signature is opaque to clients).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson

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
    Tool,
    ToolCall,
    ToolCallEvent,
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

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- Request ------------------------------------------------------------------------------


def parse_request(body: bytes) -> ChatRequest:
    """A ``POST /v1/messages`` body."""
    return _parse(body, count_tokens=False)


def count_tokens_request(body: bytes) -> ChatRequest:
    """A ``POST /v1/messages/count_tokens`` body: a messages body without ``max_tokens``."""
    return _parse(body, count_tokens=True)


def _parse(body: bytes, *, count_tokens: bool) -> ChatRequest:
    obj = load_object(body)
    model = req_str(obj, "model")
    raw_messages = req_list(obj, "messages")
    max_tokens = opt_int(obj, "max_tokens", minimum=1)
    if max_tokens is None and not count_tokens:
        raise missing("max_tokens")
    messages = []
    system = obj.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            messages.append(Message(role="system", content=text))
    tool_names: dict[str, str] = {}  # tool_use id -> name, to name the results
    for i, raw in enumerate(raw_messages):
        messages.extend(_message(raw, at("messages", i), tool_names))
    stop = opt_list(obj, "stop_sequences")
    return ChatRequest(
        api="anthropic",
        model=model,
        messages=messages,
        tools=_tools(opt_list(obj, "tools") or []),
        max_tokens=max_tokens,
        temperature=opt_number(obj, "temperature"),
        top_p=opt_number(obj, "top_p"),
        stop=str_list(stop, "stop_sequences"),
        stream=bool(opt_bool(obj, "stream")) and not count_tokens,
        thinking=_thinking(opt_object(obj, "thinking")),
        tool_choice=_tool_choice(opt_object(obj, "tool_choice")),
    )


def _message(value: Any, path: str, tool_names: dict[str, str]) -> list[Message]:
    obj = as_object(value, path)
    role = req_str(obj, "role", path)
    content = req_value(obj, "content", path)
    content_path = at(path, "content")
    if role == "system":  # Claude Code sends one after the user turn; keep it where it is
        return [Message(role="system", content=_text_blocks(content, content_path))]
    if role not in ("user", "assistant"):
        raise bad(at(path, "role"), f"unsupported role {role!r}")
    if isinstance(content, str):
        return [Message(role="user" if role == "user" else "assistant", content=content)]
    if not isinstance(content, list):
        raise wrong_type(content_path, "a string or a list of content blocks")
    if role == "user":
        return _user_blocks(content, content_path, tool_names)
    return [_assistant_blocks(content, content_path, tool_names)]


def _user_blocks(blocks: list[Any], path: str, tool_names: dict[str, str]) -> list[Message]:
    results: list[Message] = []
    texts = []
    for j, value in enumerate(blocks):
        block_path = at(path, j)
        block = as_object(value, block_path)
        kind = req_str(block, "type", block_path)
        if kind == "text":
            texts.append(req_str(block, "text", block_path))
        elif kind == "tool_result":
            use_id = req_str(block, "tool_use_id", block_path)
            result = block.get("content")
            text = "" if result is None else _result_text(result, at(block_path, "content"))
            results.append(
                Message(
                    role="tool",
                    content=text,
                    tool_call_id=use_id,
                    name=tool_names.get(use_id),
                    is_error=bool(opt_bool(block, "is_error", block_path)),
                )
            )
        else:
            raise _unsupported_block(kind, block_path)
    if texts or not results:
        results.append(Message(role="user", content=PART_SEPARATOR.join(texts)))
    return results


def _assistant_blocks(blocks: list[Any], path: str, tool_names: dict[str, str]) -> Message:
    texts, thoughts, calls = [], [], []
    for j, value in enumerate(blocks):
        block_path = at(path, j)
        block = as_object(value, block_path)
        kind = req_str(block, "type", block_path)
        if kind == "text":
            texts.append(req_str(block, "text", block_path))
        elif kind == "thinking":
            opt_str(block, "signature", block_path)
            thoughts.append(req_str(block, "thinking", block_path))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic; nothing a local model could read
        elif kind == "tool_use":
            call_id = req_str(block, "id", block_path)
            name = req_str(block, "name", block_path)
            arguments = as_object(req_value(block, "input", block_path), at(block_path, "input"))
            tool_names[call_id] = name
            calls.append(ToolCall(id=call_id, name=name, arguments=dumps(arguments).decode()))
        else:
            raise _unsupported_block(kind, block_path)
    return Message(
        role="assistant",
        content=PART_SEPARATOR.join(texts),
        reasoning=PART_SEPARATOR.join(thoughts) if thoughts else None,
        tool_calls=calls,
    )


def _unsupported_block(kind: str, path: str) -> ApiError:
    if kind in ("image", "document"):
        return bad(path, f"{kind} content is not supported")
    return bad(at(path, "type"), f"unsupported content block type {kind!r}")


#: Claude Code's first system block when it talks to Anthropic's host: request metadata whose
#: checksum changes on every call. It is not part of the prompt; keeping it would make every call
#: look like a new conversation.
BILLING_HEADER = "x-anthropic-billing-header:"


def _text_blocks(value: Any, path: str) -> str:
    """A string or a list of text blocks (``system``, and ``role: "system"`` messages)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        block_path = at(path, j)
        block = as_object(block, block_path)
        kind = req_str(block, "type", block_path)
        if kind != "text":
            raise _unsupported_block(kind, block_path)
        text = req_str(block, "text", block_path)
        if text.startswith(BILLING_HEADER):
            continue
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def _result_text(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or a list of content blocks")
    return _text_blocks(value, path)


def _tools(values: list[Any]) -> list[Tool]:
    tools = []
    for k, value in enumerate(values):
        path = at("tools", k)
        obj = as_object(value, path)
        if opt_str(obj, "type", path) not in (None, "custom"):
            continue  # a server tool (web search, code execution…) that only Anthropic runs
        tools.append(
            Tool(
                name=req_str(obj, "name", path),
                description=opt_str(obj, "description", path) or "",
                parameters=as_object(
                    req_value(obj, "input_schema", path), at(path, "input_schema")
                ),
            )
        )
    return tools


def _thinking(value: JSONObject | None) -> bool:
    if value is None:
        return False
    kind = req_str(value, "type", "thinking")
    opt_int(value, "budget_tokens", "thinking")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad("thinking.type", f"unsupported thinking type {kind!r}")
    return kind != "disabled"


def _tool_choice(value: JSONObject | None) -> Any:
    if value is None:
        return None
    kind = req_str(value, "type", "tool_choice")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return function_choice(req_str(value, "name", "tool_choice"))
    raise bad("tool_choice.type", f"unsupported tool_choice type {kind!r}")


# ---- Responses ----------------------------------------------------------------------------


tool_call_id = id_style("toolu_01", 22)
response_id = id_style("msg_01", 22)


def error_body(err: ApiError) -> bytes:
    return dumps(_error_dict(err))


def count_tokens_body(n: int) -> bytes:
    return dumps({"input_tokens": n})


def thinking_signature(thinking: str) -> str:
    """The signature of a thinking block: opaque to clients, the SHA-256 of its text to us."""
    return _signature(hashlib.sha256(thinking.encode()).digest())


def response_body(c: Completion, req: ChatRequest) -> bytes:
    content: list[JSONObject] = []
    if c.thinking:
        content.append(
            {
                "type": "thinking",
                "thinking": c.thinking,
                "signature": thinking_signature(c.thinking),
            }
        )
    if c.text:
        content.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        content.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)}
        )
    stop_reason, stop_sequence = _stop(c.finish)
    return dumps(
        {
            "id": c.id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(c.finish.usage.prompt_tokens, c.finish.usage.completion_tokens),
        }
    )


async def stream(
    events: AsyncIterator[Event], req: ChatRequest, head: StreamHead
) -> AsyncIterator[bytes]:
    """The Messages SSE sequence. The model is the one the harness asked for (``req.model``);
    ``head.created`` is not part of this API."""
    message: JSONObject = {
        "id": head.id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(head.prompt_tokens, 0),
    }
    yield _event("message_start", {"message": message})
    yield _event("ping", {})
    index = -1
    open_kind: Literal["thinking", "text"] | None = None
    digest = hashlib.sha256()
    finish: Finish | None = None

    def close() -> list[bytes]:
        out = []
        if open_kind == "thinking":
            signature = {"type": "signature_delta", "signature": _signature(digest.digest())}
            out.append(_event("content_block_delta", {"index": index, "delta": signature}))
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        return out

    try:
        async for ev in events:
            if isinstance(ev, ThinkingDelta | TextDelta):
                if not ev.text:
                    continue
                kind: Literal["thinking", "text"] = (
                    "thinking" if isinstance(ev, ThinkingDelta) else "text"
                )
                if open_kind != kind:
                    for chunk in close():
                        yield chunk
                    index, open_kind = index + 1, kind
                    digest = hashlib.sha256()
                    block: JSONObject = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if kind == "thinking"
                        else {"type": "text", "text": ""}
                    )
                    yield _event("content_block_start", {"index": index, "content_block": block})
                delta: JSONObject
                if kind == "thinking":
                    digest.update(ev.text.encode())
                    delta = {"type": "thinking_delta", "thinking": ev.text}
                else:
                    delta = {"type": "text_delta", "text": ev.text}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(ev, ToolCallEvent):
                for chunk in close():
                    yield chunk
                index, open_kind = index + 1, None
                block = {"type": "tool_use", "id": ev.call.id, "name": ev.call.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": ev.call.arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
            else:
                finish = ev
    except ApiError as err:
        # Headers are gone already: the error travels as an `error` event, as Anthropic's does.
        yield sse(_error_dict(err), "error")
        return
    if finish is None:
        raise RuntimeError("event stream ended without Finish")
    for chunk in close():
        yield chunk
    stop_reason, stop_sequence = _stop(finish)
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {
                "input_tokens": finish.usage.prompt_tokens,
                "output_tokens": finish.usage.completion_tokens,
            },
        },
    )
    yield _event("message_stop", {})


def _event(name: str, data: JSONObject) -> bytes:
    return sse({"type": name, **data}, name)


def _error_dict(err: ApiError) -> JSONObject:
    kind = _ERROR_TYPES.get(err.status)
    if kind is None:
        kind = "api_error" if err.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _signature(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _stop(finish: Finish) -> tuple[str, str | None]:
    if finish.reason == "stop" and finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return _STOP_REASONS[finish.reason], None


def _input(call: ToolCall) -> JSONObject:
    # The core only emits calls whose arguments parse to an object; anything else is its bug.
    value = orjson.loads(call.arguments)
    if not isinstance(value, dict):
        raise ValueError(f"tool call {call.id}: arguments are not a JSON object")
    return value


def _usage(input_tokens: int, output_tokens: int) -> JSONObject:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
