"""Token bookkeeping of one proxy session: which tokens the next prompt is made of.

For every request the harness sends its whole history again, re-serialised its own way. The
session keeps, per segment, the exact tokens so far (prompts and sampled completions) and the
messages they stand for. A request whose history matches those messages — our own assistant
turns recognised by tool-call ids, then by text, however the harness re-printed them — is a
continuation: only the new messages are rendered, and the earlier completions stay the raw
sampled tokens. Anything else (compaction, truncation, edits, other tools) opens a new segment.

Calls with no tools, or with a system prompt other than the main agent's (title generation,
sub-agents), go to auxiliary sub-sessions of their own, flagged ``aux``.

The main agent's system prompt is bound once and never changes. Where the harness declares it
(``main_system`` at open: the rollout passes the harness's own, e.g. the mini agent's), it is
bound when the session opens. Otherwise the rollout cannot know it (Claude Code's depends on
its version, the date and the working directory), and the first tool-bearing call binds it;
the proxy lets only the session's own route reach a session it opened (``ProxyCore``), so that
call is the run's own harness or agent, never another sandbox's client.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from legorl.proxy.chat import ChatRequest, Message, Tool, ToolCall
from legorl.proxy.tokens import ChatTokenizer


@dataclass(slots=True)
class Generated:
    """An assistant turn the proxy sampled itself."""

    text: str
    thinking: str
    tool_calls: list[ToolCall]


Entry = Message | Generated


@dataclass(slots=True)
class Segment:
    index: int
    tools: list[Tool]
    tokens: list[int] = field(default_factory=list)  # every prompt delta and completion so far
    entries: list[Entry] = field(default_factory=list)  # the messages those tokens stand for
    completion_ended: bool = True  # did the last completion end with the end-of-turn token


@dataclass(slots=True, kw_only=True)
class PromptPlan:
    """The prompt for one call, as the Turn record will store it."""

    sub: SubSession
    segment: int
    segment_reason: str | None
    prompt_offset: int
    prompt_delta: list[int]
    new_entries: list[Message]
    realigned: int
    _segment: Segment | None = None  # a new segment, installed on commit

    @property
    def prompt_ids(self) -> list[int]:
        seg = self.sub.current if self._segment is None else self._segment
        base = seg.tokens[: self.prompt_offset] if seg is not None else []
        return base + self.prompt_delta


@dataclass(slots=True)
class SubSession:
    id: str
    aux: bool
    system: str
    current: Segment | None = None
    segments: int = 0
    turns: int = 0


def _norm(text: str) -> str:
    return " ".join(text.split())


def _same(entry: Entry, msg: Message) -> tuple[bool, bool]:
    """(matches, harness re-serialised it differently) for one history position."""
    if isinstance(entry, Message):
        return entry == msg, False
    if msg.role != "assistant":
        return False, False
    if entry.tool_calls:
        ours = [c.id for c in entry.tool_calls]
        if [c.id for c in msg.tool_calls] != ours:
            return False, False
    elif msg.tool_calls or _norm(msg.content) != _norm(entry.text):
        return False, False
    differs = (
        msg.content != entry.text
        or (msg.reasoning or "") != entry.thinking
        or [(c.name, c.arguments) for c in msg.tool_calls]
        != [(c.name, c.arguments) for c in entry.tool_calls]
    )
    return True, differs


class Session:
    """One harness run's calls: a main sub-session and any auxiliary ones."""

    def __init__(
        self,
        id: str,
        tokenizer: ChatTokenizer,
        *,
        main_system: str | None = None,
        adapter: str | None = None,
    ) -> None:
        self.id = id
        self.tok = tokenizer
        self.adapter = adapter  # the LoRA adapter its calls sample with; None: the policy
        # (adapter, version) its first call sampled with, on an engine that keeps earlier
        # versions: its later calls ask for that version while the engine holds it
        self.pinned: tuple[str, int] | None = None
        self.main: SubSession | None = None
        if main_system is not None:
            self.main = SubSession(id, aux=False, system=main_system)
        self.aux: dict[str, SubSession] = {}

    # ---- routing ------------------------------------------------------------------------

    def route(self, req: ChatRequest) -> SubSession:
        system = (
            req.messages[0].content if req.messages and req.messages[0].role == "system" else ""
        )
        if req.tools and (self.main is None or self.main.system == system):
            if self.main is None:
                self.main = SubSession(self.id, aux=False, system=system)
            return self.main
        first_user = next((m.content for m in req.messages if m.role == "user"), "")
        key = hashlib.sha1(f"{system}\0{first_user}".encode()).hexdigest()[:10]
        sub = self.aux.get(key)
        if sub is None:
            sub = SubSession(f"{self.id}~aux-{key}", aux=True, system=system)
            self.aux[key] = sub
        return sub

    # ---- planning and committing --------------------------------------------------------

    def plan(self, req: ChatRequest) -> PromptPlan:
        """Decide the prompt tokens of ``req``; nothing changes until ``commit``."""
        sub = self.route(req)
        seg = sub.current
        msgs = req.messages
        reason: str | None = None
        if seg is None:
            reason = "start"
        elif seg.tools != req.tools:
            reason = "tools_changed"
        else:
            realigned = 0
            k = 0
            for entry, msg in zip(seg.entries, msgs, strict=False):
                ok, differs = _same(entry, msg)
                if not ok:
                    break
                realigned += differs
                k += 1
            if k == len(seg.entries) and len(msgs) > k:
                new = msgs[k:]
                delta = self.tok.continuation(new, completion_ended=seg.completion_ended)
                return PromptPlan(
                    sub=sub,
                    segment=seg.index,
                    segment_reason=None,
                    prompt_offset=len(seg.tokens),
                    prompt_delta=delta,
                    new_entries=list(new),
                    realigned=realigned,
                )
            if k == len(msgs):
                reason = f"truncated to {k} of {len(seg.entries)} messages"
            else:
                reason = f"history rewritten at message {k}"
        index = sub.segments
        fresh = Segment(index=index, tools=list(req.tools))
        return PromptPlan(
            sub=sub,
            segment=index,
            segment_reason=reason,
            prompt_offset=0,
            prompt_delta=self.tok.full_prompt(msgs, req.tools),
            new_entries=list(msgs),
            realigned=0,
            _segment=fresh,
        )

    def commit(
        self,
        plan: PromptPlan,
        completion_ids: list[int],
        output: Generated,
    ) -> int:
        """Record a finished call; returns its turn index within its sub-session."""
        sub = plan.sub
        if plan._segment is not None:
            sub.current = plan._segment
            sub.segments += 1
        seg = sub.current
        assert seg is not None
        del seg.tokens[plan.prompt_offset :]
        seg.tokens.extend(plan.prompt_delta)
        seg.tokens.extend(completion_ids)
        seg.entries.extend(plan.new_entries)
        seg.entries.append(output)
        seg.completion_ended = bool(completion_ids) and completion_ids[-1] in self.tok.stop_ids
        turn = sub.turns
        sub.turns += 1
        return turn
