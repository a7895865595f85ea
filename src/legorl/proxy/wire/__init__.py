"""Wire formats: each API's request body to a ``ChatRequest``, and the core's events back to that
API's JSON body or SSE stream. Pure functions, no I/O; ``WIRES`` picks a module by API name.

- ``openai_chat``: OpenAI Chat Completions, ``POST /v1/chat/completions`` (OpenCode, OpenHands).
- ``anthropic``: Anthropic Messages, ``POST /v1/messages`` and ``/v1/messages/count_tokens``
  (Claude Code).
- ``responses``: OpenAI Responses, ``POST /v1/responses`` (Codex CLI).
- ``gemini``: Google's Gemini API, ``POST /v1beta/models/{model}:generateContent``,
  ``:streamGenerateContent`` and ``:countTokens`` (Gemini CLI).

Whatever the API, the ``ChatRequest`` comes out the same way: text parts of one message joined
with a newline, tool results as ``role: "tool"`` messages, tool-call arguments as JSON text, and
``tool_choice`` in OpenAI Chat's form (``None``, ``"auto"``, ``"none"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``). Responses echo ``req.model``, the name the
harness asked for. Bad requests raise ``ApiError(400, "<field>: <problem>", param="<field>")``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from legorl.proxy.chat import ApiError, ApiName, ChatRequest, Completion, Event, StreamHead
from legorl.proxy.wire import anthropic, gemini, openai_chat, responses


class WireModule(Protocol):
    """What every wire module provides (modules satisfy it structurally)."""

    def parse_request(self, body: bytes) -> ChatRequest:
        """The request, or ``ApiError(400)`` naming the bad field. Unknown fields are ignored."""
        ...

    def error_body(self, err: ApiError) -> bytes:
        """The API's own error JSON for ``err``."""
        ...

    def response_body(self, c: Completion, req: ChatRequest) -> bytes:
        """The non-streaming JSON body."""
        ...

    def stream(
        self, events: AsyncIterator[Event], req: ChatRequest, head: StreamHead
    ) -> AsyncIterator[bytes]:
        """SSE bytes, yielded as the events arrive."""
        ...

    def tool_call_id(self) -> str:
        """A fresh tool-call id in the API's style."""
        ...

    def response_id(self) -> str:
        """A fresh response id in the API's style (``chatcmpl-…``, ``msg_…``, ``resp_…``)."""
        ...


WIRES: dict[ApiName, WireModule] = {
    "openai_chat": openai_chat,
    "anthropic": anthropic,
    "responses": responses,
    "gemini": gemini,
}

__all__ = ["WIRES", "WireModule", "anthropic", "gemini", "openai_chat", "responses"]
