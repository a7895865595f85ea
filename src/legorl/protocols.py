"""The swappable backends, as Protocols: the whole contract each kind of backend meets, so that no
caller reaches a backend through ``getattr``. Engine (token-in/token-out generation), Sandbox and
SandboxBackend (a locked-down copy of a task's repository), Harness (an agent run unmodified in
a sandbox), Executor (where a loop's rollout and grading work runs, given as plain data). Backends are chosen by short name from a ``legorl.registry.Registry`` beside their
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
    # The LoRA adapter to sample with, by the name it was loaded under (``ServesAdapters``;
    # ``BASE_ADAPTER``: none, the base model); None: the engine's policy (its policy adapter if
    # it has one, else its weights).
    adapter: str | None = None
    # The version of that adapter to sample with, when the engine still holds it (an episode
    # finishing on the version it started on: ``Fleet.keep_versions``); None, or a version it
    # no longer holds: the current one.
    adapter_version: int | None = None
    # Filled with the MoE routing of every token the engine computes for this call, by an
    # engine that records it (embedded); left empty by the others (``legorl.routing``).
    routing: RoutingCapture | None = None
    # Where the request was served, filled in by an engine with several replicas (engines/
    # replicas.py) as it serves it; the proxy copies it into the Turn. Others leave it empty.
    placement: Placement = field(default_factory=lambda: Placement())


@dataclass(slots=True)
class Placement:
    """Which replica sampled a request's tokens, and what failing over cost it."""

    replica: str | None = None  # the replica that sampled the completion (its URL)
    failed: list[str] = field(default_factory=list)  # replicas that failed during the request
    reprefilled_tokens: int = 0  # prompt tokens prefilled again on the replicas retried on
    resumed_at: int = 0  # completion tokens delivered by a failed replica before it failed
    # the gap in the call's tokens: from the failed replica's last token (or the call's start
    # there) to the first token after failing over
    stalled_s: float = 0.0


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


@runtime_checkable
class ServesAdapters(Protocol):
    """An engine that serves LoRA adapters on its one base model (embedded, vllm).

    ``load_weights`` with a PEFT adapter folder makes it the policy's adapter, named
    ``POLICY_ADAPTER``, whose version is the new ``policy_version``. ``load_adapter`` loads or
    replaces another named adapter beside it (an A/B evaluation, one policy per harness); a
    request names it in ``GenerationRequest.adapter``. An adapter trained on another base is
    refused, naming both.
    """

    policy_adapter: str | None  # the adapter requests without one get; None: the full weights
    adapter_versions: dict[str, int]  # loaded adapter name -> its version

    async def load_adapter(self, name: str, path: str) -> int:
        """Load the adapter folder ``path`` as ``name`` (a new version of it if loaded before);
        returns its version."""
        ...


POLICY_ADAPTER = "policy"
#: A request (a session) naming this adapter samples the base model, without any adapter (an
#: A/B evaluation of the base against the policy's adapter in one engine). Refused once full
#: weights have been reloaded: the base is gone then.
BASE_ADAPTER = "__base__"


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
    data: bytes = b""  # stdout and stderr interleaved, cut at Limits.output_bytes
    timed_out: bool = False
    truncated: bool = False
    killed_by: str | None = None  # "timeout" | "memory" | "pids" | "wall" | None
    duration_s: float = 0.0

    @property
    def output(self) -> str:
        """``data`` as text, undecodable bytes replaced (decoded on each use: a reader of a
        large binary stream, such as the judged run's records, reads ``data`` and never holds
        a text copy four times its size)."""
        return self.data.decode("utf-8", "replace")


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, daemon down, image missing): an environment
    failure, never the agent's."""


#: What ``Sandbox.read_file`` reads at most unless told otherwise (bytes).
READ_LIMIT = 16 << 20


class FileTooLarge(OSError):
    """A file in a sandbox is larger than the reader's ``limit``: nothing of it was kept, and
    no more than about ``limit`` bytes of it were ever read. What the sandbox's code wrote, so
    an ``OSError`` like a missing file, never a ``SandboxError``."""

    def __init__(self, path: str, limit: int, size: int | None = None) -> None:
        seen = f"{size} bytes" if size is not None else "more"
        super().__init__(f"{path}: {seen} in the sandbox, over the read limit of {limit} bytes")
        self.path, self.limit, self.size = path, limit, size


@runtime_checkable
class Sandbox(Protocol):
    """A running, locked-down copy of a task's repository at ``base_commit``.

    The repository is at ``workdir``; its git history is one commit; the network reaches only
    ``proxy_url`` (when one was given at start). ``test_patch`` is never inside.

    ``exec(..., judged=True)`` runs the command as the sandbox's own unprivileged
    ``judged_uid`` (``legorl.sandbox.common``: drawn per sandbox, so that no per-user kernel
    state is shared between sandboxes; no passwd entry names it) with every
    capability gone (effective, permitted, inheritable, ambient) and no-new-privileges, so no
    setuid binary or file capability gives any back. Before its first judged command the
    sandbox chowns the repository to that uid (as root, never following a symlink), so the
    judged code may write the repository and nothing else outside /tmp. Each judged command
    gets a fresh folder ``/tmp/legorl-judged-<random>/`` (mode 0700, owned by the judged
    uid) made empty by root just before it: ``HOME`` is its ``home/``, ``TMPDIR`` its ``tmp/``,
    ``PYTHONPYCACHEPREFIX`` its ``pycache/``, so no bytecode cache is read from (or written
    to) the repository. These three win over ``env``. ``PYTHONDONTWRITEBYTECODE`` is left as
    the image and ``env`` set it: with the prefix, bytecode goes to the private folder, where
    writing it is harmless and spares a test suite's subprocesses from compiling again. A
    Python started with ``-I`` or ``-E`` ignores ``PYTHONPYCACHEPREFIX``: give it
    ``-X pycache_prefix="$PYTHONPYCACHEPREFIX"`` as well. Files and folders root made under
    /tmp with mode 0700 (0600) stay unreadable to the judged command. Judged commands of one
    sandbox share the uid (and, on Docker, processes outlive their command): one judged run
    per sandbox, then ``close``. The local backend needs to run as root for judged commands
    (a separate host uid); elsewhere it raises ``SandboxError``.
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
        judged: bool = False,  # as the unprivileged judged user (see the class docstring)
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def read_file(self, path: str, *, limit: int | None = READ_LIMIT) -> bytes:
        """The bytes of a regular file (relative paths under ``workdir``), streamed: a file
        over ``limit`` bytes raises ``FileTooLarge`` having read at most about ``limit`` of it
        (``None``: no bound). ``FileNotFoundError`` / ``IsADirectoryError`` as for a host
        file."""
        ...

    async def diff(self) -> str:
        """``git diff`` of the working tree (untracked files included) against base_commit."""
        ...

    async def alive(self) -> bool | None:
        """Whether the sandbox is still up, judged by its backend, never by a command inside
        it (whose tools the agent may have replaced): True; False when it has ended or broken
        while its backend answers (what ran in it did that: the agent's processes or the
        state they left, never legorl, which ends a sandbox only by ``close``); None when the
        backend cannot tell (it, or the machine under it, failed)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Starts sandboxes. ``start(..., grading=True)`` makes a grading sandbox: one per
    verdict-bearing run, from the pristine instance layer, closed after that run. Its root
    file system is read-only (the image's or env layer's site-packages and ``.pth`` files,
    /usr, /etc, /opt, / itself) even for root; only the repository (``workdir``, a fresh copy
    of the instance layer's) and /tmp are writable, and /dev/shm, private to the sandbox. Both
    are size-capped tmpfs, exec allowed (Docker: 1 GiB and 512 MiB; local: the sandbox's
    private folder, 1.5 GiB in all), so what a judged command writes is never on the disk.
    No network, no proxy. Docker also keeps only the capabilities root's own grading steps
    use (chown, file ownership overrides, kill). Agent sandboxes (``grading=False``) are as
    before."""

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
        grading: bool = False,  # a grading sandbox (see the class docstring)
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


# ---- executors ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class RolloutWork:
    """Runs to roll out, described in records and plain config only (no live object), so that an
    executor may send it to another machine, which builds its own sandbox backend and proxy
    front from it.

    Every Trajectory that comes back has its Turns readable: inline (``turns``), or in
    ``{folder}/turns/{trajectory_id}.jsonl`` with ``turns_ref`` relative to ``folder``."""

    runs: list[Any]  # legorl.rollout.Run: a records.Task, a sample index, an id prefix
    harness: str  # a ``legorl.harnesses.HARNESSES`` name or module:Class
    harness_options: dict[str, Any] = field(default_factory=dict)
    sandbox: str = "local"  # a ``legorl.sandbox.SANDBOXES`` name or module:Class
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    model: str  # the model name the harness asks the proxy for
    tasks_dir: str  # task paths (repository archives, test files) are relative to it
    folder: str  # the phase's folder on the machine that asked (trajectories' refs point here)
    timeout: float = 300.0  # seconds per harness run
    concurrency: int = 4  # runs at once, over the whole work
    run_id: str  # names the work's sandboxes
    # the LoRA adapter its sessions sample with (``GenerationRequest.adapter``; BASE_ADAPTER:
    # the base model); None: the policy
    adapter: str | None = None


@dataclass(slots=True, kw_only=True)
class GradeWork:
    """Trajectories to grade, as records and plain config (see ``RolloutWork``)."""

    trajectories: list[Any]  # records.Trajectory
    tasks: list[Any]  # records.Task: at least those the trajectories name
    sandbox: str = "local"
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    tasks_dir: str
    folder: str  # the trajectories' turns_ref are relative to it (hack scans read the Turns)
    concurrency: int = 4
    run_id: str


class ExecutorError(RuntimeError):
    """The executor cannot take the work (no cluster, no node fit, every node gone): one line."""


@runtime_checkable
class Executor(Protocol):
    """Where a loop's rollout and grading work runs: in this process
    (``legorl.executors.inprocess.InProcessExecutor``) or spread over machines.

    ``rollout`` yields each run's Trajectory as soon as it ends (in no set order), one per run,
    environment failures included (an executor never raises for one run's failure). ``grade``
    yields each graded Trajectory (``reward``, ``verdict``, ``hack_flags`` set), one per input.
    ``prepare`` makes sure the work on ``tasks`` can run (sandbox images built or pulled), raising
    ``SandboxError`` when it cannot, before the loop starts any work. ``load_weights`` moves the
    engine(s) the rollouts sample from to the checkpoint folder ``path`` of this machine (calls in
    flight finish under the old weights) and returns the new policy version, raising
    ``EngineError`` when it cannot."""

    name: ClassVar[str]

    async def prepare(self, sandbox: str, sandbox_options: dict[str, Any], tasks: list) -> None: ...

    def rollout(self, work: RolloutWork) -> AsyncIterator[Any]: ...

    def grade(self, work: GradeWork) -> AsyncIterator[Any]: ...

    async def load_weights(self, path: str) -> int: ...

    async def close(self) -> None: ...
