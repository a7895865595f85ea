#!/usr/bin/env python3
"""legorl's built-in minimal agent: one file, standard library only, copied into the sandbox.

    python3 mini_agent.py --base-url http://127.0.0.1:8000/s/SESSION~SECRET/v1 --task problem.md

It speaks OpenAI Chat with three tools to the proxy, like any real harness: `bash` runs a
command, `edit` replaces one exact snippet of a file, `submit` ends the run. With
`--compact-tokens N` it compacts its context once a prompt passes N tokens: it asks the model
for a summary and restarts its history from the task plus that summary, so runs produce real
segment breaks. Exit codes: 0 submitted, 3 gave up (no submit within --max-turns), 4 the API
failed, anything else a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

SYSTEM = (
    "You are a coding agent working in a git repository. Find and fix the bug described by "
    "the user. Use the tools: bash to run commands, edit to change a file, submit when done."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "Replace the exact text `old` with `new` in the file at `path`.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish: the fix is in place.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
EXIT_SUBMITTED, EXIT_GAVE_UP, EXIT_API = 0, 3, 4


class ApiFailure(Exception):
    pass


def chat(args: argparse.Namespace, messages: list[dict], tools: bool = True, call: int = 0) -> dict:
    body: dict = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if args.seed is not None:  # one seed per call: the same run replays, calls differ
        body["seed"] = args.seed + call
    if tools:
        body["tools"] = TOOLS
    request = urllib.request.Request(
        args.base_url.rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer legorl-mini"},
    )
    try:
        with urllib.request.urlopen(request, timeout=args.api_timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ApiFailure(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ApiFailure(str(exc)) from None


def run_tool(name: str, arguments: str, args: argparse.Namespace) -> tuple[str, bool]:
    """(observation, submitted)."""
    try:
        params = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: arguments are not valid JSON ({exc})", False
    if not isinstance(params, dict):
        return "error: arguments must be a JSON object", False
    if name == "submit":
        return "submitted", True
    if name == "bash":
        command = params.get("command")
        if not isinstance(command, str):
            return "error: bash needs a string `command`", False
        try:
            proc = subprocess.run(
                command,
                shell=True,
                capture_output=True,
                text=True,
                timeout=args.command_timeout,
                cwd=args.cwd,
            )
        except subprocess.TimeoutExpired:
            return f"error: command timed out after {args.command_timeout}s", False
        out = (proc.stdout + proc.stderr)[-args.max_output :]
        return f"{out}\n[exit code {proc.returncode}]".strip(), False
    if name == "edit":
        path, old, new = params.get("path"), params.get("old"), params.get("new")
        if not (isinstance(path, str) and isinstance(old, str) and isinstance(new, str)):
            return "error: edit needs string `path`, `old` and `new`", False
        full = os.path.join(args.cwd, path)
        try:
            with open(full, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            return f"error: cannot read {path}: {exc.strerror}", False
        count = text.count(old)
        if count != 1:
            return f"error: `old` occurs {count} times in {path}; it must occur exactly once", False
        with open(full, "w", encoding="utf-8") as fh:
            fh.write(text.replace(old, new, 1))
        return f"edited {path}", False
    return f"error: unknown tool {name!r} (use bash, edit or submit)", False


def compact(args: argparse.Namespace, messages: list[dict], task: str) -> list[dict]:
    # Same tools and system prompt: the summary is the agent's own turn in its main session
    # (a tool-less call would be routed to an auxiliary sub-session and not trained).
    ask = messages + [
        {
            "role": "user",
            "content": "Summarise what you found and did so far "
            "in a few lines. Do not call a tool.",
        }
    ]
    answer = chat(args, ask, call=10_000)["choices"][0]["message"].get("content") or ""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{task}\n\nProgress so far:\n{answer}"},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--task", required=True, help="file holding the problem statement")
    parser.add_argument("--model", default="legorl")
    parser.add_argument("--cwd", default=os.getcwd())
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--compact-tokens", type=int, default=0, help="0: never compact")
    parser.add_argument("--command-timeout", type=float, default=60.0)
    parser.add_argument("--api-timeout", type=float, default=600.0)
    parser.add_argument("--max-output", type=int, default=2000)
    args = parser.parse_args(argv)
    with open(args.task, encoding="utf-8") as fh:
        task = fh.read()
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task},
    ]
    try:
        for turn in range(args.max_turns):
            answer = chat(args, messages, call=turn)
            message = answer["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            messages.append(
                {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}
                if calls
                else {"role": "assistant", "content": message.get("content") or ""}
            )
            if not calls:
                messages.append({"role": "user", "content": "Use a tool: bash, edit or submit."})
            for call in calls:
                fn = call.get("function") or {}
                observation, submitted = run_tool(fn.get("name", ""), fn.get("arguments", ""), args)
                print(f"[turn {turn}] {fn.get('name')}: {observation[:200]}", flush=True)
                if submitted:
                    return EXIT_SUBMITTED
                messages.append(
                    {"role": "tool", "tool_call_id": call.get("id", ""), "content": observation}
                )
            used = (answer.get("usage") or {}).get("prompt_tokens", 0)
            if args.compact_tokens and used > args.compact_tokens:
                messages = compact(args, messages, task)
                print(f"[turn {turn}] compacted at {used} prompt tokens", flush=True)
    except ApiFailure as exc:
        print(f"mini: the API failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_API
    print(f"mini: no submit within {args.max_turns} turns", file=sys.stderr, flush=True)
    return EXIT_GAVE_UP


if __name__ == "__main__":
    sys.exit(main())
