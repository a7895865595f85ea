"""The engine, the proxy's API shapes and the rollout/trainer fidelity (async: they share one
engine), and vLLM's own preconditions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from legorl.check.config import RunConfig
from legorl.check.model import _TOOLS
from legorl.check.results import CheckResult, _fail, _pass, _short, _skip

# --------------------------------------------------------------------------------------------
# Engine, proxy, fidelity (async: they share one engine)
# --------------------------------------------------------------------------------------------


def _engine_options(config: RunConfig) -> dict[str, Any]:
    opts = dict(config.engine_options)
    if config.engine in ("embedded", "forced", "vllm"):
        opts.setdefault("model_path", config.model)
    if config.engine == "vllm" and "base_url" not in opts:
        opts.setdefault("log_path", str(Path(config.workdir) / "check-vllm-server.log"))
    if config.engine == "forced":
        opts.setdefault("script", [{"text": "Hello from legorl check.", "repeat": True}])
    return opts


def _prompt_ids(model: str) -> tuple[list[int], list[int]]:
    from legorl.proxy.tokens import ChatTokenizer

    tok = ChatTokenizer(model)
    text = tok.render(
        [{"role": "user", "content": "Say hello, then list the files."}],
        None,
        add_generation_prompt=True,
    )
    return tok.encode(text), tok.stop_ids


async def _sample(engine: Any, prompt: list[int], max_tokens: int, stop: list[int]) -> tuple:
    from legorl.protocols import GenerationRequest

    ids: list[int] = []
    lps: list[float] = []
    request = GenerationRequest(
        prompt_ids=prompt, max_tokens=max_tokens, temperature=1.0, stop_token_ids=stop, seed=0
    )
    async for chunk in engine.generate(request):
        ids += [s.token_id for s in chunk]
        lps += [s.logprob for s in chunk]
    return ids, lps


async def check_engine(config: RunConfig) -> tuple[CheckResult, Any]:
    """Build the engine and sample up to 8 tokens; returns the result and the engine (or None)."""
    from legorl.engines import make_engine

    name = "engine"
    fix = (
        f"check the engine options ({config.engine}); for embedded/forced the model must load "
        "with transformers; for vllm the server must be up at base_url"
    )
    try:
        engine = await asyncio.to_thread(make_engine, config.engine, **_engine_options(config))
    except Exception as exc:
        return _fail(name, f"{config.engine} engine did not start: {_short(exc)}", fix), None
    try:
        prompt, stop = _prompt_ids(config.model or "")
        ids, lps = await asyncio.wait_for(_sample(engine, prompt, 8, stop), 300)
    except Exception as exc:
        await _close(engine)
        return _fail(name, f"{config.engine} engine did not answer: {_short(exc)}", fix), None
    if not ids:
        await _close(engine)
        return _fail(name, "the engine returned no tokens", fix), None
    bad = [x for x in lps if not math.isfinite(x) or x > 1e-4]
    if bad:
        await _close(engine)
        return _fail(name, f"log-probs not in (-inf, 0]: {bad[:3]}", fix), None
    return (
        _pass(
            name,
            f"{config.engine}: sampled {len(ids)} token(s), mean log-prob "
            f"{sum(lps) / len(lps):.3f}, context {engine.max_context}",
        ),
        engine,
    )


async def _close(engine: Any) -> None:
    with contextlib.suppress(Exception):
        await engine.close()


def _probe_list(config: RunConfig) -> list[tuple[str, bool, list[str]]]:
    """(api, stream, harnesses) for each API shape to probe."""
    from legorl.harnesses import HARNESSES

    probes: dict[tuple[str, bool], list[str]] = {}
    for harness in config.harnesses:
        if harness in HARNESSES:
            cls = HARNESSES[harness]
            probes.setdefault((cls.api, cls.streams), []).append(harness)
    for api in config.apis:
        if not any(a == api for a, _ in probes):
            probes.setdefault((api, False), [])
    return [(api, stream, names) for (api, stream), names in probes.items()]


def _api_request(api: str, stream: bool) -> tuple[str, dict[str, Any]]:
    user = "Say hello."
    if api == "openai_chat":
        body: dict[str, Any] = {
            "model": "legorl-check",
            "messages": [{"role": "user", "content": user}],
            "max_tokens": 8,
            "tools": [_TOOLS[0]],
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body
    if api == "anthropic":
        return "/v1/messages", {
            "model": "legorl-check",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": user}],
            "tools": [
                {
                    "name": "bash",
                    "description": "Run a shell command.",
                    "input_schema": _TOOLS[0]["function"]["parameters"],
                }
            ],
            "stream": stream,
        }
    if api == "gemini":
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return f"/v1beta/models/legorl-check:{method}", {
            "contents": [{"role": "user", "parts": [{"text": user}]}],
            "tools": [{"functionDeclarations": [_TOOLS[0]["function"]]}],
            "generationConfig": {"maxOutputTokens": 8},
        }
    return "/v1/responses", {
        "model": "legorl-check",
        "input": user,
        "max_output_tokens": 8,
        "stream": stream,
    }


def _answered(api: str, stream: bool, status: int, text: str) -> str | None:
    """None when the response has the API's shape, else what is wrong."""
    if status != 200:
        return f"HTTP {status}: {text[:200]}"
    if stream:
        events = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
        if not events:
            return "a streaming response without data: events"
        if api == "openai_chat":
            return None if events[-1] == "[DONE]" else "the stream does not end with [DONE]"
        if api == "gemini":
            last = events[-1]
            finished = '"finishReason"' in last and '"candidates"' in last
            return None if finished else "the stream's last chunk has no finishReason"
        kinds = []
        for ev in events:
            try:
                kinds.append(json.loads(ev).get("type"))
            except json.JSONDecodeError:
                return f"an event that is not JSON: {ev[:80]}"
        last = "message_stop" if api == "anthropic" else "response.completed"
        return None if last in kinds else f"the stream has no {last} event"
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return f"a body that is not JSON: {text[:80]}"
    if api == "openai_chat":
        ok = isinstance(body.get("choices"), list) and "message" in body["choices"][0]
    elif api == "anthropic":
        ok = body.get("type") == "message" and isinstance(body.get("content"), list)
    elif api == "gemini":
        ok = isinstance(body.get("candidates"), list) and "content" in body["candidates"][0]
    else:
        ok = body.get("object") == "response" and isinstance(body.get("output"), list)
    return None if ok else f"unexpected body: {text[:120]}"


async def check_proxy(config: RunConfig, engine: Any) -> list[CheckResult]:
    """Start the proxy in-process on a free port and send one request per API shape."""
    import httpx

    from legorl.proxy.core import ProxyConfig, ProxyCore
    from legorl.proxy.server import ProxyServer
    from legorl.records import Turn, read_jsonl

    probes = _probe_list(config)
    if not probes:
        return [_skip("proxy", "no harness or API shape configured to probe")]
    results = []
    fix = "see the proxy's error above; `legorl proxy serve --model …` reproduces it"
    with tempfile.TemporaryDirectory(prefix="legorl-check-") as out:
        try:
            core = ProxyCore(ProxyConfig(model=str(config.model), out=out), engine)
            server = ProxyServer(core, "127.0.0.1", 0)
            await server.start()
        except Exception as exc:
            return [_fail("proxy", f"the proxy did not start: {_short(exc)}", fix)]
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                for i, (api, stream, harnesses) in enumerate(probes):
                    label = f"proxy: {api}" + (f" ({', '.join(harnesses)})" if harnesses else "")
                    session = f"check-{i}-{api}"
                    route, body = _api_request(api, stream)
                    try:
                        resp = await client.post(f"/s/{session}{route}", json=body)
                        problem = _answered(api, stream, resp.status_code, resp.text)
                    except httpx.HTTPError as exc:
                        problem = f"no answer: {_short(exc)}"
                    if problem is None:
                        path = Path(out) / f"{session}.jsonl"
                        turns = list(read_jsonl(path, Turn)) if path.is_file() else []
                        if not turns or turns[-1].api != api:
                            problem = "answered, but no Turn was recorded"
                    mode = "streaming" if stream else "non-streaming"
                    if problem is None:
                        results.append(
                            _pass(
                                label,
                                f"{mode} {route} answered in its shape; Turn recorded "
                                f"({len(turns[-1].completion_ids)} completion tokens)",
                            )
                        )
                    else:
                        results.append(_fail(label, f"{mode} {route}: {problem}", fix))
        finally:
            # Let the server's connection tasks see the client's close before it shuts down;
            # cancelling them mid-read makes Python 3.11's asyncio log a spurious traceback.
            for _ in range(200):
                if not getattr(server, "_connections", None):
                    break
                await asyncio.sleep(0.01)
            await server.close()
    return results


async def check_fidelity(config: RunConfig, engine: Any, tokens: int = 64) -> CheckResult:
    """A small rollout (two samples from the engine) through `legorl train --dry-run` with the
    trainer's model (``trainer_model`` or ``model``): its rollout/trainer Pearson of
    probabilities on the loss tokens must be >= 0.99."""
    from legorl.records import Metric, Sample
    from legorl.train.config import build_config
    from legorl.train.trainer import train

    name = "fidelity"
    trainer_path = config.trainer_model or config.model
    fix = (
        "the engine and the trainer must score the same weights the same way: same checkpoint, "
        "log-probs of raw logits at the sampling temperature (before top-p), fp32 log-softmax"
    )
    try:
        prompt, _ = _prompt_ids(config.model or "")
        rollout = [
            await asyncio.wait_for(_sample(engine, prompt, tokens, []), 600) for _ in range(2)
        ]
    except Exception as exc:
        return _fail(name, f"the engine did not sample: {_short(exc)}", fix)
    samples = [
        Sample(
            sample_id=f"check/{k}",
            episode_id=f"check-{k}",
            group_id="check",
            segment_index=0,
            segment_count=1,
            input_ids=[*prompt, *ids],
            loss_mask=[0] * len(prompt) + [1] * len(ids),
            rollout_logprobs=list(lps),
            reward=float(k),
        )
        for k, (ids, lps) in enumerate(rollout)
    ]
    seen: list[Metric] = []
    try:
        cfg = build_config(
            None, [f"precision={'bf16' if config.trainer_dtype == 'bfloat16' else 'fp32'}"], steps=1
        )
        await asyncio.to_thread(
            train,
            samples,
            model=str(trainer_path),
            out=None,
            config=cfg,
            dry_run=True,
            emit=seen.append,
        )
    except Exception as exc:
        return _fail(name, f"the trainer's dry run failed: {_short(exc)}", fix)
    values = {m.name: m.value for m in seen}
    corr = values.get("rollout_trainer_pearson")
    max_dp = values.get("prob_abs_diff_max")
    what = f"{sum(len(ids) for ids, _ in rollout)} loss tokens, max |Δp| {max_dp or 0:.2e}"
    if corr is None:  # constant probabilities: fall back to the largest difference
        if max_dp is not None and max_dp <= 1e-3:
            return _pass(name, f"correlation undefined (constant probabilities); {what}")
        return _fail(name, f"correlation undefined and {what}", fix)
    if corr < 0.99:
        return _fail(name, f"dry-run train: Pearson(prob) {corr:.4f} < 0.99 over {what}", fix)
    return _pass(name, f"dry-run train: Pearson(prob) {corr:.6f} >= 0.99 over {what}")


def check_vllm(config: RunConfig) -> CheckResult:
    """The vllm engine's own preconditions, before it starts: a server at ``base_url`` answers
    (and whether it can reload weights), or a Python with vLLM is there to launch one, and this
    vLLM build can serve the model."""
    from legorl.engines.vllm_server import check_servable, find_vllm_python
    from legorl.protocols import EngineError

    name = "vllm"
    opts = config.engine_options
    base_url = opts.get("base_url")
    if base_url:
        import httpx

        urls = [u.strip().rstrip("/") for u in str(base_url).split(",") if u.strip()]
        least = opts.get("min_replicas") or len(urls)
        fix = "start the server (see docs/vllm.md), or drop base_url and let legorl launch one"
        seen, down = [], []
        for url in urls:
            try:
                models = httpx.get(f"{url}/v1/models", timeout=30)
                models.raise_for_status()
                cards = models.json().get("data") or []
                dev = httpx.get(f"{url}/server_info", timeout=30).status_code == 200
            except (httpx.HTTPError, ValueError) as exc:
                down.append(f"no vLLM server at {url}: {_short(exc)}")
                continue
            served = ", ".join(f"{c.get('id')} ({c.get('max_model_len')} tokens)" for c in cards)
            reload = (
                "dev mode on: weights reload in place"
                if dev
                else "dev mode off: no weight reload (start it with VLLM_SERVER_DEV_MODE=1)"
            )
            seen.append(f"{url} serves {served or 'nothing'}; {reload}")
        if len(seen) < least:
            if len(urls) > 1:
                down.insert(0, f"{len(seen)} of {len(urls)} replicas answer (min_replicas={least})")
            return _fail(name, "; ".join(down), fix)
        return _pass(name, "; ".join(seen + down))
    try:
        python, info = find_vllm_python(opts.get("python"))
        check_servable(opts.get("model_path") or config.model, info.get("dist"))
    except EngineError as exc:
        return _fail(
            name,
            _short(exc),
            "install vLLM in a venv and pass --engine-opt python=…/bin/python (or "
            "LEGORL_VLLM_PYTHON), or use base_url=… of a running server",
        )
    return _pass(
        name,
        f"{info.get('dist')} {info.get('version')} at {python}; legorl launches it on the model "
        "(processed_logprobs, dev-mode reloads, bounded KV cache, 127.0.0.1)",
    )
