"""One optimizer step of the tiny model, FSDP2-sharded over a gloo group when run by torchrun
(``WORLD_SIZE`` > 1), plain on one process otherwise; ``test_train_multinode.py`` runs it.

    python -m torch.distributed.run --nproc_per_node 2 tests/train/fsdp_worker.py \\
        MODEL WEIGHTS_IN|- OUT PROMPT_INDEX RESUME_DIR|-

Weights come from ``WEIGHTS_IN`` (``weights.pt`` of an earlier step) or the model folder; Adam's
state from ``RESUME_DIR/optimizer.pt`` through ``legorl.train.distributed`` (scattered over the
shards) or ``load_state_dict`` on one process. ``OUT`` gets the full weights and the optimizer
state in the one layout both write. (Accelerate runs FSDP only on GPUs, so on CPU the sharding
is torch's ``fully_shard`` itself, the FSDP2 accelerate applies there.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main(model: str, weights_in: str, out: str, prompt: int, resume: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from legorl.train.distributed import (
        gather_optimizer_state,
        parameter_names,
        scatter_optimizer_state,
    )
    from legorl.train.model import load_policy

    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if sharded:
        dist.init_process_group("gloo")
    main_rank = not sharded or dist.get_rank() == 0
    torch.manual_seed(0)
    lm = load_policy(model, attention="sdpa")
    if weights_in != "-":
        lm.load_state_dict(torch.load(weights_in, weights_only=True))
    if sharded:
        for layer in lm.model.layers:
            fully_shard(layer)
        fully_shard(lm)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.0)
    names = parameter_names(lm, opt)
    if resume != "-":
        path = Path(resume) / "optimizer.pt"
        if sharded:
            scatter_optimizer_state(lm, opt, path, names, main_rank)
        else:
            opt.load_state_dict(torch.load(path, weights_only=True))
    ids = torch.tensor([[(7 * prompt + 3 * i) % 2000 + 10 for i in range(24)]])
    lm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(lm, options=full) if sharded else lm.state_dict()
    state = gather_optimizer_state(lm, opt, names, main_rank) if sharded else opt.state_dict()
    if main_rank:
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in weights.items()}, Path(out) / "weights.pt")
        torch.save(state, Path(out) / "optimizer.pt")
    if sharded:
        # rank 1 must not tear its group down while rank 0 still writes: a peer that leaves
        # first aborts gloo's pending work on the other side ("terminate called without an
        # active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
