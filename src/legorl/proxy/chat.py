"""The proxy's API-neutral chat: what every wire format is parsed into and answered from.

Wire modules (`legorl.proxy.wire.*`) turn an OpenAI Chat, Anthropic Messages, Responses or Gemini
body into a ``ChatRequest``; the core renders it with the model's chat template, generates, parses
the completion into ``Event``s and hands them back to the wire module, which writes that API's
JSON body or SSE stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ApiName = Literal["openai_chat", "anthropic", "responses", "gemini"]


@dataclass(slots=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the harness (or the model) wrote it


@dataclass(slots=True, kw_only=True)
class Message:
    """One chat message in the shape chat templates take (OpenAI Chat-like, content as text)."""

    role: Role
    content: str = ""
    reasoning: str | None = None  # thinking of an assistant turn, when the harness sends it back
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # on role "tool": the call it answers
    name: str | None = None  # on role "tool": the tool's name, when the API gives it
    is_error: bool = False  # on role "tool": Anthropic's is_error

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments_for_template(c)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments_for_template(call: ToolCall) -> Any:
    # Templates print a parsed mapping with `tojson`; harnesses send JSON text. Parse it so the
    # re-printed form is the template's own, as a real serving stack would.
    import orjson

    try:
        value = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


@dataclass(slots=True, kw_only=True)
class Tool:
    """A function tool, whatever API it came from."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # JSON Schema

    def template_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(slots=True, kw_only=True)
class ChatRequest:
    api: ApiName
    model: str  # as the harness asked
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    thinking: bool = True  # whether the harness wants reasoning back (Anthropic `thinking`)
    tool_choice: Any = None
    seed: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # wire-specific, for the response


# ---- What the core hands back, as a stream of events ---------------------------------------


@dataclass(slots=True)
class ThinkingDelta:
    text: str


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class ToolCallEvent:
    """A whole tool call, parsed once its closing tag arrived."""

    index: int
    call: ToolCall


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(slots=True, kw_only=True)
class Finish:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


Event = ThinkingDelta | TextDelta | ToolCallEvent | Finish


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamHead:
    """What a streamed answer says about itself before its first event."""

    id: str  # the response id, in the API's style (``wire.response_id()``)
    created: int  # Unix time the call arrived
    prompt_tokens: int


@dataclass(slots=True, kw_only=True)
class Completion:
    """The whole answer, for non-streaming responses (the events, collected)."""

    id: str
    model: str
    created: int
    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish: Finish

    @classmethod
    def collect(cls, events: list[Event], *, id: str, model: str, created: int) -> Completion:
        text, thinking, calls = [], [], []
        finish: Finish | None = None
        for ev in events:
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, ThinkingDelta):
                thinking.append(ev.text)
            elif isinstance(ev, ToolCallEvent):
                calls.append(ev.call)
            else:
                finish = ev
        if finish is None:
            raise ValueError("event stream ended without Finish")
        return cls(
            id=id,
            model=model,
            created=created,
            text="".join(text),
            thinking="".join(thinking),
            tool_calls=calls,
            finish=finish,
        )


class ApiError(Exception):
    """A client error, answered in the calling API's own error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
