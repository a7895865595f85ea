"""Harness sessions captured through the real proxy, for the align tests and the README example.

Four sessions, each one trajectory, recorded by a real `legorl proxy` server with the `forced`
engine (scripted completions, log-probs from a real forward pass of the tiny model):

* ``s-reser`` (OpenAI Chat, inline turns): every tool call is sent back re-printed (other key
  order, spaces) and without its thinking;
* ``s-think`` (Anthropic Messages): thinking blocks are stripped from the history, tool inputs
  re-serialised by the API's own JSON;
* ``s-compact`` (OpenAI Chat): the harness compacts its history after two calls: two segments;
* ``s-sub`` (OpenAI Chat): the main agent delegates to a sub-agent (another system prompt) and
  the harness asks for a title (no tools): two auxiliary sub-sessions.

Regenerate the golden copy the README example reads:

    python tests/align/align_sessions.py tests/data/align
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proxy"))

from proxy_harness import MODEL, running_proxy, tokenizer

from legorl.protocols import GenerationRequest
from legorl.records import Trajectory, Turn, read_jsonl, write_jsonl

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
TASK = {
    "type": "function",
    "function": {
        "name": "task",
        "description": "Delegate a search to a sub-agent.",
        "parameters": {"type": "object", "properties": {"prompt": {"type": "string"}}},
    },
}
ANTHROPIC_BASH = {
    "name": "bash",
    "description": "Run a shell command.",
    "input_schema": BASH["function"]["parameters"],
}
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
USER = {"role": "user", "content": "List the files, read a.py, then say what it prints."}


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{args}}}\n</tool_call>'


# Completions in call order, across all four sessions (the forced engine serves them in order).
SCRIPT = [
    # s-reser
    "<think>\nI should look at the files first.\n</think>\n\n"
    + call("bash", '{"command":"ls -la","timeout":5}'),
    call("bash", '{"command":"cat a.py","timeout":5}'),
    "Done: a.py prints hello.",
    # s-think
    "<think>\nThe user wants the tests run.\n</think>\n\nI will run the tests first.",
    "<think>\nRun pytest quietly.\n</think>\n\n" + call("bash", '{"command":"pytest -q"}'),
    "All 3 tests pass.",
    # s-compact
    call("bash", '{"command":"ls"}'),
    call("bash", '{"command":"cat a.py"}'),
    call("bash", '{"command":"python a.py"}'),
    "Done: it prints hello.",
    # s-sub
    call("task", '{"prompt":"find the python files"}'),
    call("bash", '{"command":"find . -name \'*.py\'"}'),
    "Found a.py and b.py.",
    "Listing python files",
    "Done: a.py and b.py.",
]

#: The episode's samples the align stage should make by default, and with --include-aux:
#: (session, segment, request indices in SCRIPT that the sample is made of, aux).
EXPECTED = {
    "s-reser": [("s-reser", 0, [0, 1, 2], False)],
    "s-think": [("s-think", 0, [3, 4, 5], False)],
    "s-compact": [("s-compact", 0, [6, 7], False), ("s-compact", 1, [8, 9], False)],
    "s-sub": [("s-sub", 0, [10, 14], False)],
}
EXPECTED_WITH_AUX = {
    **EXPECTED,
    "s-sub": [
        ("s-sub", 0, [10, 14], False),
        ("s-sub~aux", 0, [11, 12], True),
        ("s-sub~aux", 0, [13], True),
    ],
}
REWARDS = {"s-reser": 1.0, "s-think": 0.0, "s-compact": 1.0, "s-sub": 0.5}


@dataclass
class Captured:
    folder: Path  # holds trajectories.jsonl and turns/
    trajectories: list[Trajectory]
    requests: list[GenerationRequest]  # every engine request, in call order
    completions: list[list[int]]  # the scripted completion tokens, in call order
    final_messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tools: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.folder / "trajectories.jsonl"


def _chat(url: str, session: str, messages: list[dict[str, Any]], tools: Any = None) -> dict:
    body: dict[str, Any] = {"model": "gpt-5", "messages": messages}
    if tools:
        body["tools"] = tools
    resp = httpx.post(f"{url}/s/{session}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def _reprinted(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as a harness sends it back: no thinking, arguments re-printed."""
    calls = []
    for c in message.get("tool_calls") or []:
        args = json.loads(c["function"]["arguments"])
        reordered = dict(reversed(list(args.items())))
        calls.append(
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.dumps(reordered)},
            }
        )
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if calls:
        out["tool_calls"] = calls
    return out


def _result(message: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": content}


def _reserialised(url: str) -> list[dict[str, Any]]:
    msgs = [SYSTEM, USER]
    for result in ("a.py\nb.py", "print('hello')", None):
        answer = _chat(url, "s-reser", msgs, [BASH])
        msgs = [*msgs, _reprinted(answer)]
        if result is not None:
            msgs.append(_result(answer, result))
    return msgs


def _stripped_thinking(url: str) -> None:
    def messages(msgs: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "model": "claude-x",
            "max_tokens": 200,
            "system": SYSTEM["content"],
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "tools": [ANTHROPIC_BASH],
            "messages": msgs,
        }
        resp = httpx.post(f"{url}/s/s-think/v1/messages", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def no_thinking(answer: dict[str, Any]) -> dict[str, Any]:
        blocks = [b for b in answer["content"] if b["type"] != "thinking"]
        return {"role": "assistant", "content": blocks}

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Run the tests, please."}]
    first = messages(msgs)
    assert [b["type"] for b in first["content"]] == ["thinking", "text"]
    msgs += [no_thinking(first), {"role": "user", "content": "Go ahead."}]
    second = messages(msgs)
    use = second["content"][-1]
    assert use["type"] == "tool_use"
    msgs += [
        no_thinking(second),
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3 passed"}],
        },
    ]
    messages(msgs)


def _compaction(url: str) -> None:
    msgs = [SYSTEM, USER]
    first = _chat(url, "s-compact", msgs, [BASH])
    msgs += [_reprinted(first), _result(first, "a.py")]
    _chat(url, "s-compact", msgs, [BASH])
    compacted = [
        SYSTEM,
        {"role": "user", "content": "Summary: you listed the files and read a.py. Continue."},
    ]
    third = _chat(url, "s-compact", compacted, [BASH])
    _chat(url, "s-compact", [*compacted, _reprinted(third), _result(third, "hello")], [BASH])


def _sub_agent(url: str) -> None:
    main = [SYSTEM, USER]
    delegate = _chat(url, "s-sub", main, [BASH, TASK])
    sub = [
        {"role": "system", "content": "You are a file-search sub-agent. Report what you find."},
        {"role": "user", "content": "find the python files"},
    ]
    found = _chat(url, "s-sub", sub, [BASH])
    _chat(url, "s-sub", [*sub, _reprinted(found), _result(found, "./a.py\n./b.py")], [BASH])
    title = [{"role": "system", "content": "Generate a title for the conversation."}, USER]
    _chat(url, "s-sub", title)
    main += [_reprinted(delegate), _result(delegate, "Found a.py and b.py.")]
    _chat(url, "s-sub", main, [BASH, TASK])


def capture(folder: Path, *, engine_dtype: str = "float32") -> Captured:
    """Run the four sessions through a real proxy; write trajectories.jsonl and turns/."""
    folder.mkdir(parents=True, exist_ok=True)
    turns_dir = folder / "turns"
    script = [{"text": text} for text in SCRIPT]
    with running_proxy(turns_dir, script, engine_dtype=engine_dtype) as proxy:
        final = _reserialised(proxy.url)
        _stripped_thinking(proxy.url)
        _compaction(proxy.url)
        _sub_agent(proxy.url)
        requests = list(proxy.core.engine.requests)  # type: ignore[attr-defined]
    tok = tokenizer()
    completions = [tok.encode(text) + [tok.eos_id] for text in SCRIPT]
    assert len(requests) == len(SCRIPT)
    trajectories = []
    for i, (session, reward) in enumerate(REWARDS.items()):
        ref = f"turns/{session}.jsonl"
        inline = session == "s-reser"
        turns: list[Turn] | None = list(read_jsonl(folder / ref, Turn)) if inline else None
        trajectories.append(
            Trajectory(
                trajectory_id=session,
                task_id=f"toy-{i}",
                group_id=f"group-{i % 2}",
                sample_index=i,
                harness="scripted",
                status="ok",
                turns=turns,
                turns_ref=None if inline else [ref],
                reward=reward,
            )
        )
    if (folder / "turns" / "s-reser.jsonl").exists():
        (folder / "turns" / "s-reser.jsonl").unlink()  # inline: the file is not needed
    path = folder / "trajectories.jsonl"
    path.unlink(missing_ok=True)
    write_jsonl(path, trajectories)
    return Captured(
        folder=folder,
        trajectories=trajectories,
        requests=requests,
        completions=completions,
        final_messages={"s-reser": final},
        tools={"s-reser": [BASH]},
    )


_CAPTURED: dict[str, Captured] = {}


def capture_once(factory: Any, engine_dtype: str = "float32") -> Captured:
    """One capture per engine dtype and test run, in a folder of pytest's ``tmp_path_factory``;
    tests that change files copy the folder first."""
    if engine_dtype not in _CAPTURED:
        _CAPTURED[engine_dtype] = capture(factory.mktemp(engine_dtype), engine_dtype=engine_dtype)
    return _CAPTURED[engine_dtype]


def write_golden(folder: Path) -> None:
    """The README example's input: the four sessions plus two episodes align must drop."""
    captured = capture(folder)
    extra = [
        Trajectory(
            trajectory_id="crashed",
            task_id="toy-9",
            group_id="group-1",
            sample_index=9,
            harness="scripted",
            status="sandbox_error",
            turns_ref=["turns/s-reser-missing.jsonl"],  # never read: dropped first
        ),
        Trajectory(
            trajectory_id="ungraded",
            task_id="toy-8",
            group_id="group-0",
            sample_index=8,
            harness="scripted",
            status="ok",
            turns=[],
        ),
    ]
    captured.path.unlink()
    write_jsonl(folder / "graded.jsonl", [*captured.trajectories, *extra])


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/graded.jsonl and its turns/ (model: {MODEL})")
