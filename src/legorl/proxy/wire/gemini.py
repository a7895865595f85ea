"""Google's Gemini API (``POST /v1beta/models/{model}:generateContent``, ``:streamGenerateContent``
and ``:countTokens``), as Gemini CLI calls it. The model name comes from the path, not the body.

Request: ``contents`` of ``role`` ``user`` or ``model`` whose ``parts`` are ``text`` (``thought:
true`` on a model part makes it the turn's reasoning), ``functionCall`` (its ``id`` kept, else
one is made from the name and position) and ``functionResponse`` (a ``role: "tool"`` message:
the text of ``response.output`` or ``response.error`` when that is all the response holds, the
response as JSON otherwise); ``thoughtSignature`` and the other per-part metadata are accepted
and ignored. Any other part (``inlineData``, ``fileData``, ``executableCode``, an unknown field)
is refused with a 400 naming it: dropping it would train on a prompt the harness never sent.
``systemInstruction``, ``tools[].functionDeclarations`` with ``parameters`` (Google's schema,
type names lower-cased to JSON Schema's) or ``parametersJsonSchema``, other tools (Google
Search, code execution) dropped; ``toolConfig.functionCallingConfig``; ``generationConfig``:
``maxOutputTokens``, ``temperature``, ``topP``, ``stopSequences``, ``seed``,
``thinkingConfig.includeThoughts``, ``candidateCount`` (only 1). ``topK`` is checked and not
applied (the engines sample with temperature and top-p only), as is ``responseSchema``.

Response: a ``GenerateContentResponse`` with one candidate; streamed with ``alt=sse`` as one
chunk per text, thought or function-call event, the last one carrying ``finishReason`` and
``usageMetadata``; ``streamGenerateContent`` without ``alt=sse`` answers a JSON array of one
chunk. Errors are Google's ``{"error": {"code", "message", "status"}}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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
    opt_bool,
    opt_int,
    opt_list,
    opt_number,
    opt_object,
    opt_str,
    req_list,
    req_str,
    sse,
    str_list,
)

_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"}
# Fields a part may carry besides its one piece of content; they change nothing the model reads.
_PART_METADATA = frozenset(
    {"thought", "thoughtSignature", "videoMetadata", "partMetadata", "mediaResolution"}
)
_UNSUPPORTED_DATA = ("inlineData", "fileData", "executableCode", "codeExecutionResult")
_MODES = {"AUTO": "auto", "VALIDATED": "auto", "NONE": "none", "ANY": "required"}


# ---- Request ------------------------------------------------------------------------------


def parse_request(body: bytes, *, model: str = "", stream: bool = False) -> ChatRequest:
    """A ``generateContent`` body; ``model`` from the path, ``stream`` from the method."""
    obj = load_object(body)
    messages = _system(obj)
    messages += _contents(req_list(obj, "contents"), "contents")
    config = opt_object(obj, "generationConfig") or {}
    where = "generationConfig"
    candidates = opt_int(config, "candidateCount", where)
    if candidates not in (None, 1):
        raise bad(at(where, "candidateCount"), "only 1 candidate is supported")
    opt_number(config, "topK", where)
    opt_str(config, "responseMimeType", where)
    thinking = opt_object(config, "thinkingConfig", where) or {}
    include = opt_bool(thinking, "includeThoughts", at(where, "thinkingConfig"))
    opt_int(thinking, "thinkingBudget", at(where, "thinkingConfig"))
    return ChatRequest(
        api="gemini",
        model=model,
        messages=messages,
        tools=_tools(opt_list(obj, "tools") or []),
        max_tokens=opt_int(config, "maxOutputTokens", where, minimum=1),
        temperature=opt_number(config, "temperature", where),
        top_p=opt_number(config, "topP", where),
        stop=str_list(config.get("stopSequences"), at(where, "stopSequences")),
        stream=stream,
        thinking=bool(include),
        tool_choice=_tool_choice(opt_object(obj, "toolConfig")),
        seed=opt_int(config, "seed", where),
    )


def count_tokens_request(body: bytes, *, model: str = "") -> ChatRequest:
    """A ``countTokens`` body: ``contents``, or a whole ``generateContentRequest``."""
    obj = load_object(body)
    inner = opt_object(obj, "generateContentRequest")
    if inner is not None:
        return parse_request(dumps(inner), model=model)
    messages = _system(obj) + _contents(req_list(obj, "contents"), "contents")
    return ChatRequest(
        api="gemini", model=model, messages=messages, tools=_tools(opt_list(obj, "tools") or [])
    )


def _system(obj: JSONObject) -> list[Message]:
    value = obj.get("systemInstruction")
    if value is None:
        return []
    if isinstance(value, str):
        text = value
    else:
        content = as_object(value, "systemInstruction")
        parts = req_list(content, "parts", "systemInstruction")
        text = PART_SEPARATOR.join(_text_parts(parts, at("systemInstruction", "parts")))
    return [Message(role="system", content=text)] if text else []


def _text_parts(parts: list[Any], path: str) -> list[str]:
    texts = []
    for j, value in enumerate(parts):
        kind, part = _part(value, at(path, j))
        if kind == "text":
            texts.append(part["text"])
        elif kind is not None:
            raise bad(at(path, j), f"only text parts are allowed here, not {kind}")
    return texts


def _part(value: Any, path: str) -> tuple[str | None, JSONObject]:
    """The part's kind (``text``, ``functionCall``, ``functionResponse``; None for a part with
    metadata only) and the part; anything else is refused."""
    part = as_object(value, path)
    kinds = [k for k in part if k not in _PART_METADATA and part[k] is not None]
    if len(kinds) > 1:
        raise bad(path, f"a part holds one kind of content, got {', '.join(sorted(kinds))}")
    if not kinds:
        return None, part
    kind = kinds[0]
    if kind in _UNSUPPORTED_DATA:
        raise bad(at(path, kind), f"{kind} parts are not supported")
    if kind not in ("text", "functionCall", "functionResponse"):
        raise bad(at(path, kind), "unknown part field")
    if kind == "text":
        req_str(part, "text", path)
        opt_bool(part, "thought", path)
    opt_str(part, "thoughtSignature", path)
    return kind, part


def _contents(values: list[Any], where: str) -> list[Message]:
    messages: list[Message] = []
    calls: dict[str, list[str]] = {}  # function name -> ids of its calls not yet answered
    for i, value in enumerate(values):
        path = at(where, i)
        content = as_object(value, path)
        role = opt_str(content, "role", path) or "user"
        parts = req_list(content, "parts", path)
        parts_path = at(path, "parts")
        if role == "model":
            messages.append(_model_turn(parts, parts_path, i, calls))
        elif role in ("user", "function"):
            messages += _user_turn(parts, parts_path, calls)
        else:
            raise bad(at(path, "role"), f"unsupported role {role!r} (user or model)")
    return messages


def _model_turn(parts: list[Any], path: str, index: int, calls: dict[str, list[str]]) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    tool_calls: list[ToolCall] = []
    for j, value in enumerate(parts):
        part_path = at(path, j)
        kind, part = _part(value, part_path)
        if kind == "text":
            (thoughts if part.get("thought") else texts).append(part["text"])
        elif kind == "functionCall":
            call_path = at(part_path, "functionCall")
            call = as_object(part["functionCall"], call_path)
            name = req_str(call, "name", call_path)
            args = call.get("args")
            args = {} if args is None else as_object(args, at(call_path, "args"))
            call_id = opt_str(call, "id", call_path) or f"{name}-{index}-{j}"
            calls.setdefault(name, []).append(call_id)
            tool_calls.append(ToolCall(id=call_id, name=name, arguments=dumps(args).decode()))
        elif kind == "functionResponse":
            raise bad(part_path, "functionResponse parts belong in a user turn")
    # Streamed text arrives split across chunks at arbitrary points: the pieces are one text.
    return Message(
        role="assistant",
        content="".join(texts),
        reasoning="".join(thoughts) or None,
        tool_calls=tool_calls,
    )


def _user_turn(parts: list[Any], path: str, calls: dict[str, list[str]]) -> list[Message]:
    results: list[Message] = []
    texts = []
    for j, value in enumerate(parts):
        part_path = at(path, j)
        kind, part = _part(value, part_path)
        if kind == "text":
            texts.append(part["text"])
        elif kind == "functionResponse":
            results.append(_function_response(part["functionResponse"], at(part_path, kind), calls))
        elif kind == "functionCall":
            raise bad(part_path, "functionCall parts belong in a model turn")
    if texts or not results:
        results.append(Message(role="user", content=PART_SEPARATOR.join(texts)))
    return results


def _function_response(value: Any, path: str, calls: dict[str, list[str]]) -> Message:
    obj = as_object(value, path)
    name = req_str(obj, "name", path)
    response = opt_object(obj, "response", path) or {}
    call_id = opt_str(obj, "id", path)
    pending = calls.get(name) or []
    if call_id is None and pending:
        call_id = pending[0]
    if call_id in pending:
        pending.remove(call_id)
    is_error = False
    if len(response) == 1 and isinstance(next(iter(response.values())), str):
        key, text = next(iter(response.items()))
        is_error = key == "error"
        if key not in ("output", "error"):
            text = dumps(response).decode()
    else:
        text = dumps(response).decode()
    return Message(role="tool", content=text, tool_call_id=call_id, name=name, is_error=is_error)


def _tools(values: list[Any]) -> list[Tool]:
    tools = []
    for k, value in enumerate(values):
        path = at("tools", k)
        obj = as_object(value, path)
        declarations = opt_list(obj, "functionDeclarations", path) or []
        for d, decl_value in enumerate(declarations):
            decl_path = at(at(path, "functionDeclarations"), d)
            decl = as_object(decl_value, decl_path)
            schema = opt_object(decl, "parametersJsonSchema", decl_path)
            if schema is None:
                google = opt_object(decl, "parameters", decl_path)
                schema = _json_schema(google) if google is not None else {}
            tools.append(
                Tool(
                    name=req_str(decl, "name", decl_path),
                    description=opt_str(decl, "description", decl_path) or "",
                    parameters=schema,
                )
            )
    return tools


def _json_schema(node: Any) -> Any:
    """Google's Schema (``type: "OBJECT"``) as JSON Schema (``type: "object"``)."""
    if isinstance(node, list):
        return [_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: JSONObject = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _json_schema(s) for name, s in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf"):
            out[key] = _json_schema(value)
        else:
            out[key] = value
    return out


def _tool_choice(value: JSONObject | None) -> Any:
    if value is None:
        return None
    config = opt_object(value, "functionCallingConfig", "toolConfig")
    if config is None:
        return None
    where = "toolConfig.functionCallingConfig"
    mode = opt_str(config, "mode", where)
    names = str_list(config.get("allowedFunctionNames"), at(where, "allowedFunctionNames"))
    if mode in (None, "MODE_UNSPECIFIED"):
        return None
    if mode not in _MODES:
        raise bad(at(where, "mode"), f"unsupported mode {mode!r} (AUTO, ANY, NONE, VALIDATED)")
    if mode == "ANY" and len(names) == 1:
        return function_choice(names[0])
    return _MODES[mode]


# ---- Responses ----------------------------------------------------------------------------


tool_call_id = id_style("call_", 24)
response_id = id_style("", 24)


def error_body(err: ApiError) -> bytes:
    return dumps(_error_dict(err))


def count_tokens_body(n: int) -> bytes:
    return dumps({"totalTokens": n})


def response_body(c: Completion, req: ChatRequest) -> bytes:
    parts: list[JSONObject] = []
    if c.thinking:
        parts.append({"text": c.thinking, "thought": True})
    if c.text:
        parts.append({"text": c.text})
    parts += [_call_part(call) for call in c.tool_calls]
    body = _chunk(parts, req, c.id, c.finish)
    if req.metadata.get("array"):
        return dumps([body])
    return dumps(body)


async def stream(
    events: AsyncIterator[Event], req: ChatRequest, head: StreamHead
) -> AsyncIterator[bytes]:
    """SSE chunks (``alt=sse``). ``head.created`` is not part of this API's chunks;
    ``modelVersion`` echoes the name in the path."""
    try:
        async for ev in events:
            if isinstance(ev, ThinkingDelta | TextDelta):
                if not ev.text:
                    continue
                part: JSONObject = {"text": ev.text}
                if isinstance(ev, ThinkingDelta):
                    part["thought"] = True
                yield sse(_chunk([part], req, head.id, None))
            elif isinstance(ev, ToolCallEvent):
                yield sse(_chunk([_call_part(ev.call)], req, head.id, None))
            else:
                yield sse(_chunk([], req, head.id, ev))
    except ApiError as err:
        # Headers are gone already: the error travels as a chunk of its own, as Google's does.
        yield sse(_error_dict(err))


def _chunk(
    parts: list[JSONObject], req: ChatRequest, rid: str, finish: Finish | None
) -> JSONObject:
    candidate: JSONObject = {"content": {"role": "model", "parts": parts}, "index": 0}
    out: JSONObject = {"candidates": [candidate], "modelVersion": req.model, "responseId": rid}
    if finish is not None:
        candidate["finishReason"] = _FINISH[finish.reason]
        usage = finish.usage
        out["usageMetadata"] = {
            "promptTokenCount": usage.prompt_tokens,
            "candidatesTokenCount": usage.completion_tokens,
            "totalTokenCount": usage.prompt_tokens + usage.completion_tokens,
        }
    return out


def _call_part(call: ToolCall) -> JSONObject:
    # The core only emits calls whose arguments parse to an object; anything else is its bug.
    args = orjson.loads(call.arguments)
    if not isinstance(args, dict):
        raise ValueError(f"tool call {call.id}: arguments are not a JSON object")
    return {"functionCall": {"id": call.id, "name": call.name, "args": args}}


def _error_dict(err: ApiError) -> JSONObject:
    status = _STATUS.get(err.status)
    if status is None:
        status = "INTERNAL" if err.status >= 500 else "INVALID_ARGUMENT"
    return {"error": {"code": err.status, "message": err.message, "status": status}}
