"""Which parameters a training call trains: a name pattern (``train_params``), one scalar factor
per tensor (``scale_only``), per-group learning rates (``lr_groups``), and the check that a
model and a config agree on them before any step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from legorl.train import lora
from legorl.train.checkpoint import TrainError
from legorl.train.config import TrainConfig
from legorl.train.routing import (
    RoutingSetupError,
    check_router_replay,
)


def trained_parameters(lm: Any, pattern: str) -> list[torch.nn.Parameter]:
    """The parameters to train, the others frozen: those whose name ``pattern`` finds
    (``re.search``), or all of them when it is empty."""
    if not pattern:
        return list(lm.parameters())
    regex = re.compile(pattern)
    chosen = []
    for name, p in lm.named_parameters():
        p.requires_grad_(bool(regex.search(name)))
        if p.requires_grad:
            chosen.append(p)
    if not chosen:
        raise TrainError(f"train_params: {pattern!r} matches no parameter of the model")
    return chosen


class _Scale(torch.nn.Module):
    """``W -> factor * W``: a tensor trained only through one scalar (``scale_only``)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = torch.nn.Parameter(torch.ones(()))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.factor.to(weight.dtype)


def scale_only_targets(lm: Any, params: list[torch.nn.Parameter], config: TrainConfig) -> list[str]:
    """The names of the trained ``params`` that ``scale_only`` finds ([] when it is empty); a
    pattern that finds none of them is a TrainError."""
    if not config.scale_only:
        return []
    regex = re.compile(config.scale_only)
    trained = {id(p) for p in params}
    names = [n for n, p in lm.named_parameters() if id(p) in trained and regex.search(n)]
    if not names:
        raise TrainError(
            f"scale_only: {config.scale_only!r} finds none of the parameters that train_params "
            f"{config.train_params!r} trains"
        )
    return names


def scale_only_parameters(
    lm: Any, params: list[torch.nn.Parameter], config: TrainConfig
) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: ``params``, except that each one ``scale_only``
    finds is frozen and multiplied by a new scalar factor (starting at 1) that is trained in
    its place. ``fold_scales`` writes the products back before saving."""
    names = scale_only_targets(lm, params, config)
    if not names:
        return params
    from torch.nn.utils import parametrize

    for name in names:
        module_name, _, attr = name.rpartition(".")
        module = lm.get_submodule(module_name)
        getattr(module, attr).requires_grad_(False)
        parametrize.register_parametrization(module, attr, _Scale())
    return [p for p in lm.parameters() if p.requires_grad]


def fold_scales(lm: Any) -> None:
    """Replace each ``scale_only`` tensor by ``factor * W``, leaving plain parameters again."""
    from torch.nn.utils import parametrize

    for module in list(lm.modules()):
        if parametrize.is_parametrized(module):
            for attr in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, attr, leave_parametrized=True)


def lr_param_groups(
    lm: Any, params: list[torch.nn.Parameter], config: TrainConfig
) -> list[dict[str, Any]]:
    """Optimizer groups of the trained ``params``: one per ``lr_groups`` entry (the first entry
    whose regex finds a parameter's name takes it), then the rest at ``lr``. An entry that takes
    no trained parameter is a TrainError: its lr would silently do nothing."""
    entries = config.lr_group_entries()
    if not entries:
        return [{"params": params, "lr": config.lr}]
    trained = {id(p) for p in params}
    taken: list[list[torch.nn.Parameter]] = [[] for _ in entries]
    rest = []
    for name, p in lm.named_parameters():
        if id(p) not in trained:
            continue
        for i, (pattern, _) in enumerate(entries):
            if re.search(pattern, name):
                taken[i].append(p)
                break
        else:
            rest.append(p)
    for (pattern, _), got in zip(entries, taken, strict=True):
        if not got:
            raise TrainError(
                f"lr_groups: {pattern!r} takes no trained parameter (it finds none of those "
                f"train_params {config.train_params!r} trains, or an earlier entry took them)"
            )
    groups = [{"params": got, "lr": lr} for (_, lr), got in zip(entries, taken, strict=True)]
    if rest:
        groups.append({"params": rest, "lr": config.lr})
    return groups


def check_parameter_choice(model_dir: str | Path, config: TrainConfig) -> None:
    """Raise TrainError, as ``train`` would, when ``train_params``, ``scale_only`` or an
    ``lr_groups`` entry takes no parameter, or router_replay=r3 meets a dense model of the model in ``model_dir``; only its names are built (meta device).
    A model that cannot be built this way is not checked here: ``train`` says what is wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(model_config)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if config.lora:
        try:
            lora.linear_targets(lm, config.lora_targets)
        except lora.LoraError as exc:
            raise TrainError(str(exc)) from None
        return
    params = trained_parameters(lm, config.train_params)
    scale_only_targets(lm, params, config)
    lr_param_groups(lm, params, config)
    try:  # router_replay=r3 on a dense model
        check_router_replay(lm, model_dir, config)
    except RoutingSetupError as exc:
        raise TrainError(str(exc)) from None
