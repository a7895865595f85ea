"""OpenAI Responses (``POST /v1/responses``), enough for Codex CLI's exec mode.

Request: ``instructions`` (the system message), ``input`` as a string or a list of items
(``message`` with ``input_text``/``output_text`` parts, ``developer`` messages as system ones,
``function_call``/``function_call_output``, ``custom_tool_call``/``custom_tool_call_output``,
``reasoning`` whose text becomes the next assistant turn's reasoning), ``tools`` of type
``function`` and ``custom`` (freeform: the model sees one string parameter ``input``; hosted and
``namespace`` tools are dropped), ``tool_choice``, ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``. ``store``, ``include``, ``reasoning``, ``prompt_cache_key``,
``client_metadata``, ``text`` and the like are ignored. The proxy keeps no responses, so a
``previous_response_id`` names one it never made: a 400 with code
``previous_response_not_found``, the harness must send the whole conversation.

Response: a ``response`` object whose ``output`` holds a ``reasoning`` item (thinking, as
``reasoning_text`` content: the model's own text, not a summary), a ``message`` item,
``function_call`` items and ``custom_tool_call`` items (a call to a custom tool, its ``input`` the
free text); ``status`` is ``incomplete`` when the token limit cut it. Streaming sends the API's
events with ``sequence_number``, from ``response.created`` to ``response.completed`` (or
``response.incomplete``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

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
    openai_error_body,
    opt_bool,
    opt_int,
    opt_list,
    opt_number,
    opt_str,
    req_str,
    req_value,
    sse,
    wrong_type,
)

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_UNSUPPORTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
_ROLES: dict[str, Role] = {"user": "user", "system": "system", "developer": "system"}


# ---- Request ------------------------------------------------------------------------------


def parse_request(body: bytes) -> ChatRequest:
    obj = load_object(body)
    model = req_str(obj, "model")
    previous = obj.get("previous_response_id")
    if previous is not None:
        raise ApiError(
            400,
            f"previous response {str(previous)[:80]!r} was not made by this proxy (it stores no "
            "responses): send the whole conversation as input",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    messages = []
    instructions = opt_str(obj, "instructions")
    if instructions:
        messages.append(Message(role="system", content=instructions))
    raw_input = req_value(obj, "input")
    if isinstance(raw_input, str):
        messages.append(Message(role="user", content=raw_input))
    elif isinstance(raw_input, list):
        messages.extend(_items(raw_input))
    else:
        raise wrong_type("input", "a string or a list of input items")
    raw_choice = obj.get("tool_choice")
    parallel = opt_bool(obj, "parallel_tool_calls")
    tools, custom = _tools(opt_list(obj, "tools") or [])
    return ChatRequest(
        api="responses",
        model=model,
        messages=messages,
        tools=tools,
        max_tokens=opt_int(obj, "max_output_tokens", minimum=1),
        temperature=opt_number(obj, "temperature"),
        top_p=opt_number(obj, "top_p"),
        stream=bool(opt_bool(obj, "stream")),
        tool_choice=_tool_choice(raw_choice),
        # Echoed in the response object, as the API does.
        metadata={
            "instructions": instructions,
            "tool_choice": "auto" if raw_choice is None else raw_choice,
            "parallel_tool_calls": True if parallel is None else parallel,
            "custom_tools": custom,
        },
    )


def _items(items: list[Any]) -> list[Message]:
    messages: list[Message] = []
    tool_names: dict[str, str] = {}
    reasoning: str | None = None  # from a reasoning item, for the assistant turn that follows
    joinable = False  # whether a function_call joins messages[-1] (the same assistant turn)
    for i, value in enumerate(items):
        path = at("input", i)
        item = as_object(value, path)
        kind = opt_str(item, "type", path) or ("message" if "role" in item else None)
        if kind is None:
            raise missing(at(path, "type"))
        if kind == "message":
            role = req_str(item, "role", path)
            content = _content(req_value(item, "content", path), at(path, "content"))
            if role == "assistant":
                messages.append(Message(role="assistant", content=content, reasoning=reasoning))
                joinable = True
            elif role in _ROLES:
                messages.append(Message(role=_ROLES[role], content=content))
                joinable = False
            else:
                raise bad(at(path, "role"), f"unsupported role {role!r}")
            reasoning = None
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                arguments = req_str(item, "arguments", path)
            else:
                arguments = custom_arguments(req_str(item, "input", path))
            call = ToolCall(
                id=req_str(item, "call_id", path),
                name=req_str(item, "name", path),
                arguments=arguments,
            )
            tool_names[call.id] = call.name
            if joinable and reasoning is None:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(Message(role="assistant", reasoning=reasoning, tool_calls=[call]))
                reasoning, joinable = None, True
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = req_str(item, "call_id", path)
            output = _content(req_value(item, "output", path), at(path, "output"))
            name = tool_names.get(call_id)
            messages.append(Message(role="tool", content=output, tool_call_id=call_id, name=name))
            joinable = False
        elif kind == "reasoning":
            text = _reasoning_text(item, path)
            if text:
                reasoning = text if reasoning is None else reasoning + PART_SEPARATOR + text
        else:
            raise bad(at(path, "type"), f"unsupported input item type {kind!r}")
    return messages


def _content(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or a list of content parts")
    texts = []
    for j, part in enumerate(value):
        part_path = at(path, j)
        part = as_object(part, part_path)
        kind = req_str(part, "type", part_path)
        if kind in _TEXT_PARTS:
            texts.append(req_str(part, _TEXT_PARTS[kind], part_path))
        elif kind in _UNSUPPORTED_PARTS:
            raise bad(part_path, f"{_UNSUPPORTED_PARTS[kind]} content is not supported")
        else:
            raise bad(at(part_path, "type"), f"unsupported content part type {kind!r}")
    return PART_SEPARATOR.join(texts)


def _reasoning_text(item: JSONObject, path: str) -> str:
    """The model's own reasoning text when the item has it, else its summary."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = opt_list(item, key, path) or []
        texts = []
        for j, part in enumerate(parts):
            part_path = at(at(path, key), j)
            part = as_object(part, part_path)
            if req_str(part, "type", part_path) == part_type:
                texts.append(req_str(part, "text", part_path))
        if texts:
            return PART_SEPARATOR.join(texts)
    return ""


def _tools(values: list[Any]) -> tuple[list[Tool], list[str]]:
    """The tools a chat template can show, and the names of those that are custom."""
    tools, custom = [], []
    for k, value in enumerate(values):
        path = at("tools", k)
        obj = as_object(value, path)
        kind = req_str(obj, "type", path)
        if kind == "function":
            parameters = as_object(obj.get("parameters") or {}, at(path, "parameters"))
        elif kind == "custom":
            parameters = _custom_parameters(obj, path)
            custom.append(req_str(obj, "name", path))
        else:
            continue  # hosted tools (web search…) and namespaces: nothing the model can call
        tools.append(
            Tool(
                name=req_str(obj, "name", path),
                description=opt_str(obj, "description", path) or "",
                parameters=parameters,
            )
        )
    return tools, custom


def _custom_parameters(obj: JSONObject, path: str) -> JSONObject:
    """A freeform tool as a function of one string, ``input``, which says what it must be."""
    fmt = as_object(obj.get("format") or {"type": "text"}, at(path, "format"))
    about = "Free text."
    if fmt.get("type") == "grammar":
        syntax = opt_str(fmt, "syntax", at(path, "format")) or "grammar"
        definition = opt_str(fmt, "definition", at(path, "format")) or ""
        about = f"Text in this {syntax} grammar:\n{definition}"
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"],
    }


def custom_arguments(text: str) -> str:
    """A custom tool call's free text as the arguments the model writes for it."""
    return json.dumps({"input": text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The free text of a custom tool call the model wrote as arguments (else the raw text)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


def _tool_choice(value: Any) -> Any:
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return function_choice(req_str(value, "name", "tool_choice"))
    raise wrong_type("tool_choice", '"none", "auto", "required" or a function choice')


# ---- Responses ----------------------------------------------------------------------------


tool_call_id = id_style("call_", 24)
response_id = id_style("resp_", 32)
error_body = openai_error_body


def response_body(c: Completion, req: ChatRequest) -> bytes:
    incomplete = c.finish.reason == "length"
    output: list[JSONObject] = []
    if c.thinking:
        output.append(_reasoning_item(_item_id("rs", c.id, len(output)), c.thinking))
    if c.text:
        output.append(_message_item(_item_id("msg", c.id, len(output)), c.text, "completed"))
    custom = req.metadata.get("custom_tools", [])
    for call in c.tool_calls:
        item_id = _item_id("fc", c.id, len(output))
        output.append(_call_item(item_id, call, "completed", call.name in custom))
    if incomplete and output and "status" in output[-1]:
        output[-1]["status"] = "incomplete"
    return dumps(
        _response(
            req,
            id=c.id,
            created=c.created,
            status="incomplete" if incomplete else "completed",
            output=output,
            usage=_usage(c.finish.usage),
        )
    )


async def stream(
    events: AsyncIterator[Event], req: ChatRequest, head: StreamHead
) -> AsyncIterator[bytes]:
    """Responses SSE events, with the model name the harness asked for (``req.model``).
    ``head.prompt_tokens`` is unused: usage comes with ``Finish``."""
    rid = head.id
    sequence = itertools.count()

    def emit(name: str, data: JSONObject) -> bytes:
        return sse({"type": name, "sequence_number": next(sequence), **data}, name)

    start = _response(
        req, id=rid, created=head.created, status="in_progress", output=[], usage=None
    )
    yield emit("response.created", {"response": start})
    yield emit("response.in_progress", {"response": start})
    output: list[JSONObject] = []  # finished items, for the final response object
    open_kind: Literal["reasoning", "message"] | None = None
    item_id = ""
    parts: list[str] = []
    finish: Finish | None = None
    custom = req.metadata.get("custom_tools", [])

    def close(status: str = "completed") -> list[bytes]:
        if open_kind is None:
            return []
        text = "".join(parts)
        where = {"item_id": item_id, "output_index": len(output), "content_index": 0}
        if open_kind == "reasoning":
            item = _reasoning_item(item_id, text)
            done = emit("response.reasoning_text.done", {**where, "text": text})
        else:
            item = _message_item(item_id, text, status)
            done = emit("response.output_text.done", {**where, "text": text, "logprobs": []})
        out = [
            done,
            emit("response.content_part.done", {**where, "part": item["content"][0]}),
            emit("response.output_item.done", {"output_index": len(output), "item": item}),
        ]
        output.append(item)
        return out

    try:
        async for ev in events:
            if isinstance(ev, ThinkingDelta | TextDelta):
                if not ev.text:
                    continue
                kind: Literal["reasoning", "message"] = (
                    "reasoning" if isinstance(ev, ThinkingDelta) else "message"
                )
                if open_kind != kind:
                    for chunk in close():
                        yield chunk
                    open_kind, parts = kind, []
                    if kind == "reasoning":
                        item_id = _item_id("rs", rid, len(output))
                        item: JSONObject = {**_reasoning_item(item_id, ""), "content": []}
                        part: JSONObject = {"type": "reasoning_text", "text": ""}
                    else:
                        item_id = _item_id("msg", rid, len(output))
                        item = {**_message_item(item_id, "", "in_progress"), "content": []}
                        part = _text_part("")
                    added = {"output_index": len(output), "item": item}
                    yield emit("response.output_item.added", added)
                    yield emit(
                        "response.content_part.added",
                        {
                            "item_id": item_id,
                            "output_index": len(output),
                            "content_index": 0,
                            "part": part,
                        },
                    )
                where = {"item_id": item_id, "output_index": len(output), "content_index": 0}
                parts.append(ev.text)
                if kind == "reasoning":
                    yield emit("response.reasoning_text.delta", {**where, "delta": ev.text})
                else:
                    delta = {**where, "delta": ev.text, "logprobs": []}
                    yield emit("response.output_text.delta", delta)
            elif isinstance(ev, ToolCallEvent):
                for chunk in close():
                    yield chunk
                open_kind = None
                index = len(output)
                call_id = _item_id("fc", rid, index)
                is_custom = ev.call.name in custom
                done = _call_item(call_id, ev.call, "completed", is_custom)
                field = "input" if is_custom else "arguments"
                started = {**done, "status": "in_progress", field: ""}
                where = {"item_id": call_id, "output_index": index}
                yield emit("response.output_item.added", {"output_index": index, "item": started})
                events_of = (
                    "response.custom_tool_call_input"
                    if is_custom
                    else "response.function_call_arguments"
                )
                yield emit(f"{events_of}.delta", {**where, "delta": done[field]})
                finished = {**where, field: done[field]}
                if not is_custom:
                    finished["name"] = ev.call.name
                yield emit(f"{events_of}.done", finished)
                yield emit("response.output_item.done", {"output_index": index, "item": done})
                output.append(done)
            else:
                finish = ev
    except ApiError as err:
        # Headers are gone already: the error travels as the API's `error` event.
        body = {"code": err.code, "message": err.message, "param": err.param}
        yield emit("error", body)
        return
    if finish is None:
        raise RuntimeError("event stream ended without Finish")
    incomplete = finish.reason == "length"
    for chunk in close("incomplete" if incomplete else "completed"):
        yield chunk
    final = _response(
        req,
        id=rid,
        created=head.created,
        status="incomplete" if incomplete else "completed",
        output=output,
        usage=_usage(finish.usage),
    )
    yield emit("response.incomplete" if incomplete else "response.completed", {"response": final})


def _response(
    req: ChatRequest,
    *,
    id: str,
    created: int,
    status: str,
    output: list[JSONObject],
    usage: JSONObject | None,
) -> JSONObject:
    meta = req.metadata
    return {
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.get("instructions"),
        "max_output_tokens": req.max_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": meta.get("parallel_tool_calls", True),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "tool_choice": meta.get("tool_choice", "auto"),
        "tools": [_tool_echo(t, t.name in meta.get("custom_tools", [])) for t in req.tools],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "usage": usage,
        "metadata": {},
    }


def _item_id(prefix: str, response_id: str, index: int) -> str:
    # Item ids follow from the response id, so a response's ids are unique and reproducible.
    return f"{prefix}_{response_id.partition('_')[2] or response_id}{index:02d}"


def _text_part(text: str) -> JSONObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str) -> JSONObject:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_item(item_id: str, text: str, status: str) -> JSONObject:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _call_item(item_id: str, call: ToolCall, status: str, custom: bool = False) -> JSONObject:
    if custom:
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "input": custom_input(call.arguments),
        }
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def _tool_echo(tool: Tool, custom: bool) -> JSONObject:
    if custom:
        return {"type": "custom", "name": tool.name, "description": tool.description}
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": False,
    }


def _usage(usage: Usage) -> JSONObject:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
