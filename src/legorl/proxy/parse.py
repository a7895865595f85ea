"""From sampled token ids to what the harness sees: incremental detokenisation, `<think>`
reasoning, and tool calls in Qwen's JSON form (`<tool_call>{"name": …, "arguments": …}</tool_call>`)
or Qwen3-Coder's XML form (`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…`).

`OutputParser.feed(text)` returns events as soon as they are certain; text that could still be
the start of a tag is held back until the next chunk (or `finish`). A tool call that does not
parse is returned as plain text and flagged (`malformed`), never an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from legorl.proxy.chat import Event, TextDelta, ThinkingDelta, ToolCall, ToolCallEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class Detokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Byte-level BPE tokens may end inside a UTF-8 character; such a tail is held back (it decodes
    to U+FFFD) until the next token completes it. Cost per token is constant.
    """

    def __init__(self, decode: Callable[[list[int]], str], skip_ids: set[int]) -> None:
        self._decode = decode
        self._skip = skip_ids
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids up to here have been emitted as text

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(t for t in token_ids if t not in self._skip)
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix, self._read = max(self._read - 4, 0), len(self._ids)
        return after[len(before) :]


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def parse_tool_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) from the inside of a `<tool_call>` block, or None."""
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            obj = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        # Keep the model's own spelling of the arguments when it wrote an object: that text is
        # what it sampled. Re-encode only when it had to be decoded from a string.
        raw = _raw_arguments(stripped)
        return obj["name"], raw if raw is not None else orjson.dumps(args).decode()
    match = _XML_FUNCTION.search(stripped)
    if match is None:
        return None
    params: dict[str, Any] = {}
    for key, value in _XML_PARAMETER.findall(match.group(2)):
        try:
            params[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            params[key] = value
    return match.group(1), orjson.dumps(params).decode()


def _raw_arguments(text: str) -> str | None:
    # The JSON text of the "arguments" object exactly as emitted, found by a bracket scan.
    key = text.find('"arguments"')
    if key < 0:
        return None
    start = text.find("{", key)
    colon = text.find(":", key)
    if start < 0 or colon < 0 or text[colon + 1 : start].strip():
        return None
    depth, in_str, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def _partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class OutputParser:
    """Splits streamed completion text into thinking, text and tool-call events."""

    def __init__(self, new_call_id: Callable[[], str], *, thinking_open: bool = False) -> None:
        self._new_id = new_call_id
        # "think": inside <think>; "start": before any output (a <think> may open);
        # "text": plain text; "call": inside <tool_call>.
        self._state = "think" if thinking_open else "start"
        self._buf = ""
        self._fresh = True  # at the start of a thinking or text run: leading whitespace is dropped
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []
        self.malformed = False

    def feed(self, chunk: str) -> list[Event]:
        self._buf += chunk
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _emit_text(self, out: list[Event], s: str) -> None:
        if s:
            self.text.append(s)
            out.append(TextDelta(s))

    def _emit_thinking(self, out: list[Event], s: str) -> None:
        if s:
            self.thinking.append(s)
            out.append(ThinkingDelta(s))

    def _drain(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            buf = self._buf
            if self._state == "start":
                lead = buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    self._buf = lead[len(THINK_OPEN) :]
                    self._state, self._fresh = "think", True
                    continue
                if not final and THINK_OPEN.startswith(lead):
                    break  # could still become <think>
                self._buf = lead
                self._state = "text"
                continue
            if self._fresh and self._state in ("think", "text"):
                self._buf = buf = buf.lstrip()
                if not buf:
                    break
                self._fresh = False
            if self._state == "think":
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    self._emit_thinking(out, buf[:end].rstrip("\n") if end else "")
                    self._buf = buf[end + len(THINK_CLOSE) :]
                    self._state, self._fresh = "text", True
                    continue
                keep = 0 if final else _partial_tag_suffix(buf, (THINK_CLOSE,))
                # Trailing newlines may be the separator before </think>: hold them back too.
                body = buf[: len(buf) - keep]
                hold = len(body) - len(body.rstrip("\n")) if not final else 0
                self._emit_thinking(out, body[: len(body) - hold])
                self._buf = buf[len(body) - hold :]
                break
            if self._state == "text":
                start = buf.find(CALL_OPEN)
                if start >= 0:
                    self._emit_text(out, buf[:start].rstrip())
                    self._buf = buf[start + len(CALL_OPEN) :]
                    self._state = "call"
                    continue
                keep = 0 if final else _partial_tag_suffix(buf, (CALL_OPEN,))
                body = buf[: len(buf) - keep]
                # Whitespace is held back until something follows it: before a tool call or at
                # the end it is only the template's separator.
                shown = body.rstrip()
                self._emit_text(out, shown)
                self._buf = "" if final else buf[len(shown) :]
                break
            # inside a tool call
            end = buf.find(CALL_CLOSE)
            if end < 0:
                if final:  # unterminated: give it back as text
                    self.malformed = True
                    self._emit_text(out, CALL_OPEN + buf)
                    self._buf = ""
                break
            body, self._buf = buf[:end], buf[end + len(CALL_CLOSE) :]
            parsed = parse_tool_call(body)
            if parsed is None:
                self.malformed = True
                self._emit_text(out, CALL_OPEN + body + CALL_CLOSE)
            else:
                call = ToolCall(id=self._new_id(), name=parsed[0], arguments=parsed[1])
                out.append(ToolCallEvent(len(self.calls), call))
                self.calls.append(call)
            self._state, self._fresh = "text", True
        return out
