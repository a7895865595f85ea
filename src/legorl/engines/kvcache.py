"""Preallocated, doubling K/V buffers for the embedded engine's decode steps.

    cache = grown_cache(model.config, kv, capacity=length + 64)
    model(input_ids=ids, cache=cache, use_cache=True)  # writes the new K/V in place
    kv = kv_views(cache)  # per layer: keys, values [B, H_kv, L, D], views of the buffers

transformers' ``DynamicLayer`` ``torch.cat``s every layer's whole K/V on every forward, so one
decode step copies the full cache once per layer. A ``GrowingLayer`` keeps each layer's K/V in a
buffer with room to spare and writes a step's keys and values into the next free columns; when
the room runs out the buffer doubles (one copy, amortised over as many steps as it held).
``keys``/``values`` are views of the filled part, so the attention sees the same numbers as
with a ``DynamicLayer``. The engine picks it with ``kv_cache="grown"`` (the default);
``kv_cache="dynamic"`` keeps transformers' own layer, for comparison (``python -m legorl.bench
--only decode``).

A buffer is written in place: whoever keeps a view past the filled length must copy it first
(the engine clones what it keeps for a session's prefix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    import torch

    KV = list[tuple[torch.Tensor, torch.Tensor]]


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over a buffer ``[B, H_kv, capacity, D]`` that doubles when
    full; ``keys``/``values`` are views of its first ``length`` columns."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self.grows = 0  # reallocations after the first, for tests and stats
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        import torch

        b, h, _, d = key_states.shape
        shape = (b, h, self.capacity, d)
        self.device = key_states.device
        self._k = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        self._v = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self._k[:, :, :end]
        self.values = self._v[:, :, :end]
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take ``keys``/``values`` [B, H_kv, capacity, D] as the buffers, ``length`` filled."""
        self._k, self._v = keys, values
        self.capacity, self.length = keys.shape[-2], length
        self.device = keys.device
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        import torch

        assert self._k is not None and self._v is not None
        capacity = max(need, 2 * self.capacity)
        b, h, _, d = self._k.shape
        k = torch.empty((b, h, capacity, d), dtype=self._k.dtype, device=self._k.device)
        v = torch.empty_like(k, dtype=self._v.dtype)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v, self.capacity = k, v, capacity
        self.grows += 1

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingLayer is not cropped; build a new one")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer is not re-batched; build a new one")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("GrowingLayer is not re-batched; build a new one")


def grown_cache(config: Any, kv: KV | None, capacity: int) -> Any:
    """A ``DynamicCache`` whose layers are ``GrowingLayer``s with room for ``capacity`` tokens,
    holding a copy of ``kv`` (per layer ``[B, H_kv, L, D]``) when given."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    layers: list[Any] = []
    for i in range(len(cache.layers)):
        layer = GrowingLayer(capacity)
        if kv:
            k, v = kv[i]
            layer.capacity = max(layer.capacity, k.shape[-2])
            layer.update(k, v)
        layers.append(layer)
    cache.layers = layers
    return cache


def placed_cache(
    config: Any, rows: int, width: int, capacity: int, parts: list[tuple[int, int, KV]]
) -> Any:
    """A cache of ``rows`` sequences ``width`` columns long, with room for ``capacity``, built
    in one copy: each part ``(row, column, kv)`` lands at those offsets, the rest is zeros
    (left padding, masked out, but it must not hold NaNs that a zero weight would spread)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    capacity = max(capacity, width)
    layers: list[Any] = []
    for i in range(len(cache.layers)):
        k0, v0 = parts[0][2][i]
        shape = (rows, k0.shape[1], capacity, k0.shape[3])
        buffers = []
        for like, which in ((k0, 0), (v0, 1)):
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            buf[:, :, :width].zero_()
            for row, column, kv in parts:
                part = kv[i][which]
                buf[row : row + part.shape[0], :, column : column + part.shape[2]] = part
            buffers.append(buf)
        layer = GrowingLayer(capacity)
        layer.adopt(buffers[0], buffers[1], width)
        layers.append(layer)
    cache.layers = layers
    return cache


def kv_views(cache: Any) -> KV:
    """Per layer (keys, values) of ``cache``: the tensors attention read, no copy."""
    return [(layer.keys, layer.values) for layer in cache.layers]
