"""Engine replicas behind one engine: sticky sessions, least-loaded placement, weight sync of the
whole fleet, and failover that keeps an episode going with its tokens exact.

    fleet = Fleet([replica_a, replica_b], up=[True, True])   # the vllm engine is a Fleet
    async for chunk in fleet.generate(request): ...

* **Placement.** A request's session is its ``cache_key`` up to the segment (``#``) and any
  auxiliary sub-session (``~``): every call of one session goes to the replica it was first
  placed on, so that replica's prefix cache serves it. A new session goes to the live replica
  with the fewest calls in flight (ties: the fewest sessions, then the lowest index).
* **Weight sync** (``load_weights``) holds new calls at the fleet's gate, waits for every call
  in flight on any replica, reloads every live replica and resets its prefix cache, and only
  then bumps the policy version and opens the gate: no call sees the new version before every
  replica serves it. A replica whose reload fails is taken out of rotation.
* **Adapters** (``load_adapter``, ``load_weights`` of an adapter folder): the same sync, each
  live replica loading the adapter's new version (``Replica.load_adapter``) instead of a
  checkpoint; a request's ``adapter`` (the policy's adapter when it names none) is served under
  the name the replica serving it loaded. With ``keep_versions`` K + 1 > 1 each replica keeps
  the last K + 1 versions of every adapter loaded (``held_versions``), and a request that names
  one of them (``adapter_version``: the proxy pins a session to the version its first call
  sampled with) is served by it: an episode started under an older adapter finishes on it in a
  loop K steps off-policy. vLLM's ``max_loras`` must cover them. When every replica refuses the adapter as the
  request's fault (``EngineRequestError``: no runtime LoRA loading, an adapter it cannot take),
  the load fails with that error and nothing changes; a replica that refuses what others took
  is taken out of rotation.
* **Failover.** A replica is taken out of rotation when a call's connection to it fails (refused,
  reset, closed early), when it answers a server error and then fails its ``/health``, or when
  the watcher's ``/health`` probe gets no answer twice in a row (``health_timeout_s``). Its
  calls in flight are cut at once and retried on another live replica, with the whole prompt as
  token ids, so that replica prefills the history again and samples from the same tokens. A
  streamed call whose first tokens had already gone out goes on from them: the retry's prompt is
  the prompt plus those tokens, and it asks for the tokens still allowed. The request's
  ``placement`` says which replica sampled, which failed, how many tokens were prefilled again
  and how long the call stalled; the proxy writes it into the Turn. With no live replica left a
  call fails with ``EngineError`` (the proxy answers it as the API's error).
* **Rejoining.** The watcher probes replicas out of rotation; one that answers again (a replica
  legorl launched is first relaunched, ``relaunch``) rejoins after a weight sync to the fleet's
  current checkpoint and a prefix-cache reset, then loads the current version of every adapter,
  under the same lock as ``load_weights``.

A ``Replica`` is the transport to one server (``engines/vllm_client.py`` has vLLM's); the fleet
keeps its own state of each beside it (``Slot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal, Protocol

from legorl.protocols import (
    POLICY_ADAPTER,
    EngineError,
    EngineRequestError,
    GenerationRequest,
    TokenStep,
)

_STICKY_KEPT = 100_000  # sessions remembered for placement (the least recently seen go)
_STRIKES = 2  # unanswered /health probes in a row that take a replica out of rotation
_RELAUNCHES = 3  # relaunches of one legorl-owned replica before it is left down


class ReplicaFailure(EngineError):
    """A call failed in a way that may be its replica's. ``certain``: the replica is unreachable
    (refused, reset, closed early); otherwise it answered an error (a 5xx, an aborted request)
    and its ``/health`` decides."""

    def __init__(self, message: str, *, certain: bool) -> None:
        super().__init__(message)
        self.certain = certain


class Replica(Protocol):
    """The transport to one server of the fleet."""

    url: str
    owned: bool  # legorl launched it (and can relaunch it)

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        """The request's tokens from this server; ``ReplicaFailure`` when it may have failed."""
        ...

    async def probe(self, timeout: float) -> bool | None:
        """``GET /health``: True healthy, False refused or unhealthy, None no answer in time."""
        ...

    async def reload(self, path: str) -> None: ...

    async def reset_cache(self) -> None: ...

    async def load_adapter(self, name: str, version: int, path: str, keep: int = 1) -> None:
        """Load ``path`` as version ``version`` of adapter ``name``; the calls for ``name`` it
        serves from then on use it (those naming a version it still holds: that one), and it
        holds the last ``keep`` versions of ``name``, dropping older ones."""
        ...

    async def drop_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (calls for it get the base model)."""
        ...

    async def forget_adapters(self) -> None:
        """Drop every adapter it may still hold (a replica rejoining, maybe relaunched)."""
        ...

    async def check_serving(self) -> None:
        """Raise ``EngineError`` unless it serves the fleet's model with its context length."""
        ...

    def alive(self) -> bool:
        """For a legorl-owned replica: is its process running (others: True)."""
        ...

    def relaunch(self) -> None:
        """Start a legorl-owned replica's server again (blocking, until healthy)."""
        ...

    async def aclose(self) -> None: ...


State = Literal["up", "down", "joining"]
# a fleet-wide change: what to do on each live replica, then what to record for those it reached
_Sync = tuple[Callable[["Replica"], Awaitable[None]], Callable[[list["Slot"]], None]]


@dataclasses.dataclass(slots=True, eq=False)
class _Attempt:
    """One call's attempt on one replica, so that taking the replica down can cut it."""

    task: asyncio.Task[object] | None
    waiting: bool = False  # inside the replica's await (not suspended at a yield)
    aborted: str | None = None  # why the replica was taken down, once it was


@dataclasses.dataclass(slots=True, eq=False)
class Slot:
    """The fleet's state of one replica."""

    index: int
    replica: Replica
    state: State = "down"
    version: int = 0  # the policy version it serves
    inflight: int = 0
    sessions: int = 0  # sessions placed on it (the placement's tie-break)
    strikes: int = 0
    why: str = ""  # why it is out of rotation
    down_since: float = 0.0  # time.monotonic() when it was taken out
    relaunches: int = 0
    attempts: set[_Attempt] = dataclasses.field(default_factory=set)
    task: asyncio.Task[None] | None = None  # a relaunch or rejoin in progress


class _Gate:
    """Lets calls through unless a weight sync holds it shut, and counts them."""

    def __init__(self) -> None:
        self.active = 0
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()

    async def enter(self) -> None:
        while not self.open.is_set():
            await self.open.wait()
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()


class _LoopState:
    """What belongs to one event loop: the gate, the sync lock, the watcher task."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.gate = _Gate()
        self.lock = asyncio.Lock()
        self.watcher: asyncio.Task[None] | None = None


def session_of(cache_key: str | None) -> str | None:
    """The session a request belongs to, from its ``cache_key`` (``{sub}#{segment}``)."""
    if cache_key is None:
        return None
    return cache_key.split("#", 1)[0].split("~", 1)[0]


class Fleet:
    """Replicas behind one engine; see the module docstring."""

    label = "engine"  # how messages name a replica ("vLLM")

    def __init__(
        self,
        replicas: list[Replica],
        *,
        up: list[bool],
        health_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        relaunch: bool = True,
        can_reload: bool = True,
        keep_versions: int = 1,
    ) -> None:
        self.slots = [
            Slot(i, r, state="up" if ok else "down", why="" if ok else "did not answer at start")
            for i, (r, ok) in enumerate(zip(replicas, up, strict=True))
        ]
        self.policy_version = 0
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.relaunch = relaunch
        self.can_reload = can_reload
        self._weights: str | None = None  # the checkpoint of the current full weights
        self.policy_adapter: str | None = None  # the adapter calls without one get
        self.adapter_versions: dict[str, int] = {}  # loaded adapter -> its version
        self._adapter_paths: dict[str, str] = {}  # loaded adapter -> its version's folder
        self.keep_versions = keep_versions  # versions of each adapter every replica holds
        # loaded adapter -> the versions replicas hold (newest last), and their folders
        self.held_versions: dict[str, list[int]] = {}
        self._held_paths: dict[str, dict[int, str]] = {}
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._loop_state: _LoopState | None = None
        self.events: list[str] = []  # one line per replica taken out or rejoined, latest last
        self.last_drain_s: float | None = None  # the last sync's wait for the calls in flight

    # ---- per event loop ----------------------------------------------------------------------

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loop_state
        if state is None or state.loop is not loop:
            state = self._loop_state = _LoopState(loop)
        if state.watcher is None and self.health_interval_s > 0:
            state.watcher = loop.create_task(self._watch(), name="legorl-replica-watcher")
        return state

    # ---- placement ---------------------------------------------------------------------------

    def place(self, key: str | None, exclude: set[int]) -> Slot | None:
        """The replica a call of session ``key`` goes to (None: no live one)."""
        if key is not None:
            index = self._sticky.get(key)
            if index is not None:
                slot = self.slots[index]
                if slot.state == "up" and index not in exclude:
                    self._sticky.move_to_end(key)
                    return slot
        live = [s for s in self.slots if s.state == "up" and s.index not in exclude]
        if not live:
            return None
        best = min(live, key=lambda s: (s.inflight, s.sessions, s.index))
        if key is not None:
            old = self._sticky.pop(key, None)
            if old is not None:
                self.slots[old].sessions -= 1
            self._sticky[key] = best.index
            best.sessions += 1
            if len(self._sticky) > _STICKY_KEPT:
                _, dropped = self._sticky.popitem(last=False)
                self.slots[dropped].sessions -= 1
        return best

    def replica_of(self, key: str) -> str | None:
        """The URL of the replica session ``key`` sticks to (None: not placed yet)."""
        index = self._sticky.get(key)
        return None if index is None else self.slots[index].replica.url

    # ---- generation --------------------------------------------------------------------------

    def admit(self, request: GenerationRequest) -> None:
        """Refuse a request before it is placed (subclasses check what their servers can't)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        self.admit(request)
        state = self._state()
        await state.gate.enter()
        try:
            async for chunk in self._serve(request):
                yield chunk
        finally:
            state.gate.leave()

    async def _serve(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        key = session_of(request.cache_key)
        placement = request.placement
        delivered: list[int] = []  # completion tokens that went out (from any replica)
        tried: set[int] = set()
        failed_at: float | None = None  # the failed replica's last sign of life
        attempt_request = request
        task = asyncio.current_task()
        while True:
            slot = self.place(key, tried)
            if slot is None:
                raise EngineError(self._none_left(tried))
            placement.replica = slot.replica.url
            attempt = _Attempt(task)
            slot.attempts.add(attempt)
            slot.inflight += 1
            stream = slot.replica.stream(attempt_request)
            failure: ReplicaFailure | None = None
            alive_at = time.monotonic()  # the attempt's start, then its latest token
            try:
                while True:
                    if attempt.aborted is not None:
                        raise ReplicaFailure(attempt.aborted, certain=True)
                    attempt.waiting = True
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        attempt.waiting = False
                    alive_at = time.monotonic()
                    if failed_at is not None:
                        placement.stalled_s = alive_at - failed_at
                        failed_at = None
                    delivered.extend(step.token_id for step in chunk)
                    yield chunk
            except asyncio.CancelledError:
                if attempt.aborted is None or task is None:
                    raise
                task.uncancel()  # the watcher cut this attempt: its replica was taken down
                failure = ReplicaFailure(attempt.aborted, certain=True)
            except ReplicaFailure as err:
                failure = err
            finally:
                slot.inflight -= 1
                slot.attempts.discard(attempt)
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            # the replica failed this call: out of rotation (unless it is healthy), then retry
            if not failure.certain and await slot.replica.probe(self.health_timeout_s):
                raise EngineError(str(failure))  # the server is fine: the error is the call's
            self.take_down(slot, str(failure))
            tried.add(slot.index)
            if failed_at is None:
                failed_at = alive_at
            placement.failed.append(slot.replica.url)
            if delivered and placement.resumed_at == 0:
                placement.resumed_at = len(delivered)
            ended = delivered and delivered[-1] in request.stop_token_ids
            left = request.max_tokens - len(delivered)
            if ended or left <= 0:
                return  # the failed replica had sampled the whole completion
            attempt_request = dataclasses.replace(
                request,
                prompt_ids=[*request.prompt_ids, *delivered],
                max_tokens=left,
                placement=placement,
            )
            placement.reprefilled_tokens += len(attempt_request.prompt_ids)

    def _none_left(self, tried: set[int]) -> str:
        parts = [f"{s.replica.url} ({s.why or s.state})" for s in self.slots]
        return f"no {self.label} replica left: " + "; ".join(parts)

    def take_down(self, slot: Slot, why: str) -> None:
        """Take ``slot`` out of rotation and cut its calls in flight (they fail over)."""
        if slot.state == "down":
            return
        slot.state, slot.why, slot.strikes = "down", why, 0
        slot.down_since = time.monotonic()
        self._log(f"{self.label} replica {slot.replica.url} out of rotation: {why}")
        for attempt in list(slot.attempts):
            if attempt.aborted is None:
                attempt.aborted = why
                if attempt.waiting and attempt.task is not None:
                    attempt.task.cancel()

    def _log(self, line: str) -> None:
        self.events.append(line)
        print(f"legorl: {line}", file=sys.stderr, flush=True)

    # ---- weight sync -------------------------------------------------------------------------

    async def load_weights(self, path: str) -> int:
        def plan() -> _Sync:
            dropped = self.policy_adapter  # the full weights are the policy now

            async def step(replica: Replica) -> None:
                await replica.reload(path)
                await replica.reset_cache()  # cached K/V belong to the old weights
                if dropped is not None:
                    await replica.drop_adapter(dropped)

            def commit(synced: list[Slot]) -> None:
                self.policy_version += 1
                self._weights = str(path)
                if dropped is not None:
                    self.adapter_versions.pop(dropped, None)
                    self._adapter_paths.pop(dropped, None)
                    self.held_versions.pop(dropped, None)
                    self._held_paths.pop(dropped, None)
                    self.policy_adapter = None
                for slot in synced:
                    slot.version = self.policy_version

            return step, commit

        await self._everywhere(f"the weight sync to {path}", plan)
        return self.policy_version

    async def sync_adapter(self, name: str, path: str) -> int:
        """Load the adapter folder ``path`` as the next version of ``name`` on every live
        replica, with the ordering of ``load_weights``; ``name == POLICY_ADAPTER`` makes it the
        policy, its version the new policy version. Returns the version."""
        policy = name == POLICY_ADAPTER
        version = 0

        def plan() -> _Sync:
            nonlocal version  # taken under the lock: two loads of one name get two versions
            version = self.policy_version + 1 if policy else self.adapter_versions.get(name, 0) + 1

            async def step(replica: Replica) -> None:
                await replica.load_adapter(name, version, path, self.keep_versions)

            def commit(synced: list[Slot]) -> None:
                self.adapter_versions[name] = version
                self._adapter_paths[name] = str(path)
                held = [*self.held_versions.get(name, []), version][-self.keep_versions :]
                paths = self._held_paths.setdefault(name, {})
                paths[version] = str(path)
                self.held_versions[name] = held
                self._held_paths[name] = {v: paths[v] for v in held}
                if policy:
                    self.policy_version, self.policy_adapter = version, name
                    for slot in synced:
                        slot.version = version

            return step, commit

        await self._everywhere(f"loading adapter {name!r} from {path}", plan)
        return version

    async def _everywhere(self, what: str, plan: Callable[[], _Sync]) -> None:
        """Hold new calls at the gate, wait for every call in flight, run the plan's step on
        every live replica, then its commit on the replicas it reached, before the gate opens:
        no call sees the change before every live replica has it. A replica the step fails on
        is taken out of rotation; one that refuses it as the request's fault
        (``EngineRequestError``) is too, unless every replica refused: then that error is
        raised and nothing changed."""
        state = self._state()
        async with state.lock:
            state.gate.open.clear()  # new calls wait here
            try:
                t0 = time.monotonic()
                await state.gate.idle.wait()  # calls in flight finish under the old version
                self.last_drain_s = time.monotonic() - t0
                step, commit = plan()
                live = [s for s in self.slots if s.state == "up"]
                done = await asyncio.gather(
                    *(step(s.replica) for s in live), return_exceptions=True
                )
                failed = [
                    (s, r) for s, r in zip(live, done, strict=True) if isinstance(r, BaseException)
                ]
                if live and len(failed) == len(live):
                    refused = [r for _, r in failed if isinstance(r, EngineRequestError)]
                    if refused:
                        raise refused[0]
                for slot, result in failed:
                    self.take_down(slot, f"{what} failed: {result}")
                if len(failed) == len(live):
                    raise EngineError(
                        f"{what} reached no {self.label} replica: "
                        + "; ".join(f"{s.replica.url} ({s.why})" for s in self.slots)
                    )
                commit([s for s in live if all(s is not f for f, _ in failed)])
            finally:
                state.gate.open.set()

    # ---- the watcher: probes, relaunches, rejoins ---------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(s) for s in self.slots), return_exceptions=True)

    async def _check(self, slot: Slot) -> None:
        if slot.task is not None and not slot.task.done():
            return  # a relaunch or rejoin is under way
        replica = slot.replica
        if slot.state == "up":
            healthy = await replica.probe(self.health_timeout_s)
            if slot.state != "up":
                return
            if healthy:
                slot.strikes = 0
            elif healthy is False:
                self.take_down(slot, "its /health fails")
            else:
                slot.strikes += 1
                if slot.strikes >= _STRIKES:
                    self.take_down(
                        slot,
                        f"no answer to /health within {self.health_timeout_s:g} s, "
                        f"{_STRIKES} times in a row",
                    )
            return
        if replica.owned and not replica.alive():
            if self.relaunch and slot.relaunches < _RELAUNCHES:
                slot.relaunches += 1
                slot.task = asyncio.get_running_loop().create_task(self._relaunch(slot))
            return
        if await replica.probe(self.health_timeout_s):
            slot.task = asyncio.get_running_loop().create_task(self._rejoin(slot))

    async def _relaunch(self, slot: Slot) -> None:
        self._log(f"{self.label} replica {slot.replica.url}: relaunching it")
        try:
            await asyncio.to_thread(slot.replica.relaunch)
        except Exception as exc:  # said, and tried again later
            slot.why = f"relaunch failed: {exc}"
            self._log(f"{self.label} replica {slot.replica.url}: {slot.why}")
            return
        await self._rejoin(slot)

    async def _rejoin(self, slot: Slot) -> None:
        """Bring ``slot`` back: sync it to the current weights, reset its cache, then up."""
        state = self._state()
        async with state.lock:  # never beside a fleet weight sync
            if slot.state != "down":
                return
            slot.state = "joining"
            try:
                await slot.replica.check_serving()
                if self.can_reload:
                    if self._weights is not None:
                        await slot.replica.reload(self._weights)
                    await slot.replica.reset_cache()
                # what it may still hold from before it went out is dropped, then the current
                # versions of each adapter it holds loaded (from their folders again)
                await slot.replica.forget_adapters()
                for name in self.adapter_versions:
                    for v in self.held_versions[name]:
                        path = self._held_paths[name][v]
                        await slot.replica.load_adapter(name, v, path, self.keep_versions)
            except Exception as exc:  # it stays out, and says why
                slot.state, slot.why = "down", f"could not rejoin: {exc}"
                self._log(f"{self.label} replica {slot.replica.url}: {slot.why}")
                return
            slot.version = self.policy_version
            slot.state, slot.why, slot.strikes = "up", "", 0
            self._log(
                f"{self.label} replica {slot.replica.url} rejoined at policy version "
                f"{self.policy_version}"
            )

    def status(self) -> list[dict[str, object]]:
        """Each replica's URL, state, version, calls in flight and why it is out."""
        return [
            {
                "url": s.replica.url,
                "state": s.state,
                "version": s.version,
                "inflight": s.inflight,
                "sessions": s.sessions,
                "why": s.why,
            }
            for s in self.slots
        ]

    async def close(self) -> None:
        state, self._loop_state = self._loop_state, None
        if state is not None and state.loop is asyncio.get_running_loop():
            tasks = [state.watcher, *(s.task for s in self.slots)]
            for task in tasks:
                if task is not None:
                    task.cancel()
            for task in tasks:
                if task is not None:
                    with contextlib.suppress(BaseException):
                        await task
        for slot in self.slots:
            with contextlib.suppress(Exception):
                await slot.replica.aclose()
