"""The run configuration a preflight checks (`RunConfig`), from a file or flags."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.check.results import _short
from legorl.protocols import ConfigError

API_NAMES = ("openai_chat", "anthropic", "responses", "gemini")
SANDBOXES = ("local", "docker")


# --------------------------------------------------------------------------------------------
# The run configuration
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class RunConfig:
    """What a run uses, as far as a preflight can check it. Relative paths in a file are taken
    relative to that file's folder."""

    model: str | None = None  # local model folder (tokenizer, template; weights for embedded)
    engine: str = "embedded"  # embedded | forced | vllm
    engine_options: dict[str, Any] = field(default_factory=dict)  # make_engine keyword options
    trainer_model: str | None = None  # what the trainer recomputes log-probs with; None: model
    trainer_dtype: str = "float32"
    harnesses: list[str] = field(default_factory=lambda: ["mini"])
    apis: list[str] = field(default_factory=list)  # API shapes to probe besides the harnesses'
    tasks: str | None = None  # task file (.jsonl, .json, .parquet) or datasets folder
    task_format: str | None = None  # legorl.tasks.FORMATS key; None: detected from the columns
    sandbox: str = "local"  # local | docker
    docker_host: str | None = None  # None: DOCKER_HOST or the default socket
    images: list[str] = field(default_factory=list)  # Docker images the run needs present
    workdir: str = "runs"  # where the run writes; the disk budget is checked there
    disk_budget_gb: float = 5.0


_PATH_FIELDS = ("model", "trainer_model", "tasks", "workdir")


def _yaml_module() -> Any:
    try:
        import yaml
    except ImportError:
        return None
    return yaml


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """A ``RunConfig`` from a ``.yaml``/``.yml`` (needs PyYAML) or ``.json`` file; unknown keys
    and wrong types are ``ConfigError``s naming the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        yaml = _yaml_module()
        if yaml is None:
            raise ConfigError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                "or write the same keys as a .json file"
            )
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: malformed YAML: {_short(exc)}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: malformed JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    config = config_from_dict(data, where=str(path))
    base = path.resolve().parent
    for name in _PATH_FIELDS:
        value = getattr(config, name)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            setattr(config, name, str(base / value))
    return config


def config_from_dict(data: dict[str, Any], where: str = "config") -> RunConfig:
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})"
        )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("harnesses", "apis", "images"):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: {key}: expected a list of strings")
        elif key == "engine_options":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key}: expected a mapping")
        elif key == "disk_budget_gb":
            if type(value) not in (int, float) or value < 0:
                raise ConfigError(f"{where}: {key}: expected a non-negative number")
            value = float(value)
        elif value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: {key}: expected a string")
        kwargs[key] = value
    config = RunConfig(**kwargs)
    if config.sandbox not in SANDBOXES and config.sandbox != "none":
        raise ConfigError(f"{where}: sandbox: expected one of {', '.join(SANDBOXES)}, none")
    bad = [a for a in config.apis if a not in API_NAMES]
    if bad:
        raise ConfigError(
            f"{where}: apis: unknown {', '.join(bad)} (known: {', '.join(API_NAMES)})"
        )
    return config
