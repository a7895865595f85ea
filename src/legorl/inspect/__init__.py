"""`legorl inspect`: a live viewer of trajectory, sample and metric JSONL files (Textual), and a
plain-text summary of the same files.

    legorl inspect runs/graded.jsonl runs/samples.jsonl runs/metrics.jsonl --model fixtures/models/tiny-qwen3
    legorl inspect --summary runs/*.jsonl

Importing this package does not import Textual: ``InspectApp`` is loaded on first use.
"""

from __future__ import annotations

from typing import Any

from legorl.inspect.follow import FileFollower
from legorl.inspect.store import RunStore, compile_query
from legorl.inspect.summary import summarize


def __getattr__(name: str) -> Any:
    if name == "InspectApp":
        from legorl.inspect.app import InspectApp

        return InspectApp
    raise AttributeError(name)


__all__ = ["FileFollower", "InspectApp", "RunStore", "compile_query", "summarize"]
