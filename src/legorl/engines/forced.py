"""The ``forced`` engine, a test double: it replays scripted completions, scored by a real model.

    engine = make_engine("forced", model_path="fixtures/models/tiny-qwen3", script=[
        {"text": "<tool_call>{...}</tool_call>", "match": "fix the bug"},
        {"text": "Done.", "repeat": True},
    ])

A script is an ordered list of entries, given inline or as a path to a ``.json`` file (a list) or
a ``.jsonl`` file (one entry per line). An entry holds exactly one of

* ``"text"``: tokenised with the model's tokenizer (no special tokens added), or
* ``"ids"``: token ids, used as they are,

and optionally ``"match"`` (the entry serves only requests whose decoded prompt contains this
substring), ``"repeat": true`` (the entry is never used up) and ``"stop": false`` (do not append
the stop token). Each request takes the first unused entry that matches; when none is left the
request fails with ``EngineError``.

The completion is the entry's tokens plus the request's first stop token (``<|im_end|>`` for
ChatML), cut after the first stop token it contains, at ``max_tokens`` and at the model's
context. Every log-prob comes from a real forward pass over prompt + completion at the
request's temperature (``log_softmax(logits / T)``, T = 0 scored at T = 1), so a trainer's
recompute must agree with it. The K/V of the sequences scored last (up to
``prefix_cache_tokens`` tokens, dropped when weights load) are kept, and a request that starts
with one of them runs the pass over the rest only: a harness's next call repeats its last
prompt and completion. Tokens stream out in chunks of ``chunk_tokens``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from legorl.protocols import (
    ContextLengthError,
    EngineError,
    EngineRequestError,
    GenerationRequest,
    TokenStep,
)

_ENTRY_KEYS = frozenset({"text", "ids", "match", "repeat", "stop"})


@dataclass(slots=True, kw_only=True)
class ScriptEntry:
    text: str | None = None
    ids: list[int] | None = None
    match: str | None = None
    repeat: bool = False
    stop: bool = True

    @classmethod
    def from_dict(cls, data: Any, where: str = "script entry") -> ScriptEntry:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - _ENTRY_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
        if ("text" in data) == ("ids" in data):
            raise ValueError(f'{where}: needs exactly one of "text" and "ids"')
        text, ids, match = data.get("text"), data.get("ids"), data.get("match")
        if text is not None and not isinstance(text, str):
            raise ValueError(f'{where}: "text" must be a string')
        if ids is not None and not (
            isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)
        ):
            raise ValueError(f'{where}: "ids" must be a list of non-negative integers')
        if match is not None and not isinstance(match, str):
            raise ValueError(f'{where}: "match" must be a string')
        for flag in ("repeat", "stop"):
            if flag in data and type(data[flag]) is not bool:
                raise ValueError(f'{where}: "{flag}" must be true or false')
        return cls(
            text=text,
            ids=ids,
            match=match,
            repeat=data.get("repeat", False),
            stop=data.get("stop", True),
        )


class ForcedScript:
    """Scripted completions, handed out in order to the requests they match."""

    def __init__(self, entries: Iterable[ScriptEntry | dict[str, Any]]) -> None:
        self.entries = [
            e if isinstance(e, ScriptEntry) else ScriptEntry.from_dict(e, f"script entry {i}")
            for i, e in enumerate(entries)
        ]
        self._used = [False] * len(self.entries)
        self.served = 0

    @classmethod
    def load(cls, path: str | Path) -> ForcedScript:
        """A script from a ``.json`` file (a list of entries) or a ``.jsonl`` file."""
        path = Path(path)
        raw = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            lines = [(n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
            entries = []
            for n, line in lines:
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: malformed JSON: {exc}") from None
                entries.append(ScriptEntry.from_dict(data, f"{path}:{n}"))
            return cls(entries)
        data = json.loads(raw)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json script must be a list of entries")
        return cls(ScriptEntry.from_dict(e, f"{path}: entry {i}") for i, e in enumerate(data))

    @property
    def remaining(self) -> int:
        """Entries not used up (repeatable ones always count)."""
        return sum(1 for e, used in zip(self.entries, self._used, strict=True) if not used)

    def take(self, prompt_text: str) -> ScriptEntry:
        for i, entry in enumerate(self.entries):
            if self._used[i] or (entry.match is not None and entry.match not in prompt_text):
                continue
            if not entry.repeat:
                self._used[i] = True
            self.served += 1
            return entry
        tail = prompt_text[-120:]
        raise EngineError(
            f"forced engine: no scripted completion left for request {self.served + 1} "
            f"({len(self.entries)} entries, {self.remaining} unused; none matches a prompt "
            f"ending in {tail!r})"
        )


@dataclass(slots=True, kw_only=True)
class ForcedConfig:
    model_path: str
    script: list[dict[str, Any]] | str = field(default_factory=list)  # entries, or a file path
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    max_context: int | None = None  # None: the model config's max_position_embeddings
    chunk_tokens: int = 4  # tokens per streamed chunk
    prefix_cache_tokens: int = 262144  # tokens of K/V kept from earlier requests (0: none)


class ForcedEngine:
    """Replays a script, scored by a real forward pass; see the module docstring."""

    name = "forced"
    config_class: ClassVar[type] = ForcedConfig

    def __init__(self, config: ForcedConfig) -> None:
        from legorl.engines.models import (
            load_model,
            load_tokenizer,
            max_context_of,
            odd_cache_layers,
        )

        self.config = config
        self.policy_version = 0
        self.script = (
            ForcedScript.load(config.script)
            if isinstance(config.script, str)
            else ForcedScript(config.script)
        )
        self.tokenizer = load_tokenizer(config.model_path)
        self._model = load_model(config.model_path, dtype=config.dtype, device=config.device)
        self.max_context = config.max_context or max_context_of(self._model)
        self._vocab = int(self._model.get_input_embeddings().num_embeddings)
        # One thread for all model work: scoring stays off the event loop and in request order,
        # and a weight load waits for the scoring before it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="legorl-forced")
        # The K/V of the last sequences scored, newest first (model thread only): a harness's
        # next call repeats its last prompt and completion, and scoring a long prompt again
        # (Claude Code's is 50k tokens) is what a test spent its time on.
        self._prefixes: list[tuple[list[int], Any]] = []
        self._cacheable = config.prefix_cache_tokens > 0 and not odd_cache_layers(self._model)
        self.reused_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.requests: list[GenerationRequest] = []  # every request served, for tests to inspect

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        prompt = request.prompt_ids
        if not prompt:
            raise EngineRequestError("empty prompt: at least one token is needed")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(len(prompt), self.max_context)
        entry = self.script.take(str(self.tokenizer.decode(prompt, skip_special_tokens=False)))
        self.requests.append(request)
        completion = self._completion(entry, request)
        if not completion:
            return
        loop = asyncio.get_running_loop()
        logprobs = await loop.run_in_executor(
            self._executor, self._score, [*prompt, *completion], len(prompt), request.temperature
        )
        step = max(1, self.config.chunk_tokens)
        for lo in range(0, len(completion), step):
            yield [
                TokenStep(t, lp)
                for t, lp in zip(completion[lo : lo + step], logprobs[lo : lo + step], strict=True)
            ]
            await asyncio.sleep(0)  # let other sessions run between chunks, as a real engine

    def _score(self, ids: list[int], start: int, temperature: float) -> list[float]:
        """The log-probs of ``ids[start:]``, the pass run over what no kept prefix holds; the
        sequence's K/V is kept for the next request (model thread)."""
        from legorl.engines.models import common_prefix, token_logprobs

        if not self._cacheable:
            return token_logprobs(self._model, ids, start=start, temperature=temperature)
        n, kv = 0, None
        for tokens, held in self._prefixes:
            common = min(common_prefix(tokens, ids), start - 1)
            if common > n:
                n, kv = common, held
        prefix = [(k[:, :, :n], v[:, :, :n]) for k, v in kv] if kv is not None else None
        keep: list[Any] = []
        logprobs = token_logprobs(
            self._model, ids, start=start, temperature=temperature, prefix=prefix, keep=keep
        )
        self.reused_tokens += n
        self._prefixes.insert(0, (ids, keep[0]))
        while sum(len(t) for t, _ in self._prefixes) > self.config.prefix_cache_tokens:
            self._prefixes.pop()
        return logprobs

    def _completion(self, entry: ScriptEntry, request: GenerationRequest) -> list[int]:
        if entry.ids is not None:
            ids = list(entry.ids)
        else:
            ids = self.tokenizer.encode(entry.text or "", add_special_tokens=False)
        if entry.stop and request.stop_token_ids:
            ids.append(request.stop_token_ids[0])
        bad = [i for i in ids if i >= self._vocab]
        if bad:
            raise EngineError(f"forced engine: scripted ids {bad[:5]} outside the vocabulary")
        stops = set(request.stop_token_ids)
        for i, token in enumerate(ids):
            if token in stops:  # the engine contract: stop after the first stop token
                ids = ids[: i + 1]
                break
        room = self.max_context - len(request.prompt_ids)
        return ids[: min(request.max_tokens, room)]

    async def load_weights(self, path: str) -> int:
        from legorl.engines.models import reload_weights

        def reload() -> None:
            self._prefixes.clear()  # K/V of the old weights
            reload_weights(self._model, path)

        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, reload)
        except Exception as exc:
            raise EngineError(f"load_weights({path!r}) failed: {exc}") from exc
        self.policy_version += 1
        return self.policy_version

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
