"""Token-in/token-out engines behind the ``Engine`` protocol, chosen by short name.

    from legorl.engines import make_engine
    engine = make_engine("embedded", model_path="fixtures/models/tiny-qwen3", dtype="bfloat16")
    engine = make_engine("forced", model_path="…", script="script.jsonl")
    engine = make_engine("vllm", base_url="http://gpu-host:8000")

Each backend takes one typed config dataclass (``EmbeddedConfig``, ``ForcedConfig``,
``VllmConfig``) whose defaults live in the class; ``make_engine`` builds it from keyword
arguments and rejects unknown keys. Importing this package does not import torch: the backends
import it when an engine is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from legorl.engines.embedded import EmbeddedConfig, EmbeddedEngine, EmbeddedStats
from legorl.engines.forced import ForcedConfig, ForcedEngine, ForcedScript, ScriptEntry
from legorl.engines.vllm_client import VllmConfig, VllmEngine
from legorl.protocols import Engine

#: Engine classes by short name; each has a ``config_class``.
ENGINES: dict[str, type] = {
    "embedded": EmbeddedEngine,
    "forced": ForcedEngine,
    "vllm": VllmEngine,
}


def make_engine(name: str, **config: Any) -> Engine:
    """Build the engine ``name`` from keyword ``config`` (its config dataclass's fields)."""
    try:
        cls = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})") from None
    config_class = cls.config_class  # type: ignore[attr-defined]
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) for engine {name!r}: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    try:
        settings = config_class(**config)
    except TypeError as exc:  # a required option is missing
        raise ValueError(f"engine {name!r}: {exc}") from None
    engine: Engine = cls(settings)
    return engine


__all__ = [
    "ENGINES",
    "EmbeddedConfig",
    "EmbeddedEngine",
    "EmbeddedStats",
    "ForcedConfig",
    "ForcedEngine",
    "ForcedScript",
    "ScriptEntry",
    "VllmConfig",
    "VllmEngine",
    "make_engine",
]
