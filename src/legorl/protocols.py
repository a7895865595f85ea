"""The swappable backends, as Protocols: Engine (token-in/token-out generation), and later
Sandbox, Harness and Verifier. Backends are chosen by short name from a registry dict beside
their implementations (`legorl.engines.ENGINES`, …)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(slots=True, kw_only=True)
class GenerationRequest:
    """What the proxy asks of an engine: token ids in, sampled token ids and log-probs out."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)  # sampled, returned, then stop
    seed: int | None = None
    # A stable key (session and segment) under which an engine may keep this sequence's prefix
    # cached: the next request with the same key usually extends prompt + completion.
    cache_key: str | None = None


@dataclass(slots=True)
class TokenStep:
    """One sampled token and its log-prob under the raw logits at the sampling temperature
    (log_softmax(logits / T)), taken before top-p or any other processor."""

    token_id: int
    logprob: float


class EngineError(RuntimeError):
    """The engine could not serve a request (overloaded, crashed, context too long)."""


class ContextLengthError(EngineError):
    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            f"prompt of {prompt_tokens} tokens does not fit the model's context of {max_context}"
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


@runtime_checkable
class Engine(Protocol):
    """Token-in/token-out generation with exact log-probs.

    ``generate`` yields tokens as they are sampled (in chunks of one or more); it stops after a
    token in ``stop_token_ids`` (which it yields) or after ``max_tokens``. A caller may stop
    iterating early (``aclose``), e.g. on a stop string. Prompts longer than ``max_context``
    raise ``ContextLengthError`` before anything is yielded.
    """

    name: str
    policy_version: int  # bumped by every load_weights
    max_context: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]: ...

    async def load_weights(self, path: str) -> int:
        """Swap in a checkpoint without dropping sessions; returns the new policy version."""
        ...

    async def close(self) -> None: ...
