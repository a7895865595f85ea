"""The rollout stage: run a harness on tasks in sandboxes through the proxy, G samples per task,
one Trajectory per run written as soon as it ends.

    legorl rollout --tasks fixtures/tasks/train.jsonl --harness mini --group-size 2 --limit 4 \\
        --engine embedded --model fixtures/models/tiny-qwen3 --sandbox local --out runs/traj.jsonl

Each run gets its own proxy session (its id is the trajectory id) and its own sandbox, whose
network reaches only the proxy. The proxy hands out the session as a capability, a route with
a secret (``/s/{id}~{secret}``), which is all the sandbox is given: another run's session is
not reachable by its id, by an API key or by a guessed secret. The secret is redacted from
what the run records and dies when the session closes. Turns go to
``{turns_dir}/{trajectory_id}.jsonl`` and the Trajectory refers to them.

Environment failures (the sandbox would not start, the harness crashed, the proxy failed) get
their own status and are never written as a failed attempt of the agent; training drops them.
So nothing the agent controls may claim one: its commands run beside the harness, and could
print what the harness prints on a proxy error or kill the harness. A harness's claim of an
environment failure stands only where the proxy's own record of the session
(``SessionReport``) backs it: no output of the policy had reached the harness yet, or the engine
failed the session's last call. Otherwise the episode is ``harness_error``, the policy's
outcome, graded like any other, and ``evidence["uncorroborated"]`` says what was claimed and
why it did not stand. A sandbox failure legorl's backend raised itself needs no corroboration,
except a command that failed once the agent had started (the harness's, or the diff of the tree
it left): the agent can make those fail (a file too large to diff, a folder nobody may read, a
``kill 1`` that ends its container), so where the sandbox
still answers afterwards, or ended while its backend answers (``Sandbox.alive``), the failure
is ``harness_error``, graded with no patch; only where the backend cannot tell (it, or its
node, failed) is it ``sandbox_error``.
An episode the proxy truncated (a budget spent, or the prompt outgrew the model's context) is
``truncated`` whatever the harness's exit looked like: that is the policy's doing, and align's
truncation rule handles it. Re-running with the same output skips finished trajectories.

``legorl rollout`` and ``legorl loop`` put a rollout together the same way: ``serve_engine``
(an ``EngineSpec`` made and served by an in-process proxy), a ``RunContext`` (what every run
shares), then ``rollout_into`` (runs → trajectory file → monitor).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.protocols import Harness, Limits, Sandbox, SandboxBackend, SandboxError
from legorl.records import (
    ENVIRONMENT_FAILURES,
    SessionReport,
    TokenCounts,
    Trajectory,
    Turn,
    from_object,
    read_jsonl,
)
from legorl.routing import sidecar_of


@dataclass(slots=True, kw_only=True)
class Run:
    task: Any  # records.Task
    sample_index: int
    # Put before the id where several rollouts of the same tasks are read together (the loop's
    # iterations and evaluations): letters, digits, ``.``, ``_`` and ``-``, as session ids.
    prefix: str = ""

    @property
    def trajectory_id(self) -> str:
        return f"{self.prefix}{self.task.instance_id}.{self.sample_index}"


def plan_runs(
    tasks: Iterable[Any],
    group_size: int,
    limit: int | None,
    done: set[str],
    *,
    prefix: str = "",
) -> list[Run]:
    """Tasks × group_size runs, the first ``limit`` tasks only, minus those already done;
    ``prefix`` goes before every trajectory id."""
    chosen = list(tasks)[:limit] if limit is not None else list(tasks)
    runs = [Run(task=t, sample_index=k, prefix=prefix) for t in chosen for k in range(group_size)]
    return [r for r in runs if r.trajectory_id not in done]


def finished_ids(out: Path | None) -> set[str]:
    """Trajectory ids already in ``out`` (a truncated last line from a kill is ignored)."""
    if out is None or not out.exists():
        return set()
    return {t.trajectory_id for t in read_jsonl(out, Trajectory, skip_bad=True)}


class SessionOpenError(Exception):
    """The proxy would not open a run's session (the run is a ``proxy_error``)."""


@dataclass(frozen=True, slots=True)
class SessionAccess:
    """One run's way to its proxy session: what its sandbox is given, and nothing else."""

    url: str  # host-side base URL of the session; its route carries the secret
    secret: str  # never recorded: redacted from the run's evidence

    @classmethod
    def of_route(cls, base: str, route: str) -> SessionAccess:
        sid, sep, secret = route.removeprefix("/s/").partition("~")
        if not route.startswith("/s/") or not sep or not sid or not secret or "/" in secret:
            raise SessionOpenError(f"the proxy answered {route[:60]!r}, not a session route")
        return cls(url=f"{base}{route}", secret=secret)

    def redact(self, text: str) -> str:
        return text.replace(self.secret, "…")


@dataclass(slots=True, kw_only=True)
class ProxyEndpoint:
    """Where sandboxes reach the proxy, and how sessions are opened and closed on it.

    ``open_session(id, main_system)`` opens a capability session (``main_system``: the
    harness's declared system prompt, or None) and raises ``SessionOpenError`` if it cannot.
    ``close_session(id)`` returns the proxy's record of the session (``SessionReport``), or
    None when the proxy gave none."""

    url: str  # host-side base URL
    turns_dir: Path
    open_session: Callable[[str, str | None], Awaitable[SessionAccess]]
    close_session: Callable[[str], Awaitable[SessionReport | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunContext:
    """What every run of one rollout shares; the caller builds it once."""

    harness: Harness
    backend: SandboxBackend
    proxy: ProxyEndpoint
    model: str  # the model name the harness asks the proxy for
    tasks_dir: Path  # task paths (repo archives, test files) are relative to it
    timeout: float  # seconds per harness run
    run_id: str  # names this rollout's sandboxes
    refs_relative_to: Path  # each Trajectory's turns_ref is relative to this folder
    limits: Limits | None = None  # the sandbox's; None: the run's timeout plus two minutes

    def sandbox_limits(self) -> Limits:
        return self.limits or Limits(wall_s=self.timeout + 120)


@dataclass(slots=True)
class Progress:
    """Counters the CLI shows while the stage runs."""

    total: int
    done: int = 0
    running: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(time.monotonic() - self.started, 1e-9)


def _turns_of(path: Path) -> list[Turn]:
    return list(read_jsonl(path, Turn, skip_bad=True)) if path.exists() else []


def _set_aside(path: Path) -> None:
    # Turns of a run that never wrote its trajectory (the stage was killed): kept, not reused.
    if path.exists():
        n = 1
        while path.with_name(f"{path.name}.orphan-{n}").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.orphan-{n}"))
        routing = sidecar_of(path)  # its MoE routing, whose rows the Turns point at
        if routing.exists():
            routing.rename(routing.with_name(f"{routing.name}.orphan-{n}"))


async def run_one(run: Run, ctx: RunContext) -> Trajectory:
    """One harness run on one task; never raises for an environment failure."""
    harness, proxy = ctx.harness, ctx.proxy
    tid = run.trajectory_id
    turns_path = proxy.turns_dir / f"{tid}.jsonl"
    timings: dict[str, float] = {}
    evidence: dict[str, Any] = {}
    patch = ""
    status = "sandbox_error"
    t0 = time.monotonic()
    try:
        access = await proxy.open_session(tid, getattr(harness, "main_system", None))
    except SessionOpenError as exc:
        access = None
        status, evidence["error"] = "proxy_error", f"proxy: {exc}"
    if access is not None:
        # Set aside only once the id is this run's alone: no client can write that file since.
        _set_aside(turns_path)
        report: SessionReport | None = None
        claimed = False
        try:
            status, patch, claimed = await _attempt(run, access, ctx, timings, evidence)
        finally:
            report = await proxy.close_session(tid)
        truncated = report.truncated if report is not None else None
        if truncated is not None and status != "sandbox_error":
            status, evidence["truncated"] = "truncated", truncated
        elif claimed and status in ENVIRONMENT_FAILURES:
            status, why = judge_claim(status, report)
            evidence["uncorroborated" if status == "harness_error" else "corroborated"] = why
        for key, value in evidence.items():
            if isinstance(value, str):
                evidence[key] = access.redact(value)
    turns = _turns_of(turns_path) if access is not None else []
    if status == "ok" and not [t for t in turns if not t.flags.aux]:
        status, evidence["error"] = "proxy_error", "the harness ended without calling the model"
    timings["total_s"] = time.monotonic() - t0
    ref = os.path.relpath(turns_path, ctx.refs_relative_to) if turns else None
    return Trajectory(
        trajectory_id=tid,
        task_id=run.task.instance_id,
        group_id=run.task.instance_id,
        sample_index=run.sample_index,
        harness=harness.name,
        status=status,  # type: ignore[arg-type]
        patch=patch,
        turns_ref=[ref] if ref else None,
        evidence=evidence,
        timings={k: round(v, 3) for k, v in timings.items()},
        tokens=TokenCounts(
            prompt=sum(t.prompt_len for t in turns),
            completion=sum(len(t.completion_ids) for t in turns),
        ),
    )


async def _attempt(
    run: Run,
    access: SessionAccess,
    ctx: RunContext,
    timings: dict[str, float],
    evidence: dict[str, Any],
) -> tuple[str, str, bool]:
    """Start the sandbox, run the harness, take the diff: (status, patch, whether the status is
    the harness's own claim rather than what legorl saw)."""
    harness = ctx.harness
    status, patch, claimed = "sandbox_error", "", False
    t0 = time.monotonic()
    sandbox: Sandbox | None = None
    try:
        try:
            sandbox = await ctx.backend.start(
                run.task,
                str(ctx.tasks_dir),
                run_id=ctx.run_id,
                proxy_url=access.url,
                limits=ctx.sandbox_limits(),
                harness_runtime=harness.needs_runtime,
            )
        except SandboxError as exc:
            evidence["error"] = f"sandbox: {exc}"
        timings["sandbox_start_s"] = time.monotonic() - t0
        if sandbox is not None:
            t1 = time.monotonic()
            try:
                outcome = await harness.run(
                    sandbox, run.task.problem_statement, model=ctx.model, timeout=ctx.timeout
                )
                status, claimed = outcome.status, True
                evidence.update(exit_code=outcome.exit_code, log_tail=outcome.log_tail)
            except SandboxError as exc:
                # the agent's commands run in the sandbox: it may have made this fail
                evidence["error"] = f"sandbox: {exc}"
                status = await _sandbox_failure(sandbox, evidence)
            timings["harness_s"] = time.monotonic() - t1
            try:
                patch = await sandbox.diff()
            except SandboxError as exc:
                evidence["error"] = f"sandbox (diff): {exc}"
                status, claimed = await _sandbox_failure(sandbox, evidence), False
    finally:
        if sandbox is not None:
            with contextlib.suppress(Exception):
                await sandbox.close()
    return status, patch, claimed


async def _sandbox_failure(sandbox: Sandbox, evidence: dict[str, Any]) -> str:
    """The status of a run whose sandbox failed a command after the agent started (the harness's
    or the diff's): the agent's outcome where its backend says the sandbox is up (what the
    agent did, or the tree or tools it left, made that one fail) or ended or broke while the
    backend answers (what the agent ran did that: a ``kill 1`` as root, a mount point of its
    own sandbox replaced); an environment failure only where the backend cannot tell (it, or
    the node under it, failed). ``evidence["alive"]`` says which."""
    try:
        alive = await sandbox.alive()
    except SandboxError as exc:
        alive = None
        evidence["alive"] = f"the backend cannot tell whether the sandbox runs: {exc}"
    if alive is True:
        evidence["alive"] = "the sandbox is up: what the agent did or left made the command fail"
        return "harness_error"
    if alive is False:
        evidence["alive"] = (
            "the sandbox ended or broke while its backend answers: what ran in it did that"
        )
        return "harness_error"
    evidence.setdefault("alive", "the backend cannot tell whether the sandbox runs")
    return "sandbox_error"


def judge_claim(claimed: str, report: SessionReport | None) -> tuple[str, str]:
    """The status of a run whose harness claimed the environment failure ``claimed``, judged on
    the proxy's record of its session alone: (status, why).

    The claim stands where the policy cannot have caused it: none of its output had reached
    the harness (its commands run only once a completion asks for them), or the engine failed
    the session's last call, after which the policy has not acted. Otherwise it is the
    policy's outcome, ``harness_error``. Without a record (a proxy that gave none) nothing
    refutes the claim."""
    if report is None:
        return claimed, "the proxy gave no record of the session"
    if report.completions == 0:
        return claimed, "no output of the policy had reached the harness"
    if report.failed_last:
        return claimed, f"the engine failed the session's last call: {report.engine_failures[-1]}"
    seen = (
        f"the engine's last failure ({report.engine_failures[-1]}) came before the policy's "
        "last completion"
        if report.engine_failures
        else "the proxy answered every call"
    )
    return "harness_error", (
        f"the harness reported {claimed} after {report.completions} completion(s) of the "
        f"policy, and {seen}: nothing legorl saw puts it on the environment"
    )


async def rollout(
    runs: list[Run],
    ctx: RunContext,
    *,
    concurrency: int,
    progress: Progress | None = None,
) -> AsyncIterator[Trajectory]:
    """Run every run with at most ``concurrency`` at once; yield trajectories as they end."""
    gate = asyncio.Semaphore(max(1, concurrency))
    progress = progress or Progress(total=len(runs))

    async def guarded(run: Run) -> Trajectory:
        async with gate:
            progress.running += 1
            try:
                return await run_one(run, ctx)
            finally:
                progress.running -= 1

    pending = {asyncio.ensure_future(guarded(r)) for r in runs}
    try:
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in finished:
                traj = fut.result()
                progress.done += 1
                progress.by_status[traj.status] += 1
                progress.completion_tokens += traj.tokens.completion
                yield traj
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def rollout_into(
    out: Path | None,
    runs: list[Run],
    ctx: RunContext,
    *,
    concurrency: int,
    progress: Progress | None = None,
    monitor: Any = None,
    each: Callable[[Trajectory], None] | None = None,
) -> None:
    """``rollout``, each Trajectory appended to ``out`` (None: stdout) as it ends, then shown to
    ``monitor`` (a ``monitors.Monitor``; a strict one stops here with ``MonitorStop``) and to
    ``each``."""
    from legorl.records import JsonlWriter

    with JsonlWriter(out) as writer:
        async for traj in rollout(runs, ctx, concurrency=concurrency, progress=progress):
            writer.write(traj)
            if monitor is not None:
                monitor.observe_trajectory(traj)
            if each is not None:
                each(traj)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """The engine a rollout's proxy serves: ``make_engine``'s name and options."""

    name: str = "embedded"  # embedded | forced | vllm | module:Class
    weights: Path  # the folder it loads: the model, a checkpoint of it, or an adapter (on its base)
    options: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # the version those weights are (a continued loop's checkpoint)
    log_dir: Path  # where a vLLM server that legorl launches writes its log


@contextlib.asynccontextmanager
async def serve_engine(
    model: str | Path, engine: EngineSpec, turns_dir: Path, budget: Any = None
) -> AsyncIterator[tuple[ProxyEndpoint, Any]]:
    """``engine`` made, behind an in-process proxy for ``model`` (its tokenizer and served
    name); yields (endpoint, core) and closes both. Raises what ``make_engine`` raises: a
    ``ValueError``, ``TypeError`` or ``FileNotFoundError`` for a bad option, an ``EngineError``
    for an engine that would not start."""
    from legorl.engines import make_engine
    from legorl.engines.adapters import adapter_base, is_adapter

    options = dict(engine.options)
    if engine.name == "vllm" and "base_url" not in options:
        options.setdefault("log_path", str(engine.log_dir / "vllm-server.log"))
    # An adapter checkpoint (a continued LoRA loop's): the engine serves its base model and
    # loads the adapter as the policy, so that the next adapter is swapped in like the first.
    adapter = engine.weights if is_adapter(engine.weights) else None
    weights = adapter_base(adapter) if adapter is not None else engine.weights
    # In a thread: loading weights, or waiting for a vLLM server, must not stall the event loop.
    eng = await asyncio.to_thread(make_engine, engine.name, model_path=str(weights), **options)
    try:
        if adapter is not None:
            # a policy adapter's load makes the next policy version: the one it had
            eng.policy_version = max(engine.policy_version - 1, 0)
            await eng.load_weights(str(adapter))
        if engine.policy_version:
            eng.policy_version = engine.policy_version
    except BaseException:
        await eng.close()
        raise
    try:
        async with inprocess_proxy(model, eng, turns_dir, budget) as served:
            yield served
    finally:
        await eng.close()


@contextlib.asynccontextmanager
async def inprocess_proxy(
    model: str | Path, engine: Any, turns_dir: Path, budget: Any = None
) -> AsyncIterator[tuple[ProxyEndpoint, Any]]:
    """A proxy on 127.0.0.1 in this process, sessions opened per run; yields (endpoint, core).
    ``budget`` is a ``proxy.core.Budget`` (None: no caps)."""
    from legorl.proxy.core import Budget, ProxyConfig, ProxyCore
    from legorl.proxy.server import ProxyServer

    config = ProxyConfig(model=model, out=turns_dir, open_sessions=False, budget=budget or Budget())
    core = ProxyCore(config, engine)
    server = ProxyServer(core, "127.0.0.1", 0)
    await server.start()

    try:
        yield core_endpoint(core, server.url, turns_dir, own_folder=False), core
    finally:
        await server.close()
        core.close()


def core_endpoint(
    core: Any, url: str, turns_dir: Path, *, own_folder: bool = True, adapter: str | None = None
) -> ProxyEndpoint:
    """The endpoint of an in-process ``ProxyCore`` served at ``url``; with ``own_folder`` its
    sessions write their Turns to ``turns_dir`` whatever the core's folder is (several
    endpoints of one core, each with its own folder, may be in use at once). ``adapter``: the
    LoRA adapter its sessions sample with (``RolloutWork.adapter``); None: the policy."""

    async def open_session(sid: str, main_system: str | None = None) -> SessionAccess:
        from legorl.proxy.chat import ApiError

        try:
            out = turns_dir if own_folder else None
            route = core.open_session(sid, main_system=main_system, out=out, adapter=adapter)
        except ApiError as err:
            raise SessionOpenError(err.message) from None
        return SessionAccess.of_route(url, route)

    async def close_session(sid: str) -> SessionReport | None:
        report: SessionReport | None = core.close_session(sid)
        return report

    return ProxyEndpoint(
        url=url, turns_dir=turns_dir, open_session=open_session, close_session=close_session
    )


def remote_proxy(url: str, turns_dir: Path, admin_token: str) -> ProxyEndpoint:
    """A proxy already running elsewhere on this machine (``legorl proxy serve``; its Turn
    files are in ``turns_dir``): sessions are opened through its admin API, with its token.

    Raises ``SessionOpenError`` unless the proxy serves registered sessions only: on one that
    also serves open sessions, any sandbox could create a session by naming it, and write Turns
    under a name a run's file has (one closed before that proxy last restarted)."""
    import httpx

    base = url.rstrip("/")
    auth = {"authorization": f"Bearer {admin_token}"}
    # one TLS context for every call's client: building one loads the CA bundle, about 24 ms of
    # CPU (with the GIL held) per client, twice per run otherwise
    tls = httpx.create_ssl_context()
    try:
        health = httpx.get(f"{base}/healthz", timeout=30, verify=tls).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SessionOpenError(f"{base}/healthz: {exc}") from None
    if not isinstance(health, dict) or health.get("open_sessions") is not False:
        raise SessionOpenError(
            f"the proxy at {base} serves open sessions, which a sandbox could name: start it "
            "with --registered-only for a rollout"
        )

    async def open_session(sid: str, main_system: str | None = None) -> SessionAccess:
        try:
            async with httpx.AsyncClient(verify=tls) as client:
                resp = await client.post(
                    f"{base}/admin/sessions",
                    json={"id": sid, "main_system": main_system},
                    headers=auth,
                )
        except httpx.HTTPError as exc:
            raise SessionOpenError(f"{base}: {exc}") from None
        if resp.status_code != 200:
            raise SessionOpenError(
                f"{base}/admin/sessions answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            route = resp.json()["route"]
        except (ValueError, KeyError, TypeError):
            raise SessionOpenError(
                f"{base}/admin/sessions gave no session route (a legorl proxy older than "
                "capability sessions?)"
            ) from None
        return SessionAccess.of_route(base, str(route))

    async def close_session(sid: str) -> SessionReport | None:
        try:
            async with httpx.AsyncClient(verify=tls) as client:
                resp = await client.delete(f"{base}/admin/sessions/{sid}", headers=auth)
            return from_object(SessionReport, resp.json().get("report"), "report")
        except (httpx.HTTPError, ValueError, AttributeError):  # FieldError is a ValueError
            return None

    return ProxyEndpoint(
        url=base,
        turns_dir=turns_dir,
        open_session=open_session,
        close_session=close_session,
    )
