"""Token-in/token-out engines behind the ``Engine`` protocol, chosen by short name.

    from legorl.engines import make_engine
    engine = make_engine("embedded", model_path="fixtures/models/tiny-qwen3", dtype="bfloat16")
    engine = make_engine("forced", model_path="…", script="script.jsonl")
    engine = make_engine("vllm", base_url="http://gpu-host:8000")

Each backend takes one typed config dataclass (``EmbeddedConfig``, ``ForcedConfig``,
``VllmConfig``) whose defaults live in the class; ``make_engine`` builds it from keyword
arguments and rejects unknown keys (``legorl.registry``). Importing this package does not import torch: the backends
import it when an engine is built.
"""

from __future__ import annotations

from typing import Any

from legorl.protocols import Engine
from legorl.registry import Registry

#: Engine classes by short name; each is built from its ``config_class``.
ENGINES: Registry[Engine] = Registry(
    "engine",
    {
        "embedded": "legorl.engines.embedded:EmbeddedEngine",
        "forced": "legorl.engines.forced:ForcedEngine",
        "vllm": "legorl.engines.vllm_client:VllmEngine",
    },
)


def make_engine(name: str, **config: Any) -> Engine:
    """Build the engine ``name`` (or ``module:Class``) from keyword ``config`` (its config
    dataclass's fields); unknown names and options are ``ConfigError``s."""
    return ENGINES.build(name, **config)


#: The backends' own names, imported when first read (``from legorl.engines import
#: EmbeddedEngine``): importing the package imports none of them.
_LAZY = {
    "EmbeddedConfig": "embedded",
    "EmbeddedEngine": "embedded",
    "EmbeddedStats": "embedded",
    "ForcedConfig": "forced",
    "ForcedEngine": "forced",
    "ForcedScript": "forced",
    "ScriptEntry": "forced",
    "VllmConfig": "vllm_client",
    "VllmEngine": "vllm_client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"legorl.engines.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'legorl.engines' has no attribute {name!r}")


__all__ = ["ENGINES", "make_engine", *_LAZY]
