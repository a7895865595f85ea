"""The swappable backends, as Protocols: the whole contract each kind of backend meets, so that no
caller reaches a backend through ``getattr``. Engine (token-in/token-out generation), Sandbox and
SandboxBackend (a locked-down copy of a task's repository), Harness (an agent run unmodified in
a sandbox). Backends are chosen by short name from a ``legorl.registry.Registry`` beside their
implementations (``legorl.engines.ENGINES``, ``legorl.sandbox.SANDBOXES``,
``legorl.harnesses.HARNESSES``); engines and sandbox backends are built from a typed
``config_class``, harnesses are their own dataclass.

A bad option, flag or config value anywhere is a ``ConfigError`` whose message names the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from legorl.routing import RoutingCapture


class ConfigError(ValueError):
    """A bad option, flag, config key or value; the message names the field (and the file)."""


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
    # False: the caller uses the completion only once it is whole (a non-streamed chat call),
    # so an engine may deliver it in one piece instead of token by token (vllm: one JSON answer
    # instead of server-sent events). The tokens and log-probs are the same either way.
    stream: bool = True
    # Filled with the MoE routing of every token the engine computes for this call, by an
    # engine that records it (embedded); left empty by the others (``legorl.routing``).
    routing: RoutingCapture | None = None


@dataclass(slots=True)
class TokenStep:
    """One sampled token and its log-prob under the raw logits at the sampling temperature
    (log_softmax(logits / T)), taken before top-p or any other processor."""

    token_id: int
    logprob: float


class EngineError(RuntimeError):
    """The engine could not serve a request (overloaded, crashed, context too long)."""


class EngineRequestError(EngineError):
    """The engine refused a request for what it asks (an empty prompt, a setting it cannot
    score faithfully, its server's 4xx): the caller's doing, not an engine failure. The proxy
    never counts it as the environment failing a session."""


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
    config_class: ClassVar[type]  # the dataclass ``ENGINES.build`` makes from keyword options
    policy_version: int  # bumped by every load_weights
    max_context: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]: ...

    async def load_weights(self, path: str) -> int:
        """Swap in a checkpoint without dropping sessions; returns the new policy version."""
        ...

    async def close(self) -> None: ...


# ---- sandboxes ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Limits:
    """Resource limits of one sandbox; exceeding one ends the command with a classified status."""

    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 256
    wall_s: float = 1800.0  # the whole sandbox's life
    output_bytes: int = 1_000_000  # per command; more is cut and flagged


@dataclass(slots=True, kw_only=True)
class ExecResult:
    exit_code: int | None  # None when killed (timeout, limit)
    output: str  # stdout and stderr interleaved, cut at Limits.output_bytes
    timed_out: bool = False
    truncated: bool = False
    killed_by: str | None = None  # "timeout" | "memory" | "pids" | "wall" | None
    duration_s: float = 0.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, daemon down, image missing): an environment
    failure, never the agent's."""


@runtime_checkable
class Sandbox(Protocol):
    """A running, locked-down copy of a task's repository at ``base_commit``.

    The repository is at ``workdir``; its git history is one commit; the network reaches only
    ``proxy_url`` (when one was given at start). ``test_patch`` is never inside.
    """

    id: str
    workdir: str  # the repository's path inside the sandbox
    proxy_url: str | None  # how code inside reaches the legorl proxy it was given
    # What a harness adds to its command's environment (PATH with the env's venv and, when the
    # harness-runtime layer is attached, the runtime's bin folder).
    runtime_env: dict[str, str]
    openhands_python: str | None  # the OpenHands SDK's Python, when the runtime is attached

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def diff(self) -> str:
        """``git diff`` of the working tree (untracked files included) against base_commit."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    name: str  # "docker" | "local"
    config_class: ClassVar[type]  # the dataclass ``SANDBOXES.build`` makes from keyword options

    async def start(
        self,
        task: Any,  # legorl.records.Task
        tasks_dir: str,  # folder the task file is in (task.source is relative to it)
        *,
        run_id: str,
        proxy_url: str | None = None,  # host-side URL of the proxy endpoint to let through
        limits: Limits | None = None,
        harness_runtime: bool = False,  # attach the shared harness-runtime layer
    ) -> Sandbox: ...


# ---- harnesses ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class HarnessRun:
    """How a harness ended inside its sandbox, before the rollout stage adds the patch."""

    status: str  # a records.Status: ok | agent_error | timeout | harness_crash | proxy_error
    exit_code: int | None
    log_tail: str  # the last lines of the harness's own output, as evidence
    duration_s: float = 0.0


ApiShape = Literal["openai_chat", "anthropic", "responses", "gemini"]


@dataclass(frozen=True, slots=True)
class Requirement:
    """What a harness needs installed where it runs, for ``legorl check``: an executable on PATH
    (``binary``, asked for ``--version``), or a Python that can import ``module`` (``python``:
    how to find that Python: "openhands" is the OpenHands SDK venv). ``install`` is the line that
    fixes it."""

    install: str
    binary: str | None = None
    module: str | None = None
    python: str | None = None


@runtime_checkable
class Harness(Protocol):
    """An agent harness run unmodified in a sandbox against one proxy session.

    ``run`` installs or finds the harness (the sandbox's harness-runtime layer, or the host's
    binaries for the local backend), configures it only through its own settings and
    environment, launches it non-interactively on the task's problem statement and classifies
    how it ended. Adding a harness is one small class like this and a registry entry in
    ``legorl.harnesses.HARNESSES``; everything else legorl knows about a harness (the API it
    speaks, whether it streams, what it needs installed) is declared on the class.
    """

    name: ClassVar[str]
    api: ClassVar[ApiShape]  # the wire format it speaks to the proxy
    streams: ClassVar[bool]  # whether its calls stream
    requires: ClassVar[Requirement]
    needs_runtime: ClassVar[bool]  # its binaries come from the sandbox's harness-runtime layer

    async def run(
        self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float
    ) -> HarnessRun: ...
