"""LoRA adapters as engines serve them: PEFT adapter folders, checked against the served base, and
swapped in place on the embedded engine's model.

    info = read_adapter("runs/x/checkpoint")      # an adapter_config.json folder
    check_base(info, served="fixtures/models/tiny-agent")   # AdapterError names both bases
    slots = AdapterSlots(model); slots.load("policy", info)  # peft layers injected once

An adapter folder is what ``legorl train lora=true`` writes (``train/lora.py``): peft's
``adapter_config.json`` and ``adapter_model.safetensors``, its ``base_model_name_or_path`` the
base folder's absolute path. ``AdapterSlots`` keeps one peft adapter per name on the model,
its A and B tensors allocated once; a new version of the same shape is copied into them
(nothing else changes, nothing is re-read later), a new shape re-injects that name. Several
names live side by side on one base: a forward with ``adapter_names`` (one per batch row;
``"__base__"`` for none) runs each row through its own adapter (peft's mixed-batch LoRA).

torch, peft and safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.protocols import BASE_ADAPTER, ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE = BASE_ADAPTER  # peft's name for "no adapter" in a mixed batch, and the engines' too
_PEFT_PREFIX = "base_model.model."  # how peft's files name the adapter tensors


class AdapterError(ConfigError):
    """An adapter folder that cannot be served here; the message names the folder and why."""


def base_gone(version: int) -> str:
    """The refusal of a request for the base model (``BASE_ADAPTER``) once full weights were
    reloaded over it."""
    return (
        f"adapter {BASE_ADAPTER!r} (the base model) is not served: full weights were loaded "
        f"over it (policy version {version}); compare base and policy with LoRA adapters"
    )


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / ADAPTER_CONFIG
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: cannot read it ({exc})") from None
    if not isinstance(data, dict) or data.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: not a LoRA adapter config")
    return data


def adapter_base(path: str | Path) -> Path:
    """The base model folder an adapter was trained on (its ``base_model_name_or_path``)."""
    base = adapter_config(path).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise AdapterError(f"{Path(path) / ADAPTER_CONFIG}: names no base_model_name_or_path")
    return Path(base).resolve()


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    path: Path
    base: Path
    rank: int
    alpha: float
    targets: tuple[str, ...]


def read_adapter(path: str | Path) -> AdapterInfo:
    folder = Path(path)
    data = adapter_config(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}")
    targets = data.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    return AdapterInfo(
        path=folder.resolve(),
        base=adapter_base(folder),
        rank=int(data.get("r", 0)),
        alpha=float(data.get("lora_alpha", 0)),
        targets=tuple(sorted(targets)),
    )


def check_base(info: AdapterInfo, served: str | Path) -> None:
    """Refuse an adapter trained on another base than the ``served`` model folder."""
    if info.base != Path(served).resolve():
        raise AdapterError(
            f"adapter {info.path} was trained on base model {info.base}, but this engine serves "
            f"{Path(served).resolve()}: load it on an engine serving its own base"
        )


class AdapterSlots:
    """Named LoRA adapters on one model, swapped in place (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shapes: dict[str, tuple[int, float, tuple[str, ...]]] = {}

    def load(self, name: str, info: AdapterInfo) -> None:
        """Make ``name`` serve the adapter ``info`` (read from disk now, once)."""
        import torch
        from peft import LoraConfig, inject_adapter_in_model
        from safetensors.torch import load_file

        tensors = load_file(str(info.path / ADAPTER_WEIGHTS))
        shape = (info.rank, info.alpha, info.targets)
        if self.shapes.get(name) != shape:
            if name in self.shapes:
                self.remove(name)
            alpha: dict[str, Any] = {"lora_alpha": info.alpha}  # peft types it int
            config = LoraConfig(
                r=info.rank, target_modules=list(info.targets), bias="none", **alpha
            )
            with warnings.catch_warnings():  # peft warns that a second name is a second adapter
                warnings.simplefilter("ignore", UserWarning)
                inject_adapter_in_model(config, self.model, adapter_name=name)
            self.model.requires_grad_(False)
            self.shapes[name] = shape
        params = dict(self.model.named_parameters())
        wanted = {k for k in params if f".{name}." in k and ".lora_" in k}
        seen = set()
        with torch.no_grad():
            for key, value in tensors.items():
                local = key.removeprefix(_PEFT_PREFIX)
                # peft's files drop the adapter's name: …q_proj.lora_A.weight
                module, _, leaf = local.rpartition(".")
                module, _, kind = module.rpartition(".")
                target = f"{module}.{kind}.{name}.{leaf}"
                if target not in params:
                    raise AdapterError(f"{info.path}: tensor {key} fits no layer of the model")
                params[target].copy_(value.to(params[target].dtype))
                seen.add(target)
        if seen != wanted:
            missing = sorted(wanted - seen)[:3]
            raise AdapterError(f"{info.path}: lacks adapter tensors, e.g. {missing}")
        self._activate()

    def remove(self, name: str) -> None:
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                module.delete_adapter(name)
        self.shapes.pop(name, None)
        self._activate()

    def _activate(self) -> None:
        """Every loaded adapter active on its layers (a plain forward then runs them all, which
        ``routed`` narrows to one per row)."""
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                module.set_adapter([n for n in module.lora_A if n in self.shapes])
        self.model.requires_grad_(False)

    @contextlib.contextmanager
    def routed(self, rows: list[str]) -> Iterator[None]:
        """Within this block, the model's forwards run batch row ``i`` through adapter
        ``rows[i]`` (``BASE``: none)."""
        import torch
        from peft.tuners.lora import LoraLayer

        handles = []

        def hook(_module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
            kwargs["adapter_names"] = rows
            return args, kwargs

        for module in self.model.modules():
            if isinstance(module, LoraLayer) and isinstance(module, torch.nn.Module):
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
