"""MoE routing replay in the trainer (R3, ``router_replay=r3``), and the routing-mismatch
figures with or without it.

    replay = setup_routing(lm, batch, config, model_dir)    # None: no routing anywhere
    replay.attach(mb, batch)                                # mb.routing: [L, T, k]
    scorer.replay = replay; scorer(…, routing=mb.routing, routing_rows=…)   # replayed

The rollout engine recorded, for every token, the top-k experts each MoE layer chose
(``legorl.routing``; align placed them in ``Sample.routing``). With replay on, a forward hook on
each router swaps the trainer's own top-k for the recorded set at every recorded position and
recomputes the gate weights from the trainer's own router logits over that set, exactly as the
model weighs its own choice (softmax over all experts, taken at the chosen ones, renormalised
over them when ``norm_topk_prob``): the experts that run are the rollout's, the router still
gets its gradient through the weights. Positions without a recording keep the model's own
routing. With replay off the hooks only measure.

Figures per step (loss forwards only, padding and unrecorded positions left out):
``routing_mismatch``, the share of recorded positions where the experts the forward ran differ
from the rollout's in at least one layer (0 under replay), and ``router_disagreement``, where
the trainer's own router would have chosen differently (what replay overrides).

Samples whose routing does not cover every position their loss tokens depend on (an old run,
an engine that does not record it): ``router_replay_missing=refuse`` (the default) stops with
the sample named; ``mask`` gives the affected loss tokens weight 0 and counts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from legorl.routing import ChunkReader, RoutingError, layout_of, router_modules

if TYPE_CHECKING:
    import numpy as np

    from legorl.train.config import TrainConfig
    from legorl.train.data import Batch
    from legorl.train.packing import MicroBatch


class RoutingSetupError(ValueError):
    """Replay cannot run on this model or these samples; the message says which and why."""


class RouterReplay:
    """Forward hooks on a model's routers: replay (or only compare with) recorded routing."""

    def __init__(self, lm: Any, *, replay: bool) -> None:
        self.replay = replay
        self.routers = router_modules(lm)
        self.rows: dict[int, np.ndarray] = {}  # sample index -> [T, L, k]
        self.has: dict[int, np.ndarray] = {}  # sample index -> [T] recorded
        self.masked_tokens = 0  # loss tokens given weight 0 for want of routing
        self._current: torch.Tensor | None = None  # [L, T, k] long, -1 where not recorded
        self._differ: torch.Tensor | None = None  # [T] bool: ran other experts than recorded
        self._own: torch.Tensor | None = None  # [T] bool: own router disagrees with recorded
        self._counts = [0, 0, 0]  # recorded positions, differing, own-disagreeing
        self._counting = False
        self._rows: list[tuple[int, int]] = []
        # sample index -> positions where the trainer's own router disagreed (first forward)
        self.differs: dict[int, list[int]] = {}
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def use(self, routing: torch.Tensor | None, rows: list[tuple[int, int]] | None = None) -> None:
        """The routing of the next forward's row ([L, T, k]; None: the model's own) and the
        (sample index, start) of the samples laid in it."""
        self._fold()
        self._current, self._rows = routing, rows or []
        self._counting = torch.is_grad_enabled()  # figures from the loss forwards only
        if routing is not None:
            t = routing.shape[1]
            self._differ = torch.zeros(t, dtype=torch.bool, device=routing.device)
            self._own = torch.zeros(t, dtype=torch.bool, device=routing.device)

    def take(self) -> tuple[int, int, int]:
        """(recorded positions, differing, own router disagreeing) since the last take."""
        self._fold()
        counts, self._counts = tuple(self._counts), [0, 0, 0]
        return counts  # type: ignore[return-value]

    def _fold(self) -> None:
        if self._differ is not None and self._own is not None and self._current is not None:
            has = self._current[0, :, 0] >= 0
            if self._counting:
                self._counts[0] += int(has.sum())
                self._counts[1] += int((self._differ & has).sum())
                self._counts[2] += int((self._own & has).sum())
            own = (self._own & has).cpu()
            for i, start in self._rows:
                if i not in self.differs:  # the first forward of a sample is under θ_old
                    n = self.rows[i].shape[0]
                    self.differs[i] = own[start : start + n].nonzero()[:, 0].tolist()
        self._differ = self._own = None

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            current = self._current
            if current is None:
                return None
            logits, _, own = output  # [T, E], [T, k], [T, k]
            recorded = current[layer]  # [T, k]
            if recorded.shape != own.shape:
                raise RoutingError(
                    f"replay: routing of {tuple(recorded.shape)} for a router choosing "
                    f"{tuple(own.shape)} (tokens, k)"
                )
            has = recorded[:, 0] >= 0  # [T]
            chosen = torch.where(has[:, None], recorded, own) if self.replay else own
            if self._differ is not None and self._own is not None:
                with torch.no_grad():
                    rec = recorded.sort(-1).values
                    self._own |= (own.sort(-1).values != rec).any(-1)
                    self._differ |= (chosen.sort(-1).values != rec).any(-1)
            if not self.replay:
                return None
            # the model's own gate arithmetic, over the recorded experts
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
            weights = probs.gather(1, chosen)  # [T, k]
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook

    def attach(self, mb: MicroBatch, batch: Batch) -> None:
        """Give ``mb`` its row's recorded routing (``mb.routing`` [L, T, k], -1 elsewhere)."""
        import numpy as np

        if not mb.samples:
            return
        t = int(mb.input_ids.shape[1])
        first = self.rows[mb.samples[0]]
        out = np.full((t, first.shape[1], first.shape[2]), -1, dtype=np.int64)
        for i, start in zip(mb.samples, mb.bounds, strict=False):
            rows, has = self.rows[i], self.has[i]
            n = rows.shape[0]
            out[start : start + n][has] = rows[has]
        mb.routing = torch.from_numpy(out).permute(1, 0, 2).contiguous()


def check_router_replay(lm: Any, model_dir: str | Path, config: TrainConfig) -> None:
    """Raise ``RoutingSetupError`` when ``router_replay=r3`` is asked of a dense model."""
    if config.router_replay == "r3" and layout_of(lm) is None:
        raise RoutingSetupError(
            f"router_replay=r3: the model at {model_dir} is dense (no MoE router found); "
            "replay is for mixture-of-experts models: set router_replay=off"
        )


def setup_routing(
    lm: Any, batch: Batch, config: TrainConfig, model_dir: str | Path
) -> RouterReplay | None:
    """Hooks for ``config.router_replay`` and the samples' routing read and checked; None when
    neither replay is asked for nor any sample carries routing. Masks loss tokens (``mask``) or
    raises ``RoutingSetupError`` (dense model, a sidecar that does not fit, missing routing)."""
    want = config.router_replay == "r3"
    routed = [i for i, s in enumerate(batch.samples) if s.routing]
    if not want and not routed:
        return None
    try:
        layout = layout_of(lm)
    except RoutingError as exc:
        raise RoutingSetupError(f"router_replay: {model_dir}: {exc}") from None
    if layout is None:
        check_router_replay(lm, model_dir, config)
        return None
    replay = RouterReplay(lm, replay=want)
    reader = ChunkReader(layout)
    for i, sample in enumerate(batch.samples):
        try:
            replay.rows[i], replay.has[i] = reader.sample_rows(sample)
        except RoutingError as exc:
            raise RoutingSetupError(f"sample {sample.sample_id!r}: {exc}") from None
        if not want:
            continue
        mask = sample.loss_mask
        last = max(t for t, m in enumerate(mask) if m) if any(mask) else 0
        has = replay.has[i]
        missing = [p for p in range(last) if not has[p]]  # positions its loss tokens depend on
        if not missing:
            continue
        if config.router_replay_missing == "refuse":
            raise RoutingSetupError(
                f"router_replay=r3: sample {sample.sample_id!r} has no recorded routing for "
                f"{len(missing)} of the {last} positions its loss tokens depend on (from "
                f"position {missing[0]}; recorded by an engine without capture, or an old "
                "run); router_replay_missing=mask trains without those tokens"
            )
        # loss token t depends on positions < t: those after the first gap lose their weight
        first = batch.token_offset[i]
        k = 0
        for t, m in enumerate(mask):
            if m:
                if t > missing[0]:
                    batch.token_weight[first + k] = 0.0
                    replay.masked_tokens += 1
                k += 1
    return replay
