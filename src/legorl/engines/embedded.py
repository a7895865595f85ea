"""The ``embedded`` engine: a transformers causal LM served in-process, CPU or CUDA, fp32 or bf16.

    from legorl.engines import make_engine
    engine = make_engine("embedded", model_path="fixtures/models/tiny-qwen3")
    async for chunk in engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=64)):
        ...  # list[TokenStep], as sampled

How it serves many sessions at once (continuous batching):

* One worker thread owns the model; ``generate`` only queues a request and awaits the tokens the
  worker hands back through the caller's event loop, one step at a time (real streaming). The
  event loop never runs a forward pass.
* Each worker iteration runs one prefill chunk (``prefill_chunk`` prompt tokens of one new
  sequence, unbatched, its own KV cache) and then one decode step for *all* running sequences
  together: a single forward of ``[B, 1]`` tokens over a left-padded batch KV cache, with a 2-D
  attention mask hiding the padding and explicit per-row position ids. A request that arrives
  while a step runs joins at the next iteration; none waits for another to finish. Up to
  ``max_batch_size`` sequences decode together; more wait in line.
* Membership changes re-pad the batch cache (a copy, only when a sequence joins or leaves).
  Padding costs attention work on the padded length: rows are not grouped by length.
* K/V live in preallocated buffers (``kv_cache="grown"``, ``engines/kvcache.py``): a step
  writes its keys and values in place and a full buffer doubles, instead of transformers'
  ``DynamicCache`` copying every layer's whole cache each step (``kv_cache="dynamic"``, kept
  for comparison). Both give the same numbers.

Prefix reuse: when a sequence with a ``cache_key`` ends, its KV cache (prompt + completion, minus
the last sampled token, which was never fed back) is kept in a bounded LRU. The next request
with that key reuses the longest common prefix of its prompt with the cached tokens and only
prefills the rest. The reused K/V are the very tensors the model computed, so log-probs agree
with and without reuse up to float rounding.

Log-probs are ``log_softmax(raw_logits / T)[token]`` before top-p; temperature 0 samples
greedily and reports log-probs at T = 1. A ``seed`` gives a per-request generator, so the same
seed and prompt give the same tokens (batched and unbatched forwards can differ in the last
float bits, which in principle can flip a draw that lands exactly on a boundary).

``load_weights`` swaps a checkpoint in place between steps: new requests wait, running ones
finish under the old weights, then the weights change, ``policy_version`` goes up and the prefix
caches are dropped. A PEFT adapter folder (``legorl train lora=true``) is swapped the same way,
into LoRA layers put on the base model once (``engines/adapters.py``): it becomes the policy's
adapter. ``load_adapter(name, path)`` loads more named adapters beside it; every forward runs
each batch row through its own request's adapter (``GenerationRequest.adapter``), so sessions on
different adapters share one base model and one batch. Only full-attention decoders (Llama/Qwen-style dynamic KV caches) are
supported; sliding-window or linear-attention layers are refused at load.

MoE routing: on a mixture-of-experts model (``legorl.routing.router_modules``), a request with
a ``routing`` capture gets the top-k expert ids each MoE layer chose for every position the
engine computes for it, prefill chunks and decode steps alike, from the first position not
served from the prefix cache. A forward hook on each router keeps its indices during the
forwards of such requests only; the others run as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from legorl.engines.adapters import (
    BASE,
    AdapterError,
    AdapterSlots,
    base_gone,
    check_base,
    is_adapter,
    read_adapter,
)
from legorl.engines.models import common_prefix, odd_cache_layers
from legorl.protocols import (
    POLICY_ADAPTER,
    ContextLengthError,
    EngineError,
    EngineRequestError,
    GenerationRequest,
    TokenStep,
)

if TYPE_CHECKING:
    import torch

    KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, H_kv, L, D]


@dataclass(slots=True, kw_only=True)
class EmbeddedConfig:
    model_path: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    max_context: int | None = None  # None: the model config's max_position_embeddings
    max_batch_size: int = 32  # sequences decoded together; more wait in line
    prefill_chunk: int = 512  # prompt tokens per prefill forward; decode steps run in between
    prefix_cache_entries: int = 64  # sessions (cache keys) whose last KV cache is kept
    prefix_cache_tokens: int = 262_144  # and at most this many cached tokens over all of them
    # "grown": K/V buffers with room to spare, written in place, doubled when full
    # (engines/kvcache.py); "dynamic": transformers' DynamicCache, which copies all K/V each step
    kv_cache: Literal["grown", "dynamic"] = "grown"
    # torch intra-op threads of the worker's forwards (set in the worker thread, so the rest of
    # the process keeps its own); None: torch's default, one per core. 1 by measurement: a
    # decode step of a small model is mostly Python, and a second thread that waits for a busy
    # core stalls every step (docs/engines.md)
    threads: int | None = 1

    def __post_init__(self) -> None:
        if self.kv_cache not in ("grown", "dynamic"):
            raise ValueError(f"kv_cache must be 'grown' or 'dynamic', got {self.kv_cache!r}")
        threads = self.threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"threads must be a positive integer or None, got {threads!r}")


@dataclass(slots=True)
class EmbeddedStats:
    """Counters since the engine started (read them; the worker writes them)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model
    reused_tokens: int = 0  # prompt tokens served from a session's cached prefix instead
    generated_tokens: int = 0
    decode_steps: int = 0
    batched_steps: int = 0  # decode steps that advanced more than one sequence
    max_batch: int = 0  # most sequences in one decode step
    weight_loads: int = 0
    threads: int = 0  # torch intra-op threads the worker runs forwards with (once started)


class _End:
    """Queued after a sequence's last token."""


_END = _End()


class _Sequence:
    """One request as the worker sees it."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[TokenStep | _End | BaseException] = asyncio.Queue()
        self.tokens: list[int] = list(request.prompt_ids)  # prompt, then each sampled token
        self.prompt_len = len(self.tokens)
        self.stop_ids = frozenset(request.stop_token_ids)
        self.n_cached = 0  # tokens whose K/V are in a cache: the next one sits at this position
        self.cache: Any = None  # own transformers cache while prefilling; then the batch's
        self.generator: torch.Generator | None = None
        self.cancelled = False  # set by the caller's side when it stops listening
        self.done = False


class _Load:
    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, adapter: str | None) -> None:
        self.path = path
        self.loop = loop
        self.adapter = adapter  # None: the policy (full weights, or an adapter folder)
        self.future: asyncio.Future[int] = loop.create_future()
        self.asked = time.monotonic()


class _Stop:
    pass


@dataclass(slots=True)
class _Prefix:
    tokens: list[int]  # exactly the tokens whose K/V are in `kv`
    kv: KV


def _prefix_key(request: GenerationRequest) -> str | None:
    """The prefix cache's key: the request's ``cache_key`` under its adapter (K/V computed
    through one adapter are wrong for another, or for the base, on the same key)."""
    if request.cache_key is None:
        return None
    return f"{request.adapter or ''}\x00{request.cache_key}"


class EmbeddedEngine:
    """Transformers model in a worker thread; see the module docstring."""

    name = "embedded"
    config_class: ClassVar[type] = EmbeddedConfig

    def __init__(self, config: EmbeddedConfig) -> None:
        from legorl.engines.models import load_model, max_context_of

        self.config = config
        self.policy_version = 0
        self.policy_adapter: str | None = None
        self.adapter_versions: dict[str, int] = {}
        self.last_drain_s: float | None = None  # the last load's wait for the calls in flight
        self._adapters: AdapterSlots | None = None
        self.serves_base = True  # the base model's own weights (no full reload since)
        self.stats = EmbeddedStats()
        self._model: Any = load_model(config.model_path, dtype=config.dtype, device=config.device)
        self._check_cache_layout()
        self.max_context = config.max_context or max_context_of(self._model)
        self._vocab = int(self._model.get_input_embeddings().num_embeddings)
        self._device = next(self._model.parameters()).device
        self._routing_setup()
        self._closed = False
        self._inbox: queue.SimpleQueue[_Sequence | _Load | _Stop] = queue.SimpleQueue()
        # Worker state: touched only by the worker thread.
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: deque[_Sequence] = deque()
        self._batch: list[_Sequence] = []
        self._batch_cache: Any = None  # transformers cache of the batch, left-padded
        self._batch_mask: torch.Tensor | None = None  # [B, P] bool, False on left padding
        self._loads: list[_Load] = []
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()
        self._prefix_tokens = 0
        self._thread = threading.Thread(target=self._run, name="legorl-embedded", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------
    # Caller side (event loop)
    # ---------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        self._check_request(request)
        seq = _Sequence(request, asyncio.get_running_loop())
        self._inbox.put(seq)
        finished = False
        try:
            while not finished:
                items = [await seq.queue.get()]
                while not seq.queue.empty():
                    items.append(seq.queue.get_nowait())
                chunk: list[TokenStep] = []
                error: BaseException | None = None
                for item in items:
                    if isinstance(item, TokenStep):
                        chunk.append(item)
                    elif isinstance(item, _End):
                        finished = True
                    else:
                        error = item
                if chunk:
                    yield chunk
                if error is not None:
                    finished = True
                    raise error
        finally:
            if not finished:
                seq.cancelled = True  # the worker drops it at its next iteration

    async def load_weights(self, path: str) -> int:
        if self._closed:
            raise EngineError("engine is closed")
        command = _Load(str(path), asyncio.get_running_loop(), None)
        self._inbox.put(command)
        return await command.future

    async def load_adapter(self, name: str, path: str) -> int:
        if self._closed:
            raise EngineError("engine is closed")
        command = _Load(str(path), asyncio.get_running_loop(), name)
        self._inbox.put(command)
        return await command.future

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    def _check_request(self, request: GenerationRequest) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        ids = request.prompt_ids
        if not ids:
            raise EngineRequestError("empty prompt: at least one token is needed")
        if len(ids) >= self.max_context:
            raise ContextLengthError(len(ids), self.max_context)
        if request.max_tokens < 1:
            raise EngineRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise EngineRequestError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {request.temperature}, "
                f"{request.top_p}"
            )
        if min(ids) < 0 or max(ids) >= self._vocab:
            raise EngineRequestError(f"prompt token ids must be in 0..{self._vocab - 1}")
        if request.adapter == BASE and not self.serves_base:
            raise EngineRequestError(base_gone(self.policy_version))
        if request.adapter not in (None, BASE) and request.adapter not in self.adapter_versions:
            loaded = ", ".join(sorted(self.adapter_versions)) or "none"
            raise EngineRequestError(
                f"adapter {request.adapter!r} is not loaded on this engine (loaded: {loaded})"
            )

    def _routing_setup(self) -> None:
        from legorl.routing import layout_of, router_modules

        self.routing_layout = layout_of(self._model)
        self._captured: list[torch.Tensor] | None = None  # routers' indices during a capture

        def keep(module: Any, args: Any, output: Any) -> None:
            if self._captured is not None:
                self._captured.append(output[2])  # [B * T, k] expert ids

        for router in router_modules(self._model):
            router.register_forward_hook(keep)

    def _capturing(self, seqs: list[_Sequence]) -> bool:
        wanted = self.routing_layout is not None and any(
            s.request.routing is not None for s in seqs
        )
        self._captured = [] if wanted else None
        return wanted

    def _routed_rows(self, batch: int) -> Any:
        """The captured forward's routing as ``[B, T, layers, k]`` uint8/uint16 (numpy)."""
        import torch

        assert self._captured is not None and self.routing_layout is not None
        routed, self._captured = self._captured, None
        rows = torch.stack(routed)  # [L, B * T, k]
        rows = rows.reshape(len(routed), batch, -1, rows.shape[-1]).permute(1, 2, 0, 3)
        return rows.to("cpu").numpy().astype(self.routing_layout.dtype())

    def _check_cache_layout(self) -> None:
        odd = odd_cache_layers(self._model)
        if odd:
            raise EngineError(
                "the embedded engine batches plain full-attention KV caches only; this model "
                f"has {', '.join(sorted(odd))} layers"
            )

    # ---------------------------------------------------------------------------------------
    # Worker thread
    # ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)  # this thread's forwards only
        self.stats.threads = torch.get_num_threads()
        with torch.inference_mode():
            while True:
                try:
                    if not self._take_commands(block=not self._busy()):
                        break
                    self._iterate()
                except Exception as exc:
                    # a bug, not a model step (those are guarded): fail what runs, keep serving
                    self._fail_running(EngineError(f"embedded engine error: {exc!r}"))
        self._fail_all(EngineError("engine closed"))

    def _iterate(self) -> None:
        """One scheduling round: drop cancelled work, swap weights when idle, or admit new
        sequences, run one prefill chunk and one batched decode step."""
        self._drop_cancelled()
        if self._loads and not self._prefilling and not self._batch:
            self._do_loads()
            return
        self._admit()
        if self._prefilling:
            self._guarded(self._prefill_step, [self._prefilling[0]])
        if self._batch:
            self._guarded(self._decode_step, list(self._batch))

    def _busy(self) -> bool:
        # a pending load, or requests held back by one, are work too: never block on the inbox
        return bool(self._prefilling or self._batch or self._loads or self._waiting)

    def _take_commands(self, *, block: bool) -> bool:
        """Move new commands off the inbox; False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(item, _Stop):
                return False
            if isinstance(item, _Load):
                self._loads.append(item)
            else:
                self.stats.requests += 1
                self.stats.prompt_tokens += item.prompt_len
                self._waiting.append(item)

    def _admit(self) -> None:
        if self._loads:
            return  # new sequences wait until the weights have changed
        room = self.config.max_batch_size - len(self._batch) - len(self._prefilling)
        while room > 0 and self._waiting:
            seq = self._waiting.popleft()
            if seq.cancelled:
                continue
            self._start(seq)
            self._prefilling.append(seq)
            room -= 1

    def _start(self, seq: _Sequence) -> None:
        import torch

        req = seq.request
        if req.temperature > 0:
            seq.generator = torch.Generator(device=self._device)
            seed = req.seed if req.seed is not None else random.SystemRandom().getrandbits(63)
            seq.generator.manual_seed(seed)
        key = _prefix_key(req)
        cached = self._prefixes.pop(key, None) if key is not None else None
        self._begin_routing(seq)
        if cached is None:
            return
        self._prefix_tokens -= len(cached.tokens)
        # at least one prompt token must run through the model to give the next-token logits
        n = min(common_prefix(cached.tokens, seq.tokens), seq.prompt_len - 1)
        if n > 0:
            kept = [(k[:, :, :n], v[:, :, :n]) for k, v in cached.kv]
            seq.cache = self._new_cache(kept, capacity=self._own_room(seq))
            seq.n_cached = n
            self.stats.reused_tokens += n
            self._begin_routing(seq)

    def _begin_routing(self, seq: _Sequence) -> None:
        capture = seq.request.routing
        if capture is not None and self.routing_layout is not None:
            capture.begin(self.routing_layout, seq.n_cached)

    def _prefill_step(self) -> None:
        import torch

        seq = self._prefilling[0]
        lo = seq.n_cached
        hi = min(seq.prompt_len, lo + self.config.prefill_chunk)
        ids = torch.tensor([seq.tokens[lo:hi]], device=self._device)  # [1, c]
        positions = torch.arange(lo, hi, device=self._device)[None]  # [1, c]
        if seq.cache is None:
            seq.cache = self._new_cache(None, capacity=self._own_room(seq))
        capture = self._capturing([seq])
        with self._routed([seq]):  # the rows' LoRA adapters
            out = self._model(
                input_ids=ids,
                position_ids=positions,
                cache=seq.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if capture:
            assert seq.request.routing is not None
            seq.request.routing.add(self._routed_rows(1)[0])  # [c, L, k]
        seq.n_cached = hi
        self.stats.prefill_tokens += hi - lo
        if hi < seq.prompt_len:
            return
        self._prefilling.popleft()
        self._emit([seq], out.logits[:, -1])
        if seq.done:
            self._finish(seq, _kv_of(seq.cache))
        else:
            self._join(seq)

    def _decode_step(self) -> None:
        import torch

        batch = self._batch
        mask = self._batch_mask
        assert mask is not None
        n = len(batch)
        ids = torch.tensor([[s.tokens[-1]] for s in batch], device=self._device)  # [B, 1]
        positions = torch.tensor([[s.n_cached] for s in batch], device=self._device)  # [B, 1]
        mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)  # [B, P + 1]
        capture = self._capturing(batch)
        with self._routed(batch):  # the rows' LoRA adapters
            out = self._model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=self._batch_cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if capture:
            rows = self._routed_rows(n)  # [B, 1, L, k]
            for s, row in zip(batch, rows, strict=True):
                if s.request.routing is not None:
                    s.request.routing.add(row)
        self._batch_mask = mask
        for s in batch:
            s.n_cached += 1
        self.stats.decode_steps += 1
        self.stats.batched_steps += n > 1
        self.stats.max_batch = max(self.stats.max_batch, n)
        self._emit(batch, out.logits[:, -1])
        finished = [i for i, s in enumerate(batch) if s.done]
        if finished:
            self._leave(finished)

    def _emit(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence from ``logits`` [B, V] and hand it to its caller."""
        tokens, logprobs = _sample(seqs, logits)
        # one wake-up per event loop and step, not per token: waking a loop costs a syscall
        mail: dict[asyncio.AbstractEventLoop, list[tuple[_Sequence, Any]]] = {}
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.tokens.append(token)
            self.stats.generated_tokens += 1
            generated = len(seq.tokens) - seq.prompt_len
            seq.done = (
                token in seq.stop_ids
                or generated >= seq.request.max_tokens
                or len(seq.tokens) >= self.max_context
            )
            box = mail.setdefault(seq.loop, [])
            box.append((seq, TokenStep(token, logprob)))
            if seq.done:
                box.append((seq, _END))
        for loop, box in mail.items():
            try:
                loop.call_soon_threadsafe(_deliver, box)
            except RuntimeError:  # the callers' loop is closed: nobody is listening any more
                for seq, _ in box:
                    seq.cancelled = True

    def _send(self, seq: _Sequence, item: TokenStep | _End | BaseException) -> None:
        try:
            seq.loop.call_soon_threadsafe(seq.queue.put_nowait, item)
        except RuntimeError:
            seq.cancelled = True

    # -- batch membership ------------------------------------------------------------------

    def _join(self, seq: _Sequence) -> None:
        import torch
        import torch.nn.functional as F

        assert seq.cache is not None
        cache, seq.cache = seq.cache, None
        length = seq.n_cached
        if not self._batch:
            self._batch = [seq]
            self._batch_cache = cache
            self._batch_mask = torch.ones(1, length, dtype=torch.bool, device=self._device)
            return
        mask = self._batch_mask
        assert mask is not None
        padded = mask.shape[1]
        width = max(padded, length)
        old_pad, new_pad = width - padded, width - length
        row = torch.ones(1, width, dtype=torch.bool, device=self._device)
        row[:, :new_pad] = False
        self._batch_mask = torch.cat([F.pad(mask, (old_pad, 0), value=False), row])
        self._batch.append(seq)
        rows, room = len(self._batch), self._batch_room(width)
        if self.config.kv_cache == "grown":
            from legorl.engines.kvcache import placed_cache

            parts = [(0, old_pad, _kv_of(self._batch_cache)), (rows - 1, new_pad, _kv_of(cache))]
            self._batch_cache = placed_cache(self._model.config, rows, width, room, parts)
            return
        padded_kv = [
            (
                torch.cat([F.pad(bk, (0, 0, old_pad, 0)), F.pad(k, (0, 0, new_pad, 0))]),
                torch.cat([F.pad(bv, (0, 0, old_pad, 0)), F.pad(v, (0, 0, new_pad, 0))]),
            )
            for (bk, bv), (k, v) in zip(_kv_of(self._batch_cache), _kv_of(cache), strict=True)
        ]
        self._batch_cache = self._new_cache(padded_kv, capacity=room)

    def _leave(self, rows: list[int]) -> None:
        """Take ``rows`` out of the batch, keeping their caches as session prefixes."""
        import torch

        mask = self._batch_mask
        assert mask is not None
        padded = mask.shape[1]
        for i in rows:
            seq = self._batch[i]
            start = padded - seq.n_cached
            # clone: a view would keep the whole batch tensor alive in the prefix cache
            own = [
                (k[i : i + 1, :, start:].clone(), v[i : i + 1, :, start:].clone())
                for k, v in _kv_of(self._batch_cache)
            ]
            self._finish(seq, own)
        gone = set(rows)
        keep = [i for i in range(len(self._batch)) if i not in gone]
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._batch_cache, self._batch_mask = None, None
            return
        # drop the columns that are padding in every remaining row
        trim = min(padded - s.n_cached for s in self._batch)
        index = torch.tensor(keep, device=self._device)
        self._batch_mask = mask.index_select(0, index)[:, trim:]
        width = padded - trim
        room = self._batch_room(width)
        kv = _kv_of(self._batch_cache)
        if self.config.kv_cache == "grown":
            from legorl.engines.kvcache import placed_cache

            parts = [
                (j, 0, [(k[i : i + 1, :, trim:], v[i : i + 1, :, trim:]) for k, v in kv])
                for j, i in enumerate(keep)
            ]
            self._batch_cache = placed_cache(self._model.config, len(keep), width, room, parts)
            return
        kept = [
            (k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:])
            for k, v in kv
        ]
        self._batch_cache = self._new_cache(kept, capacity=room)

    def _finish(self, seq: _Sequence, kv: KV | None) -> None:
        seq.done = True
        key = _prefix_key(seq.request)
        if key is None or kv is None or seq.n_cached == 0:
            return
        # contiguous: a view into a grown buffer would keep its spare room alive in the LRU
        tight = [(k.contiguous(), v.contiguous()) for k, v in kv]
        self._store_prefix(key, _Prefix(seq.tokens[: seq.n_cached], tight))

    def _store_prefix(self, key: str, prefix: _Prefix) -> None:
        old = self._prefixes.pop(key, None)
        if old is not None:
            self._prefix_tokens -= len(old.tokens)
        if len(prefix.tokens) > self.config.prefix_cache_tokens:
            return
        self._prefixes[key] = prefix
        self._prefix_tokens += len(prefix.tokens)
        while (
            len(self._prefixes) > self.config.prefix_cache_entries
            or self._prefix_tokens > self.config.prefix_cache_tokens
        ):
            _, evicted = self._prefixes.popitem(last=False)
            self._prefix_tokens -= len(evicted.tokens)

    # -- cancellation, errors, weights -------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._prefilling if s.cancelled]:
            self._prefilling.remove(seq)
            self._finish(seq, _kv_of(seq.cache) if seq.cache is not None else None)
        rows = [i for i, s in enumerate(self._batch) if s.cancelled]
        if rows:
            self._leave(rows)

    def _guarded(self, step: Any, involved: list[_Sequence]) -> None:
        """Run a model step; if it raises, fail only the sequences it was working on."""
        try:
            step()
        except Exception as exc:
            error = EngineError(f"embedded engine step failed: {type(exc).__name__}: {exc}")
            self._fail_running(error, involved)

    def _fail_running(self, error: EngineError, involved: list[_Sequence] | None = None) -> None:
        """Fail the ``involved`` sequences (default: all started ones) and forget them."""
        hit = [*self._prefilling, *self._batch] if involved is None else involved
        for seq in hit:
            if not seq.done:
                seq.done = True
                self._send(seq, error)
        gone = {id(s) for s in hit}
        self._prefilling = deque(s for s in self._prefilling if id(s) not in gone)
        if any(id(s) in gone for s in self._batch):
            # the batch cache is shared: whoever survives would need it rebuilt; fail them too
            for seq in self._batch:
                if not seq.done:
                    seq.done = True
                    self._send(seq, error)
            self._batch, self._batch_cache, self._batch_mask = [], None, None

    def _routed(self, seqs: list[_Sequence]) -> Any:
        """The context a forward over ``seqs`` runs in: each row through its adapter."""
        if self._adapters is None or not self._adapters.shapes:
            return contextlib.nullcontext()
        policy = self.policy_adapter or BASE
        return self._adapters.routed([s.request.adapter or policy for s in seqs])

    def _do_loads(self) -> None:
        from legorl.engines.models import reload_weights

        loads, self._loads = self._loads, []
        # the wait for the calls in flight (new ones were held back since the first load came)
        self.last_drain_s = time.monotonic() - min(load.asked for load in loads)
        self._prefixes.clear()  # K/V computed by the old weights are wrong for the new ones
        self._prefix_tokens = 0
        for load in loads:
            result: int | BaseException
            try:
                if load.adapter not in (None, POLICY_ADAPTER):
                    result = self._load_adapter(load.adapter, load.path)
                elif is_adapter(load.path):
                    self._load_adapter(POLICY_ADAPTER, load.path)
                    self.policy_version += 1
                    self.policy_adapter = POLICY_ADAPTER
                    self.adapter_versions[POLICY_ADAPTER] = result = self.policy_version
                else:
                    reload_weights(self._model, load.path)
                    self.serves_base = False
                    if self.policy_adapter is not None and self._adapters is not None:
                        self._adapters.remove(self.policy_adapter)  # full weights: no adapter
                        self.adapter_versions.pop(self.policy_adapter, None)
                    self.policy_adapter = None
                    self.policy_version += 1
                    result = self.policy_version
                self.stats.weight_loads += 1
            except AdapterError as exc:
                result = EngineRequestError(str(exc))
            except Exception as exc:
                result = EngineError(f"load_weights({load.path!r}) failed: {exc}")
            load.loop.call_soon_threadsafe(_resolve, load.future, result)

    def _load_adapter(self, name: str, path: str) -> int:
        """Put the adapter folder ``path`` in slot ``name``; returns that name's new version."""
        info = read_adapter(path)
        check_base(info, self.config.model_path)
        if self._adapters is None:
            self._adapters = AdapterSlots(self._model)
        self._adapters.load(name, info)
        version = self.adapter_versions.get(name, 0) + 1
        self.adapter_versions[name] = version
        return version

    def _fail_all(self, error: EngineError) -> None:
        for seq in [*self._waiting, *self._prefilling, *self._batch]:
            if not seq.done:
                self._send(seq, error)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Sequence):
                self._send(item, error)
            elif isinstance(item, _Load):
                self._loads.append(item)
        for load in self._loads:
            load.loop.call_soon_threadsafe(_resolve, load.future, error)

    def _own_room(self, seq: _Sequence) -> int:
        """Columns for a prefilling sequence's own cache: its prompt and, should it decode
        alone, as many steps again before the first doubling."""
        final = min(seq.prompt_len + seq.request.max_tokens, self.max_context)
        return min(2 * seq.prompt_len, final)

    def _batch_room(self, width: int) -> int:
        """Columns to allocate for a batch cache ``width`` wide: double, but no more than the
        longest row can still need (its prompt plus ``max_tokens``, within the context)."""
        need = max(
            width - s.n_cached + min(s.prompt_len + s.request.max_tokens, self.max_context)
            for s in self._batch
        )
        return max(width + 1, min(2 * width, need))

    def _new_cache(self, kv: KV | None, capacity: int) -> Any:
        """A transformers cache holding ``kv`` (or empty): grown buffers with room for
        ``capacity`` tokens (a copy), or a DynamicCache over the very tensors."""
        if self.config.kv_cache == "grown":
            from legorl.engines.kvcache import grown_cache

            return grown_cache(self._model.config, kv, capacity)
        from transformers import DynamicCache

        cache = DynamicCache(config=self._model.config)
        if kv:
            layers: list[Any] = cache.layers  # plain DynamicLayers, checked at load
            for layer, (k, v) in zip(layers, kv, strict=True):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        return cache


def _deliver(box: list[tuple[_Sequence, Any]]) -> None:
    """Runs on a caller's event loop: queue each item for its sequence."""
    for seq, item in box:
        seq.queue.put_nowait(item)


def _kv_of(cache: Any) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _resolve(future: asyncio.Future[int], result: int | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _sample(seqs: list[_Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V] and its log-prob under ``log_softmax(logits / T)``.

    The log-prob is taken before top-p, which only narrows what may be drawn. Greedy rows
    (T = 0) take the argmax and report log-probs at T = 1.
    """
    import torch

    temps = [s.request.temperature for s in seqs]
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
    # the same arithmetic as models.scaled_logprobs, per row: fp32 first, then divide
    logp = torch.log_softmax(logits.float() / scale[:, None], dim=-1)  # [B, V]
    tokens = logp.argmax(dim=-1)  # [B], kept for greedy rows
    rows = [i for i, t in enumerate(temps) if t > 0]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = logp.index_select(0, index).exp()  # [S, V]
        top_p = [seqs[i].request.top_p for i in rows]
        if min(top_p) < 1:
            probs = _top_p(probs, torch.tensor(top_p, device=probs.device))
        # inverse-CDF draw, one uniform from each sequence's own generator: a seed fixes the
        # tokens whatever else shares the batch
        cdf = probs.cumsum(dim=-1)  # [S, V]
        u = torch.stack(
            [torch.rand((), generator=seqs[i].generator, device=probs.device) for i in rows]
        )
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[index] = drawn.clamp_(max=probs.shape[-1] - 1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [B]
    return tokens.tolist(), chosen.tolist()


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``, per row
    of ``probs`` [S, V] (``top_p`` [S]); the most likely token always stays."""
    import torch

    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p[:, None]] = 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
