"""The ``vllm`` engine: a client of a vLLM OpenAI-compatible server, token ids in and out.

    engine = make_engine("vllm", base_url="http://gpu-host:8000")   # needs only httpx
    engine = make_engine("vllm", model_path="fixtures/models/tiny-agent", python=".venv-vllm/bin/python")

vLLM itself is an optional extra (``pip install legorl[vllm]``) and runs elsewhere, e.g.

    VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt/policy --logprobs-mode processed_logprobs

or legorl launches it (no ``base_url``; see docs/vllm.md).

Each request is one ``POST /v1/completions`` with the prompt as a list of token ids and
``logprobs: 0`` (the sampled token's log-prob only), ``return_token_ids: true`` (the sampled ids
as integers) and ``return_tokens_as_token_ids: true`` (tokens as ``"token_id:N"`` strings, the
fallback when ``token_ids`` is absent), streamed as server-sent events, or answered in one
JSON body when the request's ``stream`` is False (the proxy's non-streamed calls: no event per
token to send and parse) or the config's ``stream`` is. Every sampling
knob that the server's ``generation_config`` defaults could otherwise set is sent explicitly
(``top_k: 0``, ``min_p: 0``, no penalties), and ``ignore_eos: true`` so that generation stops
only at the request's ``stop_token_ids`` (the stop token is returned, with its log-prob).

Which log-probs vLLM reports is a server setting, ``--logprobs-mode``:

* ``raw_logprobs`` (vLLM's default): ``log_softmax`` of the raw logits, before temperature,
  penalties and top-k/top-p. That equals legorl's contract, ``log_softmax(logits / T)`` before
  top-p, when T = 1 (any top-p), and greedy T = 0 (which legorl scores at T = 1).
* ``processed_logprobs``: after temperature *and* top-k/top-p (then renormalised), so it meets
  the contract when top_p = 1, at any T > 0 (vLLM raises T below 0.01 to 0.01: refused), and at
  T = 0 (greedy rows are divided by 1). A server legorl launches runs in this mode.

Set ``logprobs_mode`` here to what the server runs with; unset, it is read from the server's
``GET /server_info`` (dev mode), else taken as vLLM's default. A mode that contradicts the
server's refuses to start, and a request the server cannot score faithfully under its mode fails
with ``EngineError`` instead of recording wrong log-probs.

``max_context`` comes from the config, else from ``max_model_len`` in ``GET /v1/models``. The
client clamps ``max_tokens`` to the room left in the context (vLLM rejects a request whose prompt
plus ``max_tokens`` exceeds ``max_model_len``).

``load_weights(path)`` needs a server started with ``VLLM_SERVER_DEV_MODE=1`` and
``weight_reload="collective_rpc"`` here (both are so for a server legorl launches). The client
then stops sending new requests, waits for its own in-flight ones to finish, and calls the
development endpoints: ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs":
{"weights_path": path}}`` (the workers load the checkpoint at ``path`` in place and point their
model config at it), then ``POST /reset_prefix_cache`` (cached K/V belong to the old weights: a
session's next call would otherwise reuse its prefix computed under them). The checkpoint must
be a full model folder in the served model's layout, as ``legorl train`` writes it. Without dev
mode vLLM has no HTTP way to swap weights, and ``load_weights`` raises ``NotImplementedError``
saying so. Other clients of the same server are not drained: give the engine its own server.

LoRA adapters (``lora=true`` for a launched server: ``--enable-lora``, ``--max-loras``,
``--max-lora-rank`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``load_weights`` with a PEFT
adapter folder, or ``load_adapter(name, path)``, drains the engine's requests like a reload and
calls ``POST /v1/load_lora_adapter`` on every replica under a new name for every version
(``policy-v3``), then unloads the version before it. A new name is a new LoRA id in vLLM: it
reads the folder once, at that call (never ``load_inplace``, which re-reads it from disk on
every step: vLLM #33791), and no prefix-cache block computed under an earlier version can be
reused for it (a same-name reload can: vLLM #42125), so no prefix-cache reset is needed.
Requests then name that version as their ``model``. A replica that rejoins loads the current
versions from their folders again: keep them while one may rejoin. An adapter trained on
another base than the served model is refused, naming both. With ``keep_versions`` N > 1 each
replica keeps the last N versions of every adapter loaded and a request naming one of them
(``adapter_version``: the proxy pins an episode to its first call's version) samples with it;
``max_loras`` must be at least N (refused otherwise; the asynchronous loop sets N = K + 1 for
``--max-staleness K``). A request naming ``BASE_ADAPTER`` samples the served base model.

Without ``base_url`` legorl launches the server itself and stops it on ``close``
(``engines/vllm_server.py``).

**Replicas** (``engines/replicas.py``): ``base_url=URL1,URL2,…`` connects to several servers of
the same model, ``replicas=N`` launches N (each its own server process; with
``gpus_per_replica=K`` each gets K GPUs of ``devices`` or ``$CUDA_VISIBLE_DEVICES`` through its
own ``CUDA_VISIBLE_DEVICES``). Sessions stick to a replica, new ones go to the least loaded,
``load_weights`` reaches every replica before any call sees the new version, and a replica that
dies or stops answering is taken out of rotation while its calls go on elsewhere. A URL that
does not answer at start is named in one line; the engine starts if ``min_replicas`` (default:
all of them) still answer, and probes the others until they join.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
import orjson

from legorl.engines.adapters import (
    AdapterError,
    base_gone,
    check_base,
    is_adapter,
    read_adapter,
)
from legorl.engines.http1 import Http1Pool, supports
from legorl.engines.replicas import Fleet, ReplicaFailure
from legorl.engines.vllm_server import VllmServer
from legorl.protocols import (
    BASE_ADAPTER,
    POLICY_ADAPTER,
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineRequestError,
    GenerationRequest,
    TokenStep,
)

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
_VLLM_MIN_TEMPERATURE = 0.01  # vLLM's SamplingParams raises lower (non-zero) ones to this


@dataclass(slots=True, kw_only=True)
class VllmConfig:
    # None: legorl launches a server on model_path (engines/vllm_server.py) and stops it on close;
    # several servers (replicas of one model): URL1,URL2,…
    base_url: str | None = None
    model_path: str | None = None  # the model folder (the CLI's --model): what a launch serves
    model: str | None = None  # served model name; None: the first one /v1/models lists
    api_key: str | None = None
    max_context: int | None = None  # None: max_model_len from /v1/models
    stream: bool = True
    timeout_s: float = 600.0
    # what the server runs with (--logprobs-mode); None: raw_logprobs (vLLM's default) for a
    # server at base_url, processed_logprobs for one legorl launches
    logprobs_mode: LogprobsMode | None = None
    # see the module docstring; None: "none" at base_url, "collective_rpc" for a launched server
    weight_reload: Literal["none", "collective_rpc"] | None = None
    # ---- a launched server only (vllm_server.server_command says why each is set) ----
    python: str | None = None  # None: $LEGORL_VLLM_PYTHON, else python3 if it has vllm
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory: str = "1G"  # --kv-cache-memory-bytes; raise it on a GPU host
    enforce_eager: bool = True
    chunked_prefill: bool = False  # True only where seeded requests are not split (not on CPU)
    # LoRA adapters at run time (see the module docstring); the two limits are vLLM's own
    lora: bool = False
    max_loras: int = 2  # adapters (versions) one batch may mix
    # versions of each adapter kept loaded, the last ones, so that a request (an episode) that
    # names an earlier one finishes on it (engines/replicas.py); K + 1 for a loop K steps
    # off-policy, at most max_loras
    keep_versions: int = 1
    max_lora_rank: int = 16
    server_args: str = ""  # more vLLM flags, split like a shell line
    startup_timeout_s: float = 600.0
    log_path: str | None = None  # the server's log; None: a new temporary file
    # ---- replicas (engines/replicas.py) ----
    replicas: int = 1  # servers legorl launches (without base_url)
    min_replicas: int | None = None  # replicas that must answer at start; None: all of them
    gpus_per_replica: int = 0  # > 0: each launched replica gets its own CUDA_VISIBLE_DEVICES
    devices: str | None = None  # GPUs to share out (0,1,…); None: $CUDA_VISIBLE_DEVICES, else 0..
    relaunch: bool = True  # relaunch a launched replica that died (it rejoins after a sync)
    health_interval_s: float = 2.0  # how often every replica's /health is probed; 0: never
    health_timeout_s: float = 10.0  # a probe unanswered this long, twice: out of rotation


class VllmReplica:
    """One vLLM server of the engine: its URL, the process when legorl launched it, and the HTTP
    clients of the running event loop (the ``Replica`` transport of ``engines/replicas.py``)."""

    def __init__(self, config: VllmConfig, url: str, server: VllmServer | None = None) -> None:
        self.config = config
        self.url = url.rstrip("/")
        self.server = server
        self.owned = server is not None
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.model: str | None = config.model
        self.max_context: int | None = config.max_context
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._pool: Http1Pool | None = None
        self._closed = False
        self.loras: dict[str, str] = {}  # adapter -> the vLLM LoRA name of its version here
        self.held: dict[str, dict[int, str]] = {}  # adapter -> version -> LoRA name, held here

    # ---- start-up (blocking) ------------------------------------------------------------------

    def server_config(self, timeout: float) -> dict[str, Any] | None:
        """The server's ``vllm_config`` from ``GET /server_info`` (``{}`` when it does not
        parse); None when the server is not in dev mode (then only the config can say)."""
        url = f"{self.url}/server_info"
        try:
            response = httpx.get(
                url, params={"config_format": "json"}, headers=self.headers, timeout=timeout
            )
        except httpx.HTTPError:
            return None  # unreachable: describe says so
        if response.status_code != 200:
            return None
        try:
            found = response.json()["vllm_config"]
        except (ValueError, KeyError, TypeError):
            return {}
        return found if isinstance(found, dict) else {}

    def describe(self, model: str | None, max_context: int | None) -> tuple[str, int]:
        """The served model's name and context length from ``GET /v1/models`` (blocking)."""
        url = f"{self.url}/v1/models"
        try:
            response = httpx.get(url, headers=self.headers, timeout=self.config.timeout_s)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM server at {self.url} unreachable: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"GET {url}: {_error_message(response)}")
        cards = response.json().get("data") or []
        card = next((c for c in cards if model is None or c.get("id") == model), None)
        if card is None:
            listed = ", ".join(str(c.get("id")) for c in cards) or "none"
            raise EngineError(
                f"vLLM server at {self.url} serves no model {model!r} (it lists: {listed})"
            )
        if max_context is None:
            max_context = card.get("max_model_len")
            if not isinstance(max_context, int) or max_context <= 0:
                raise EngineError(
                    f"{url} gives no max_model_len for {card.get('id')!r}; set max_context"
                )
        return str(card["id"]), max_context

    async def check_serving(self) -> None:
        """A replica rejoining must serve the engine's model with its context length."""
        model, context = await asyncio.to_thread(self.describe, self.model, None)
        if self.config.max_context is None and context != self.max_context:
            raise EngineError(
                f"it serves {model!r} with max_model_len {context}, not {self.max_context}"
            )

    # ---- the event loop's clients -------------------------------------------------------------

    def _clients(self) -> tuple[httpx.AsyncClient, Http1Pool | None]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # an AsyncClient's connections belong to one loop; a new loop gets a new client
            self._client = httpx.AsyncClient(
                headers=self.headers,
                timeout=httpx.Timeout(self.config.timeout_s, connect=30.0),
            )
            self._client_loop = loop
            # non-streamed completions go through a lean client (engines/http1.py)
            self._pool = (
                Http1Pool(self.url, headers=self.headers, timeout_s=self.config.timeout_s)
                if supports(self.url)
                else None
            )
        return self._client, self._pool

    # ---- the Replica transport ----------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        body = _body(request, self.model or "", self.max_context or 0, self.config.stream)
        # the adapter's version on this replica (the policy's when the request names none);
        # read at the call, after the fleet's gate: a swap that held it back changed the name
        name = request.adapter or POLICY_ADAPTER
        lora = self.held.get(name, {}).get(request.adapter_version or 0) or self.loras.get(name)
        if lora is not None:
            body["model"] = lora
        client, pool = self._clients()
        url = f"{self.url}/v1/completions"
        prompt_len = len(request.prompt_ids)
        try:
            if not body["stream"] and pool is not None:
                status, answer = await pool.post("/v1/completions", orjson.dumps(body))
                if status != 200:
                    raise self._status_error(status, _body_message(answer), prompt_len)
                steps = self._steps(orjson.loads(answer))
                if steps:
                    yield steps
            elif body["stream"]:
                async with client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise self._http_error(response, prompt_len)
                    done = False
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        steps = self._steps(orjson.loads(data))
                        if steps:
                            yield steps
                    if not done:  # the connection closed mid-stream: the server went away
                        raise ReplicaFailure(
                            f"vLLM at {self.url} closed the stream before its end", certain=True
                        )
            else:
                response = await client.post(url, json=body)
                if response.status_code != 200:
                    raise self._http_error(response, prompt_len)
                steps = self._steps(orjson.loads(response.content))
                if steps:
                    yield steps
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            raise ReplicaFailure(f"vLLM request to {url} failed: {exc!r}", certain=True) from exc

    def _steps(self, payload: dict[str, Any]) -> list[TokenStep]:
        try:
            return _steps_of(payload)
        except _ServerEnded as exc:  # an aborted or failed request: the server may be ending
            raise ReplicaFailure(f"vLLM at {self.url}: {exc}", certain=False) from None

    def _http_error(self, response: httpx.Response, prompt_len: int) -> EngineError:
        return self._status_error(response.status_code, _error_message(response), prompt_len)

    def _status_error(self, status: int, message: str, prompt_len: int) -> EngineError:
        lowered = message.lower()
        if status == 400 and ("context length" in lowered or "max_model_len" in lowered):
            return ContextLengthError(prompt_len, self.max_context or 0)
        if status in (400, 413, 422):  # what the request asked, refused
            return EngineRequestError(f"vLLM answered {status}: {message}")
        # the server's own failure (or a proxy's before it): its /health decides
        return ReplicaFailure(f"vLLM at {self.url} answered {status}: {message}", certain=False)

    async def probe(self, timeout: float) -> bool | None:
        client, _ = self._clients()
        try:
            response = await client.get(f"{self.url}/health", timeout=timeout)
        except httpx.TimeoutException:
            return None
        except (httpx.HTTPError, OSError):
            return False
        return response.status_code == 200

    async def reload(self, path: str) -> None:
        # the workers load the checkpoint at path in place (and serve from it after)
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self._post("/collective_rpc", reload)

    async def reset_cache(self) -> None:
        await self._post("/reset_prefix_cache", None)

    async def load_adapter(self, name: str, version: int, path: str, keep: int = 1) -> None:
        lora_name = f"{name}-v{version}"
        await self._post_lora("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": path})
        self.loras[name] = lora_name
        held = self.held.setdefault(name, {})
        held[version] = lora_name
        for old in sorted(held)[:-keep]:  # older than the last ``keep``: no request names them
            await self._unload_lora(held.pop(old))

    async def drop_adapter(self, name: str) -> None:
        self.loras.pop(name, None)
        for lora_name in self.held.pop(name, {}).values():
            await self._unload_lora(lora_name)

    async def forget_adapters(self) -> None:
        names = {n for held in self.held.values() for n in held.values()}
        names |= set(self.loras.values())
        self.loras, self.held = {}, {}
        for lora_name in sorted(names):  # a relaunched server holds none of them: no answer is fine
            await self._unload_lora(lora_name)

    async def _post_lora(self, path: str, body: Any) -> None:
        client, _ = self._clients()
        url = f"{self.url}{path}"
        try:
            response = await client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {url} failed: {exc}") from exc
        if response.status_code == 200:
            return
        message = _error_message(response)
        if response.status_code == 404 or "lora is not enabled" in message.lower():
            raise EngineRequestError(
                f"the vLLM server at {self.url} has no runtime LoRA loading (POST {path}: "
                f"{response.status_code} {message}): start it with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (a launched server: lora=true)"
            )
        if response.status_code in (400, 422):  # the adapter refused, not the server failing
            raise EngineRequestError(f"POST {url}: {message}")
        raise EngineError(f"POST {url}: {message}")

    async def _unload_lora(self, lora_name: str) -> None:
        """Drop a superseded version from the server's list (it has no request left)."""
        with contextlib.suppress(EngineError):
            await self._post_lora("/v1/unload_lora_adapter", {"lora_name": lora_name})

    async def _post(self, path: str, body: Any) -> None:
        client, _ = self._clients()
        url = f"{self.url}{path}"
        try:
            response = (
                await client.post(url, json=body) if body is not None else await client.post(url)
            )
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {url} failed: {exc}") from exc
        if response.status_code != 200:
            hint = (
                " (is the server running with VLLM_SERVER_DEV_MODE=1?)"
                if response.status_code == 404
                else ""
            )
            raise EngineError(f"POST {url}: {_error_message(response)}{hint}")

    def alive(self) -> bool:
        return self.server is None or self.server.alive()

    def relaunch(self) -> None:
        """Start the legorl-owned server again, on its old port if it is free (blocking)."""
        if self.server is None or self._closed:
            return
        self.server.stop()
        url = self.server.start(port=self.server.port)
        if self._closed:  # the engine closed while this one started
            self.server.stop()
            return
        self.url = url

    async def aclose(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        pool, self._pool = self._pool, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            await client.aclose()
            if pool is not None:
                await pool.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    def stop_server(self) -> None:
        self._closed = True
        if self.server is not None:
            self.server.stop()


class VllmEngine(Fleet):
    """vLLM servers behind the Engine protocol; see the module docstring."""

    name = "vllm"
    config_class: ClassVar[type] = VllmConfig
    label = "vLLM"

    def __init__(self, config: VllmConfig) -> None:
        urls = _urls(config.base_url)
        if urls and config.replicas != 1:
            raise ConfigError(
                f"replicas={config.replicas} launches servers: give it without base_url, or "
                f"list the servers in base_url (it names {len(urls)})"
            )
        if config.replicas < 1:
            raise ConfigError(f"replicas: must be >= 1, got {config.replicas}")
        if config.keep_versions < 1:
            raise ConfigError(f"keep_versions: must be >= 1, got {config.keep_versions}")
        if config.lora and config.keep_versions > config.max_loras:
            raise ConfigError(
                f"max_loras={config.max_loras} is fewer than the keep_versions="
                f"{config.keep_versions} adapter versions requests may sample with at once: "
                f"give max_loras >= {config.keep_versions}"
            )
        wanted = len(urls) if urls else config.replicas
        least = wanted if config.min_replicas is None else config.min_replicas
        if not 1 <= least <= wanted:
            raise ConfigError(f"min_replicas: must be between 1 and {wanted}, got {least}")
        if urls:
            replicas = [VllmReplica(config, url) for url in urls]
            answers = _each(replicas, lambda r: _connect(r, config))
        else:
            config = dataclasses.replace(
                config,
                logprobs_mode=config.logprobs_mode or "processed_logprobs",
                weight_reload=config.weight_reload or "collective_rpc",
            )
            replicas = [VllmReplica(config, "", s) for s in _servers(config, wanted)]
            answers = _each(replicas, lambda r: _launch(r, config))
        up = [not isinstance(a, BaseException) for a in answers]
        try:
            config, model, max_context = self._settle(config, replicas, answers, least)
        except BaseException:
            for replica in replicas:
                replica.stop_server()
            raise
        for replica in replicas:
            replica.config, replica.model, replica.max_context = config, model, max_context
        self.config = config
        self.model = model
        self.max_context = max_context
        super().__init__(
            list(replicas),
            up=up,
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            relaunch=config.relaunch,
            can_reload=config.weight_reload == "collective_rpc",
            keep_versions=config.keep_versions,
        )
        self.replicas = replicas

    @staticmethod
    def _settle(
        config: VllmConfig,
        replicas: list[VllmReplica],
        answers: list[Any],
        least: int,
    ) -> tuple[VllmConfig, str, int]:
        """The config, model and context all answering replicas agree on; the ones that did not
        answer named in one line each; ``EngineError`` if fewer than ``least`` answered."""
        good = [
            (r, a)
            for r, a in zip(replicas, answers, strict=True)
            if not isinstance(a, BaseException)
        ]
        bad = [
            (r, a) for r, a in zip(replicas, answers, strict=True) if isinstance(a, BaseException)
        ]
        if len(good) < least:
            if len(replicas) == 1:
                raise answers[0]
            named = "; ".join(f"{r.url or 'a launched replica'}: {a}" for r, a in bad)
            raise EngineError(
                f"{len(good)} of {len(replicas)} vLLM replicas answer, min_replicas={least}: "
                f"{named}"
            )
        for replica, err in bad:
            print(
                f"legorl: vLLM replica {replica.url or '(launch)'} does not answer, going on "
                f"with {len(good)} of {len(replicas)} (min_replicas={least}): {err}",
                file=sys.stderr,
                flush=True,
            )
        first, (settled, model, max_context) = good[0]
        for replica, (other, their_model, their_context) in good[1:]:
            seen = (other.logprobs_mode, other.weight_reload, their_model, their_context)
            if seen != (settled.logprobs_mode, settled.weight_reload, model, max_context):
                raise EngineError(
                    f"the vLLM replicas differ: {first.url} serves {model!r} (max_model_len "
                    f"{max_context}, {settled.logprobs_mode}, reload {settled.weight_reload}), "
                    f"{replica.url} serves {their_model!r} (max_model_len {their_context}, "
                    f"{other.logprobs_mode}, reload {other.weight_reload}): give one model's "
                    "servers, started alike"
                )
        return settled, model, max_context

    # ---- what one server was (the bench and tests read these) ----------------------------------

    @property
    def base_url(self) -> str:
        return self.replicas[0].url

    @property
    def server(self) -> VllmServer | None:
        return self.replicas[0].server

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        return _body(request, self.model, self.max_context, self.config.stream)

    # ---------------------------------------------------------------------------------------

    def admit(self, request: GenerationRequest) -> None:
        prompt = request.prompt_ids
        if not prompt:
            raise EngineRequestError("empty prompt: at least one token is needed")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(len(prompt), self.max_context)
        self._check_logprob_semantics(request)
        adapter = request.adapter
        if adapter == BASE_ADAPTER and self._weights is not None:
            raise EngineRequestError(base_gone(self.policy_version))
        if adapter not in (None, BASE_ADAPTER) and adapter not in self.adapter_versions:
            loaded = ", ".join(sorted(self.adapter_versions)) or "none"
            raise EngineRequestError(f"adapter {adapter!r} is not loaded (loaded: {loaded})")

    def _check_logprob_semantics(self, request: GenerationRequest) -> None:
        t, top_p, mode = request.temperature, request.top_p, self.config.logprobs_mode
        if mode == "raw_logprobs" and t not in (0.0, 1.0):
            raise EngineRequestError(
                f"vLLM --logprobs-mode raw_logprobs reports log-probs at temperature 1; a "
                f"request at temperature {t} needs a server with --logprobs-mode "
                "processed_logprobs (and top_p = 1), and logprobs_mode set to match"
            )
        # greedy (T = 0) rows are scored at T = 1 in either mode: vLLM divides them by 1
        if mode == "processed_logprobs" and t != 0.0 and top_p < 1.0:
            raise EngineRequestError(
                "vLLM --logprobs-mode processed_logprobs reports log-probs after top-p "
                f"(renormalised); top_p {top_p} at temperature {t} cannot be scored faithfully: "
                "use top_p = 1, or a raw_logprobs server at temperature 1"
            )
        if mode == "processed_logprobs" and 0.0 < t < _VLLM_MIN_TEMPERATURE:
            raise EngineRequestError(
                f"vLLM raises temperatures below {_VLLM_MIN_TEMPERATURE} to it, so the "
                f"log-probs of temperature {t} would not be the ones sampled: use temperature 0 "
                f"(greedy) or >= {_VLLM_MIN_TEMPERATURE}"
            )

    async def load_weights(self, path: str) -> int:
        if is_adapter(path):
            return await self._load_lora(POLICY_ADAPTER, path)
        if self.config.weight_reload == "none":
            raise NotImplementedError(
                "vLLM swaps weights over HTTP only through its development endpoints: start the "
                "server with VLLM_SERVER_DEV_MODE=1 and make this engine with "
                'weight_reload="collective_rpc" (or restart the server on the new checkpoint)'
            )
        return await super().load_weights(path)

    async def load_adapter(self, name: str, path: str) -> int:
        return await self._load_lora(name, path)

    async def _load_lora(self, name: str, path: str) -> int:
        """Load the adapter folder ``path`` as the next version of ``name`` on every replica."""
        launched = any(r.owned for r in self.replicas)
        if launched and not self.config.lora:
            raise EngineRequestError(
                "this vLLM server was launched without LoRA support, but an adapter was asked "
                f"for ({path}): make the engine with lora=true (--engine-opt lora=true)"
            )
        try:
            info = read_adapter(path)
            if self.config.model_path is not None:
                check_base(info, self.config.model_path)
            elif info.base.name != Path(self.model).name:
                raise AdapterError(
                    f"adapter {info.path} was trained on base model {info.base}, but the vLLM "
                    f"server serves {self.model!r}"
                )
        except AdapterError as exc:
            raise EngineRequestError(str(exc)) from None
        if launched and info.rank > self.config.max_lora_rank:
            raise EngineRequestError(
                f"adapter {info.path} has rank {info.rank}; the server takes at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        return await self.sync_adapter(name, str(info.path))


def _urls(base_url: str | None) -> list[str]:
    if base_url is None:
        return []
    urls = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()]
    if not urls:
        raise ConfigError(f"base_url: no server URL in {base_url!r}")
    return urls


def _each(replicas: list[VllmReplica], start: Any) -> list[Any]:
    """``start(replica)`` for every replica at once (threads): its answer or its exception."""
    if len(replicas) == 1:
        try:
            return [start(replicas[0])]
        except Exception as exc:  # returned, and raised by _settle
            return [exc]
    with concurrent.futures.ThreadPoolExecutor(len(replicas)) as pool:
        futures = [pool.submit(start, r) for r in replicas]
        answers: list[Any] = []
        for future in futures:
            try:
                answers.append(future.result())
            except Exception as exc:
                answers.append(exc)
        return answers


def _connect(replica: VllmReplica, config: VllmConfig) -> tuple[VllmConfig, str, int]:
    settled = _settle_modes(replica, config)
    model, max_context = config.model, config.max_context
    if model is None or max_context is None:
        model, max_context = replica.describe(model, max_context)
    return settled, model, max_context


def _launch(replica: VllmReplica, config: VllmConfig) -> tuple[VllmConfig, str, int]:
    assert replica.server is not None
    replica.url = replica.server.start()
    model, max_context = config.model, config.max_context
    if model is None or max_context is None:
        model, max_context = replica.describe(model, max_context)
    return config, model, max_context


def _settle_modes(replica: VllmReplica, config: VllmConfig) -> VllmConfig:
    """The log-prob mode and reload path of the server at ``replica.url``: what its
    ``/server_info`` says (dev mode), checked against what the config claims; with ``lora``,
    its LoRA support and ``--max-loras`` against the adapter versions requests may use."""
    found = replica.server_config(config.timeout_s)
    dev = found is not None
    mode: str | None = None
    with contextlib.suppress(KeyError, TypeError):
        mode = str((found or {})["model_config"]["logprobs_mode"])
    claimed = config.logprobs_mode
    if mode is not None and mode not in ("raw_logprobs", "processed_logprobs"):
        raise EngineError(
            f"the vLLM server at {replica.url} runs --logprobs-mode {mode}: legorl needs "
            "raw_logprobs or processed_logprobs (the log-probs of the sampled tokens)"
        )
    if mode is not None and claimed is not None and claimed != mode:
        raise EngineError(
            f"the vLLM server at {replica.url} runs --logprobs-mode {mode}, but "
            f"logprobs_mode={claimed} was given: its log-probs would be read wrongly; drop "
            "logprobs_mode (it is read from the server) or restart the server to match"
        )
    if config.lora and found and "lora_config" in found:
        _check_lora(replica.url, found["lora_config"], config.keep_versions)
    reload = config.weight_reload or ("collective_rpc" if dev else "none")
    settled: LogprobsMode = claimed or (
        "processed_logprobs" if mode == "processed_logprobs" else "raw_logprobs"
    )
    return dataclasses.replace(config, logprobs_mode=settled, weight_reload=reload)


def _check_lora(url: str, lora_config: Any, versions: int) -> None:
    """A server at ``base_url`` must serve adapters, ``versions`` of them at once."""
    if not isinstance(lora_config, dict):
        raise EngineError(
            f"the vLLM server at {url} was started without --enable-lora, but lora=true asks "
            f"for adapters: restart it with --enable-lora --max-loras {versions} (and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
        )
    most = lora_config.get("max_loras")
    if isinstance(most, int) and most < versions:
        raise EngineError(
            f"the vLLM server at {url} runs --max-loras {most}, fewer than the {versions} "
            "adapter versions requests may sample with at once (keep_versions; the "
            "asynchronous loop keeps K + 1): restart it with --max-loras >= "
            f"{versions}, or lower the staleness bound"
        )


def _servers(config: VllmConfig, n: int) -> list[VllmServer]:
    """The ``n`` servers to launch, each with its log and its GPUs (``replica_devices``)."""
    devices = replica_devices(n, config.gpus_per_replica, config.devices)
    servers = []
    for i in range(n):
        log = config.log_path
        if log is not None and i > 0:
            path = Path(log)
            log = str(path.with_name(f"{path.stem}.{i}{path.suffix}"))
        servers.append(VllmServer(dataclasses.replace(config, log_path=log), devices=devices[i]))
    return servers


def replica_devices(n: int, per_replica: int, devices: str | None) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``n`` launched replicas: ``per_replica`` GPUs
    each, in order, from ``devices`` (else ``$CUDA_VISIBLE_DEVICES``, else 0, 1, …); None for
    all when ``per_replica`` is 0 (CPU, or one replica that sees what legorl sees)."""
    if per_replica < 0:
        raise ConfigError(f"gpus_per_replica: must be >= 0, got {per_replica}")
    if per_replica == 0:
        return [None] * n
    listed = devices if devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in listed.split(",") if d.strip()]
        if listed is not None
        else [str(i) for i in range(n * per_replica)]
    )
    if len(ids) < n * per_replica:
        raise ConfigError(
            f"gpus_per_replica={per_replica} x replicas={n} needs {n * per_replica} GPUs, but "
            f"only {len(ids)} are given ({','.join(ids) or 'none'}; devices= or "
            "$CUDA_VISIBLE_DEVICES)"
        )
    return [",".join(ids[i * per_replica : (i + 1) * per_replica]) for i in range(n)]


def _body(request: GenerationRequest, model: str, max_context: int, stream: bool) -> dict[str, Any]:
    room = max_context - len(request.prompt_ids)
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": min(request.max_tokens, room),
        "temperature": request.temperature,
        "top_p": request.top_p,
        # explicit, so the server's generation_config defaults cannot change the sampler
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "stop_token_ids": list(request.stop_token_ids),
        "ignore_eos": True,  # stop only where the request says
        "skip_special_tokens": False,
        "logprobs": 0,  # the sampled token's log-prob, no alternatives
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        # a caller that waits for the whole completion gets it in one answer: one JSON
        # body instead of an event per token, for the server and for this client
        "stream": stream and request.stream,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    return body


class _ServerEnded(EngineError):
    """vLLM ended a request with an error or an abort (the server may be going down)."""


def _steps_of(payload: dict[str, Any]) -> list[TokenStep]:
    """The sampled tokens and log-probs in one completion response or stream chunk."""
    if "error" in payload:
        raise _ServerEnded(f"vLLM stream error: {_message_of(payload)}")
    choices = payload.get("choices") or []
    if not choices:
        return []  # e.g. the closing usage chunk
    choice = choices[0]
    if choice.get("finish_reason") in ("abort", "error"):
        raise _ServerEnded(f"vLLM ended the request with finish_reason {choice['finish_reason']!r}")
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(t) for t in logprobs.get("tokens") or []]
    if len(ids) != len(values) or any(v is None for v in values):
        raise EngineError(
            f"vLLM returned {len(ids)} token ids but {len(values)} log-probs; is logprobs "
            "honoured by this server?"
        )
    return [TokenStep(int(t), float(v)) for t, v in zip(ids, values, strict=True)]


def _token_id(token: str) -> int:
    prefix = "token_id:"
    if not token.startswith(prefix):
        raise EngineError(
            f"vLLM returned token {token!r}, not 'token_id:N': the server ignores "
            "return_tokens_as_token_ids"
        )
    return int(token[len(prefix) :])


def _message_of(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(payload)


def _body_message(data: bytes) -> str:
    try:
        return _message_of(orjson.loads(data))
    except orjson.JSONDecodeError:
        return data[:500].decode("utf-8", "replace") or "(empty answer)"


def _error_message(response: httpx.Response) -> str:
    try:
        return _message_of(response.json())
    except (json.JSONDecodeError, ValueError):
        return response.text[:500] or response.reason_phrase
