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
adapter folder, or ``load_adapter(name, path)``, drains the client's requests like a reload and
calls ``POST /v1/load_lora_adapter`` under a new name for every version (``policy-v3``), then
unloads the version before it. A new name is a new LoRA id in vLLM: it reads the folder once,
at that call (never ``load_inplace``, which re-reads it from disk on every step: vLLM #33791),
and no prefix-cache block computed under an earlier version can be reused for it (a same-name
reload can: vLLM #42125), so no prefix-cache reset is needed. Requests then name that version as
their ``model``. An adapter trained on another base than the served model is refused, naming
both; ``max_loras`` must cover the versions in flight at once (1 per adapter when each swap
drains, as here; K + 1 for a loop K steps off-policy).

Without ``base_url`` legorl launches the server itself and stops it on ``close``
(``engines/vllm_server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
import orjson

from legorl.engines.adapters import AdapterError, check_base, is_adapter, read_adapter
from legorl.engines.http1 import Http1Pool, supports
from legorl.engines.vllm_server import VllmServer
from legorl.protocols import (
    POLICY_ADAPTER,
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
    # None: legorl launches a server on model_path (engines/vllm_server.py) and stops it on close
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
    max_lora_rank: int = 16
    server_args: str = ""  # more vLLM flags, split like a shell line
    startup_timeout_s: float = 600.0
    log_path: str | None = None  # the server's log; None: a new temporary file


class _Gate:
    """Lets requests through unless a weight reload holds it shut, and counts them."""

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


class VllmEngine:
    """A vLLM server behind the Engine protocol; see the module docstring."""

    name = "vllm"
    config_class: ClassVar[type] = VllmConfig

    def __init__(self, config: VllmConfig) -> None:
        self.server: VllmServer | None = None
        if config.base_url is None:
            config = dataclasses.replace(
                config,
                logprobs_mode=config.logprobs_mode or "processed_logprobs",
                weight_reload=config.weight_reload or "collective_rpc",
            )
            self.server = VllmServer(config)
            base_url = self.server.start()
        else:
            base_url = config.base_url
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        if self.server is None:
            config = self._settle_modes(config)
        self.config = config
        self.policy_version = 0
        self.policy_adapter: str | None = None
        self.adapter_versions: dict[str, int] = {}
        self._lora_names: dict[str, str] = {}  # adapter -> the vLLM LoRA name of its version
        model, max_context = config.model, config.max_context
        try:
            if model is None or max_context is None:
                model, max_context = self._describe_server(model, max_context)
        except BaseException:
            self._stop_server()
            raise
        self.model = model
        self.max_context = max_context
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._pool: Http1Pool | None = None
        self._gate: _Gate | None = None
        self._reload_lock: asyncio.Lock | None = None

    def _settle_modes(self, config: VllmConfig) -> VllmConfig:
        """The log-prob mode and reload path of the server at ``base_url``: what its
        ``/server_info`` says (dev mode), checked against what the config claims."""
        mode, dev = self._server_logprobs_mode(config.timeout_s)
        claimed = config.logprobs_mode
        if mode is not None and mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineError(
                f"the vLLM server at {self.base_url} runs --logprobs-mode {mode}: legorl needs "
                "raw_logprobs or processed_logprobs (the log-probs of the sampled tokens)"
            )
        if mode is not None and claimed is not None and claimed != mode:
            raise EngineError(
                f"the vLLM server at {self.base_url} runs --logprobs-mode {mode}, but "
                f"logprobs_mode={claimed} was given: its log-probs would be read wrongly; drop "
                "logprobs_mode (it is read from the server) or restart the server to match"
            )
        reload = config.weight_reload or ("collective_rpc" if dev else "none")
        settled: LogprobsMode = claimed or (
            "processed_logprobs" if mode == "processed_logprobs" else "raw_logprobs"
        )
        return dataclasses.replace(config, logprobs_mode=settled, weight_reload=reload)

    def _server_logprobs_mode(self, timeout: float) -> tuple[str | None, bool]:
        """``(--logprobs-mode, dev mode)`` from ``GET /server_info``; ``(None, False)`` when the
        server is not in dev mode (then only the config can say)."""
        url = f"{self.base_url}/server_info"
        try:
            response = httpx.get(
                url,
                params={"config_format": "json"},
                headers=self._headers,
                timeout=timeout,
            )
        except httpx.HTTPError:
            return None, False  # unreachable: _describe_server says so
        if response.status_code != 200:
            return None, False
        try:
            model_config = response.json()["vllm_config"]["model_config"]
            return str(model_config["logprobs_mode"]), True
        except (ValueError, KeyError, TypeError):
            return None, True

    def _describe_server(self, model: str | None, max_context: int | None) -> tuple[str, int]:
        """The served model's name and context length from ``GET /v1/models`` (blocking)."""
        url = f"{self.base_url}/v1/models"
        try:
            response = httpx.get(url, headers=self._headers, timeout=self.config.timeout_s)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM server at {self.base_url} unreachable: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"GET {url}: {_error_message(response)}")
        cards = response.json().get("data") or []
        card = next((c for c in cards if model is None or c.get("id") == model), None)
        if card is None:
            listed = ", ".join(str(c.get("id")) for c in cards) or "none"
            raise EngineError(f"vLLM server serves no model {model!r} (it lists: {listed})")
        if max_context is None:
            max_context = card.get("max_model_len")
            if not isinstance(max_context, int) or max_context <= 0:
                raise EngineError(
                    f"{url} gives no max_model_len for {card.get('id')!r}; set max_context"
                )
        return str(card["id"]), max_context

    # ---------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        prompt = request.prompt_ids
        if not prompt:
            raise EngineRequestError("empty prompt: at least one token is needed")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(len(prompt), self.max_context)
        self._check_logprob_semantics(request)
        adapter = request.adapter
        if adapter is not None and adapter not in self.adapter_versions:
            loaded = ", ".join(sorted(self.adapter_versions)) or "none"
            raise EngineRequestError(f"adapter {adapter!r} is not loaded (loaded: {loaded})")
        client, gate = self._session()
        body = self._body(request)
        url = f"{self.base_url}/v1/completions"
        await gate.enter()
        # after the gate: a swap that held this request back changed the served version
        body["model"] = self._lora_names.get(adapter or self.policy_adapter or "", self.model)
        try:
            if not body["stream"] and self._pool is not None:
                status, answer = await self._pool.post("/v1/completions", orjson.dumps(body))
                if status != 200:
                    raise self._status_error(status, _body_message(answer), len(prompt))
                steps = _steps_of(orjson.loads(answer))
                if steps:
                    yield steps
            elif body["stream"]:
                async with client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise self._http_error(response, len(prompt))
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        steps = _steps_of(orjson.loads(data))
                        if steps:
                            yield steps
            else:
                response = await client.post(url, json=body)
                if response.status_code != 200:
                    raise self._http_error(response, len(prompt))
                steps = _steps_of(orjson.loads(response.content))
                if steps:
                    yield steps
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            raise EngineError(f"vLLM request to {url} failed: {exc!r}") from exc
        finally:
            gate.leave()

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        room = self.max_context - len(request.prompt_ids)
        body: dict[str, Any] = {
            "model": self.model,
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
            "stream": self.config.stream and request.stream,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        return body

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

    def _http_error(self, response: httpx.Response, prompt_len: int) -> EngineError:
        return self._status_error(response.status_code, _error_message(response), prompt_len)

    def _status_error(self, status: int, message: str, prompt_len: int) -> EngineError:
        lowered = message.lower()
        if status == 400 and ("context length" in lowered or "max_model_len" in lowered):
            return ContextLengthError(prompt_len, self.max_context)
        if status in (400, 413, 422):  # what the request asked, refused
            return EngineRequestError(f"vLLM answered {status}: {message}")
        return EngineError(f"vLLM answered {status}: {message}")

    def _session(self) -> tuple[httpx.AsyncClient, _Gate]:
        """The HTTP client and request gate of the running event loop (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # an AsyncClient's connections belong to one loop; a new loop gets a new client
            self._client = httpx.AsyncClient(
                headers=self._headers,
                timeout=httpx.Timeout(self.config.timeout_s, connect=30.0),
            )
            self._client_loop = loop
            # non-streamed completions go through a lean client (engines/http1.py)
            self._pool = (
                Http1Pool(self.base_url, headers=self._headers, timeout_s=self.config.timeout_s)
                if supports(self.base_url)
                else None
            )
            self._gate = _Gate()
            self._reload_lock = asyncio.Lock()
        assert self._gate is not None
        return self._client, self._gate

    # ---------------------------------------------------------------------------------------

    async def load_weights(self, path: str) -> int:
        if is_adapter(path):
            await self._load_lora(POLICY_ADAPTER, path)
            return self.policy_version
        if self.config.weight_reload == "none":
            raise NotImplementedError(
                "vLLM swaps weights over HTTP only through its development endpoints: start the "
                "server with VLLM_SERVER_DEV_MODE=1 and make this engine with "
                'weight_reload="collective_rpc" (or restart the server on the new checkpoint)'
            )
        client, gate = self._session()
        assert self._reload_lock is not None
        async with self._reload_lock:
            gate.open.clear()  # new requests wait here
            try:
                await gate.idle.wait()  # requests in flight finish under the old weights
                # the workers load the checkpoint at path in place (and serve from it after)
                reload = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                await self._post(client, "/collective_rpc", reload)
                await self._post(client, "/reset_prefix_cache", None)
                self.policy_version += 1
                self.policy_adapter = None  # the full weights are the policy now
                self.adapter_versions.pop(POLICY_ADAPTER, None)
                old = self._lora_names.pop(POLICY_ADAPTER, None)
                if old is not None:
                    await self._unload_lora(client, old)
            finally:
                gate.open.set()
        return self.policy_version

    async def load_adapter(self, name: str, path: str) -> int:
        return await self._load_lora(name, path)

    async def _load_lora(self, name: str, path: str) -> int:
        """Load the adapter folder ``path`` as the next version of ``name``."""
        if self.server is not None and not self.config.lora:
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
        if self.server is not None and info.rank > self.config.max_lora_rank:
            raise EngineRequestError(
                f"adapter {info.path} has rank {info.rank}; the server takes at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        client, gate = self._session()
        assert self._reload_lock is not None
        async with self._reload_lock:
            gate.open.clear()
            try:
                await gate.idle.wait()
                version = (
                    self.policy_version + 1
                    if name == POLICY_ADAPTER
                    else self.adapter_versions.get(name, 0) + 1
                )
                lora_name = f"{name}-v{version}"
                body = {"lora_name": lora_name, "lora_path": str(info.path)}
                await self._post_lora(client, "/v1/load_lora_adapter", body)
                old = self._lora_names.get(name)
                self._lora_names[name] = lora_name
                self.adapter_versions[name] = version
                if name == POLICY_ADAPTER:
                    self.policy_version = version
                    self.policy_adapter = POLICY_ADAPTER
                if old is not None:
                    await self._unload_lora(client, old)
            finally:
                gate.open.set()
        return version

    async def _post_lora(self, client: httpx.AsyncClient, path: str, body: Any) -> None:
        url = f"{self.base_url}{path}"
        try:
            response = await client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {url} failed: {exc}") from exc
        if response.status_code == 200:
            return
        message = _error_message(response)
        if response.status_code == 404 or "lora is not enabled" in message.lower():
            raise EngineRequestError(
                f"the vLLM server at {self.base_url} has no runtime LoRA loading (POST {path}: "
                f"{response.status_code} {message}): start it with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (a launched server: lora=true)"
            )
        raise EngineError(f"POST {url}: {message}")

    async def _unload_lora(self, client: httpx.AsyncClient, lora_name: str) -> None:
        """Drop a superseded version from the server's list (it has no request left)."""
        with contextlib.suppress(EngineError):
            await self._post_lora(client, "/v1/unload_lora_adapter", {"lora_name": lora_name})

    async def _post(self, client: httpx.AsyncClient, path: str, body: Any) -> None:
        url = f"{self.base_url}{path}"
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

    async def close(self) -> None:
        client, self._client = self._client, None
        pool, self._pool = self._pool, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            await client.aclose()
            if pool is not None:
                await pool.close()
        if self.server is not None:
            await asyncio.to_thread(self._stop_server)

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()


def _steps_of(payload: dict[str, Any]) -> list[TokenStep]:
    """The sampled tokens and log-probs in one completion response or stream chunk."""
    if "error" in payload:
        raise EngineError(f"vLLM stream error: {_message_of(payload)}")
    choices = payload.get("choices") or []
    if not choices:
        return []  # e.g. the closing usage chunk
    choice = choices[0]
    if choice.get("finish_reason") in ("abort", "error"):
        raise EngineError(f"vLLM ended the request with finish_reason {choice['finish_reason']!r}")
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
