"""What the trainer needs across machines: samples that reach every rank from the first one, and
FSDP's sharded optimizer state saved and restored whole.

Two machines (here two launches on one host; on a cluster, one per node with its own address):

    accelerate launch --multi_gpu --num_machines 2 --num_processes 2 --machine_rank 0 \\
        --main_process_ip HEAD --main_process_port 29500 -m legorl.cli.main train samples.jsonl \\
        --model fixtures/models/tiny-qwen3 --out ckpt
    accelerate launch --multi_gpu --num_machines 2 --num_processes 2 --machine_rank 1 \\
        --main_process_ip HEAD --main_process_port 29500 -m legorl.cli.main train samples.jsonl \\
        --model fixtures/models/tiny-qwen3 --out ckpt

Only global rank 0 reads the sample files (or stdin); the other ranks get the records over the
process group, so no machine but the first needs them, nor a shared filesystem. Rank 0 alone
writes the checkpoint (the model folder must be on every machine).

FSDP shards Adam's moments over the ranks. ``optimizer.pt`` keeps one layout whatever the
launch: ``torch.optim.Optimizer.state_dict()`` of the unsharded parameters, in the order the
trainer builds its parameter groups. Under FSDP, saving gathers the full state on rank 0
(``get_optimizer_state_dict(full_state_dict=True)``, keyed by parameter name) and renumbers it;
resuming renumbers it back and scatters it (``broadcast_from_rank0``). So a checkpoint saved by
FSDP resumes on one process, and the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from legorl.records import Sample


def shared_samples(samples: Iterable[Sample], accelerator: Any) -> list[Sample]:
    """The samples rank 0 reads, on every rank; the other ranks never touch their input. An
    error while reading (a bad line, a missing file) is raised on rank 0 and, as the same
    exception, on the others, so no rank waits for records that will not come."""
    if accelerator.num_processes == 1:
        return list(samples)
    import torch.distributed as dist

    box: list[Any] = [None]
    failure: BaseException | None = None
    if accelerator.process_index == 0:
        try:
            box[0] = ("ok", list(samples))
        except BaseException as exc:  # re-raised below, once the others have heard
            failure = exc
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "error":
        raise value
    return value


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its own order (index i of its state dict),
    taken before the model is wrapped."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_name(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An index-keyed optimizer state dict keyed by parameter name instead."""
    return {
        "state": {names[int(i)]: s for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }


def by_index(full: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state dict keyed by index (``by_name`` undone)."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in full["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]
        ],
    }


def gather_optimizer_state(
    model: Any, optimizer: Any, names: list[str], is_main: bool
) -> dict[str, Any] | None:
    """The FSDP-sharded optimizer's whole state in ``optimizer.pt``'s layout, on the main
    process (None elsewhere). Every rank must call it: it gathers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return by_index(full, names) if is_main else None


def scatter_optimizer_state(
    model: Any, optimizer: Any, path: Path, names: list[str], is_main: bool
) -> None:
    """Load ``path`` (``optimizer.pt``'s layout) into the FSDP-sharded optimizer: rank 0 reads
    it and every rank takes its shard. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    full = by_name(torch.load(path, weights_only=True), names) if is_main else {}
    set_optimizer_state_dict(
        model,
        optimizer,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
