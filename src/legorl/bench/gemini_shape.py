"""Gemini CLI-shaped requests for the proxy bench (`python -m legorl.bench --only proxy`, its
``serve_gemini_cli`` figure), sized after what Gemini CLI 0.61.0 sends: a 25k-character
``systemInstruction``, 16 function declarations with ``parametersJsonSchema`` (about 23 KB), a
first user turn of a session-context part and the prompt, its ``generationConfig``, about 49 KB
in all. A later turn appends the model's parts as answered (the first function call given a
``thoughtSignature``, as Gemini CLI does) and a ``functionResponse`` with the call's id.

The bench client reads whole bodies, so calls go to ``:generateContent``; Gemini CLI itself
streams with ``alt=sse``, which the proxy answers from the same parsed request.
"""

from __future__ import annotations

from typing import Any

PATH = "/v1beta/models/gemini-2.5-pro:generateContent"
SYSTEM = ("You are a non-interactive CLI agent specializing in software engineering. " * 340)[
    :25300
]
CONTEXT = (
    "<session_context>\nThis is the Gemini CLI. We are setting up the context for our chat.\n"
    + "The project's folder structure follows.\n" * 12
)[:560] + "\n</session_context>"
_TOOL_SIZES = (1000, 970, 900, 1630, 1120, 4260, 600, 900, 2350, 475, 910, 390, 5630, 305, 795, 710)


def _declarations() -> list[dict[str, Any]]:
    decls = []
    for i, size in enumerate(_TOOL_SIZES):
        props = {
            f"arg_{k}": {"type": "string", "description": f"Argument {k} of tool {i}."}
            for k in range(3)
        }
        decls.append(
            {
                "name": f"tool_{i}",
                "description": ("Does one thing in the workspace. " * (size // 32 + 1))[
                    : max(0, size - 300)
                ],
                "parametersJsonSchema": {
                    "type": "object",
                    "properties": props,
                    "required": ["arg_0"],
                },
            }
        )
    return decls


def first_request(session_turn: int = 0) -> dict[str, Any]:
    return {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": CONTEXT},
                    {"text": f"Fix the failing test in the repository ({session_turn})."},
                ],
            }
        ],
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "tools": [{"functionDeclarations": _declarations()}],
        "generationConfig": {
            "temperature": 1,
            "topP": 0.95,
            "topK": 64,
            "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 8192},
        },
    }


def continue_request(body: dict[str, Any], answer: dict[str, Any], turn: int) -> dict[str, Any]:
    parts = [dict(p) for p in answer["candidates"][0]["content"]["parts"]]
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    if calls:
        next(p for p in parts if "functionCall" in p)["thoughtSignature"] = "skip"
    body["contents"].append({"role": "model", "parts": parts})
    body["contents"].append(
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "id": call["id"],
                        "name": call["name"],
                        "response": {"output": f"total {turn}\nfile_{turn}.py\nREADME.md\n"},
                    }
                }
                for call in calls
            ],
        }
    )
    return body
