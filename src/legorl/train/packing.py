"""Packing: variable-length samples into micro-batches by a token budget, attention never
crossing a sample boundary.

    plan = pack_lengths(lengths, episodes, budget=8192)       # [[sample index, …], …]
    mb = build_micro_batch([ids_a, ids_b], [mask_a, mask_b], token_offsets=[0, 17])

A micro-batch is one row: samples laid end to end, ``position_ids`` restarting at 0 for each.
Three attention paths keep samples apart:

- ``varlen_sdpa`` (legorl's, the default): splits the row at the sample boundaries and runs
  causal SDPA per sample. O(tokens) memory, works on CPU and GPU.
- ``flash_attention_2`` (GPU): the same boundaries as ``cu_seq_lens_*``, flash-attn's varlen.
- ``sdpa`` / ``eager``: transformers detects the restarting positions and builds a block-diagonal
  mask (O(tokens²) memory; kept for comparison and as a cross-check).

Packing is first-fit decreasing over episodes: all segments of an episode share a micro-batch
when they fit in the budget, so its sequence-level statistics (GSPO ratio, geometric mask) stay
local; a longer episode is packed segment by segment, and a segment longer than the budget gets
a micro-batch of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The name legorl's varlen SDPA attention is registered under in transformers.
VARLEN_SDPA = "legorl_varlen_sdpa"


# --------------------------------------------------------------------------------------------
# Planning: which samples go together
# --------------------------------------------------------------------------------------------


def pack_lengths(
    lengths: Sequence[int], episodes: Sequence[Sequence[int]], budget: int
) -> list[list[int]]:
    """Micro-batches of sample indices, each holding at most ``budget`` tokens where possible.

    ``episodes`` lists the sample indices of each episode (in segment order). An episode that fits
    the budget is one unit; a longer one is split into its samples. Units go first-fit, longest
    first, into the first micro-batch with room; the result is deterministic.
    """
    units: list[list[int]] = []
    for members in episodes:
        if sum(lengths[i] for i in members) <= budget:
            units.append(list(members))
        else:
            units.extend([i] for i in members)
    size = [sum(lengths[i] for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-size[u], u))
    bins: list[list[int]] = []
    room: list[int] = []
    for u in order:
        for b in range(len(bins)):
            if size[u] <= room[b]:
                bins[b].extend(units[u])
                room[b] -= size[u]
                break
        else:
            bins.append(list(units[u]))
            room.append(budget - size[u])
    return bins


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Tensors for one micro-batch
# --------------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """One packed row and the loss tokens it scores."""

    input_ids: torch.Tensor  # [1, T] samples end to end, then padding
    position_ids: torch.Tensor  # [1, T] restarting at 0 for each sample (and for the padding)
    bounds: list[int]  # [S + 1] start of each sequence (samples, then the padding block), then T
    logit_index: torch.Tensor  # [N] position whose next token is a loss token
    targets: torch.Tensor  # [N] that loss token
    token_index: torch.Tensor  # [N] index of each loss token in the caller's flat token arrays
    samples: list[int]  # indices of the samples it holds, in row order
    real_tokens: int  # tokens of samples (T minus padding)
    pad_tokens: int
    routing: torch.Tensor | None = None  # [L, T, k] recorded MoE experts, -1 where none (replay)

    @property
    def n_loss(self) -> int:
        return int(self.targets.numel())

    def attention_kwargs(self, attention: str) -> dict[str, Any]:
        """Extra forward arguments that tell the attention where samples start."""
        import torch

        if attention == "varlen_sdpa":
            return {"legorl_bounds": self.bounds}
        if attention == "flash_attention_2":
            cu = torch.tensor(self.bounds, dtype=torch.int32, device=self.input_ids.device)
            longest = max(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))
            return {
                "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu,
                "max_length_q": longest,
                "max_length_k": longest,
            }
        return {}  # sdpa / eager: transformers reads the restarting position_ids

    def to(self, device: Any) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            bounds=self.bounds,
            logit_index=self.logit_index.to(device),
            targets=self.targets.to(device),
            token_index=self.token_index.to(device),
            samples=self.samples,
            real_tokens=self.real_tokens,
            pad_tokens=self.pad_tokens,
            routing=self.routing.to(device) if self.routing is not None else None,
        )


def build_micro_batch(
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    token_offsets: Sequence[int],
    *,
    samples: Sequence[int] | None = None,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
) -> MicroBatch:
    """Lay ``input_ids`` end to end. ``token_offsets[k]`` is where sample k's loss tokens start in
    the caller's flat arrays (its loss tokens are numbered in order from there)."""
    import torch

    ids: list[int] = []
    pos: list[int] = []
    bounds = [0]
    logit_index: list[int] = []
    targets: list[int] = []
    token_index: list[int] = []
    for seq, mask, offset in zip(input_ids, loss_masks, token_offsets, strict=True):
        start = len(ids)
        k = 0
        for t, m in enumerate(mask):
            if m:
                # position t - 1 predicts token t; a loss token at t = 0 has no context and is
                # rejected before packing
                logit_index.append(start + t - 1)
                targets.append(seq[t])
                token_index.append(offset + k)
                k += 1
        ids.extend(seq)
        pos.extend(range(len(seq)))
        bounds.append(len(ids))
    real = len(ids)
    total = padded_length(real, pad_to_multiple_of)
    if total > real:
        ids.extend([pad_id] * (total - real))
        pos.extend(range(total - real))
        bounds.append(total)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        bounds=bounds,
        logit_index=torch.tensor(logit_index, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        token_index=torch.tensor(token_index, dtype=torch.long),
        samples=list(samples) if samples is not None else list(range(len(input_ids))),
        real_tokens=real,
        pad_tokens=total - real,
    )


def padding_waste(batches: Sequence[MicroBatch]) -> float:
    """Padding tokens over all tokens fed to the model."""
    pad = sum(b.pad_tokens for b in batches)
    total = pad + sum(b.real_tokens for b in batches)
    return pad / total if total else 0.0


# --------------------------------------------------------------------------------------------
# Attention that never crosses a sample boundary
# --------------------------------------------------------------------------------------------


def varlen_sdpa_attention(
    module: Any,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KV, T, D]
    value: torch.Tensor,  # [1, KV, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA run separately on each ``[bounds[k], bounds[k+1])`` slice of the row."""
    import torch
    import torch.nn.functional as F

    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError("varlen_sdpa supports neither sliding-window nor soft-capped attention")
    if query.shape[0] != 1:
        raise ValueError("varlen_sdpa expects one packed row (batch size 1)")
    bounds: list[int] | None = kwargs.get("legorl_bounds")
    T = query.shape[2]
    if bounds is None:
        bounds = [0, T]  # one sequence: e.g. generate() without packing
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    parts = []
    for a, b in itertools.pairwise(bounds):
        parts.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                is_causal=b - a > 1,
                dropout_p=dropout,
                scale=scaling,
            )
        )
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [1, H, T, D]
    return out.transpose(1, 2).contiguous(), None  # [1, T, H, D]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_varlen_attention() -> str:
    """Register ``varlen_sdpa`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _no_mask)
    return VARLEN_SDPA


def attn_implementation(attention: str) -> str:
    """The transformers ``attn_implementation`` name for a config ``attention`` value."""
    return register_varlen_attention() if attention == "varlen_sdpa" else attention
