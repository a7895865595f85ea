"""Preflight checks for a run (`legorl check`): each check is a function that returns
``CheckResult``s (name, status, reason, fix) instead of raising, so a run learns every problem at
once, before it spends hours.

    legorl check --config run.yaml --dry-run
    legorl check --model fixtures/models/tiny-qwen3 --engine forced \\
        --tasks fixtures/tasks/train.jsonl --harness mini --sandbox local

    from legorl.check import RunConfig, run_checks
    results = run_checks(RunConfig(model="fixtures/models/tiny-qwen3", engine="forced"))

The checks, in order (a check whose prerequisite failed is reported as ``skip``):

* ``model``: the folder has a config, a tokenizer, a chat template and readable weights.
* ``template``: a conversation with tool calls renders, tokenises, decodes and parses back into
  the same calls and text (the proxy's own parser), and renders are prefix-stable.
* ``vllm`` (engine vllm): the server at ``base_url`` answers and says whether it reloads
  weights; or, when legorl launches it, a Python with vLLM is there and can serve the model.
* ``engine``: the engine loads the model and samples a few tokens with finite log-probs.
* ``proxy: API``: an in-process proxy answers each API shape the configured harnesses speak
  (OpenAI Chat, Anthropic Messages, Responses), streaming where the harness streams, and
  records the Turn.
* ``fidelity`` (``dry_run``): a two-sample rollout from the engine through `legorl train
  --dry-run` with the trainer's model; its rollout/trainer Pearson of probabilities on the loss
  tokens must be >= 0.99.
* ``tasks``: the task file loads and every repository bundle it names exists.
* ``harness: NAME``: the harness is installed (binary on PATH, the OpenHands SDK venv).
* ``sandbox``: the backend works here: bubblewrap starts a sandbox (``local``); the Docker daemon
  answers, the configured images are present, and each task's layers (``legorl.sandbox.layers``)
  are built or buildable (``docker``).
* ``disk``: free space where the run writes is at least the budget.

The run configuration (``RunConfig``) comes from a YAML or JSON file and/or flags; see
``load_config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from legorl.protocols import ConfigError

Status = Literal["pass", "fail", "skip"]

API_NAMES = ("openai_chat", "anthropic", "responses", "gemini")
SANDBOXES = ("local", "docker")


@dataclass(slots=True, kw_only=True)
class CheckResult:
    name: str
    status: Status
    reason: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def _pass(name: str, reason: str) -> CheckResult:
    return CheckResult(name=name, status="pass", reason=reason)


def _fail(name: str, reason: str, fix: str) -> CheckResult:
    return CheckResult(name=name, status="fail", reason=reason, fix=fix)


def _skip(name: str, reason: str) -> CheckResult:
    return CheckResult(name=name, status="skip", reason=reason)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------------------------
# The run configuration
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class RunConfig:
    """What a run uses, as far as a preflight can check it. Relative paths in a file are taken
    relative to that file's folder."""

    model: str | None = None  # local model folder (tokenizer, template; weights for embedded)
    engine: str = "embedded"  # embedded | forced | vllm
    engine_options: dict[str, Any] = field(default_factory=dict)  # make_engine keyword options
    trainer_model: str | None = None  # what the trainer recomputes log-probs with; None: model
    trainer_dtype: str = "float32"
    harnesses: list[str] = field(default_factory=lambda: ["mini"])
    apis: list[str] = field(default_factory=list)  # API shapes to probe besides the harnesses'
    tasks: str | None = None  # task file (.jsonl, .json, .parquet) or datasets folder
    task_format: str | None = None  # legorl.tasks.FORMATS key; None: detected from the columns
    sandbox: str = "local"  # local | docker
    docker_host: str | None = None  # None: DOCKER_HOST or the default socket
    images: list[str] = field(default_factory=list)  # Docker images the run needs present
    workdir: str = "runs"  # where the run writes; the disk budget is checked there
    disk_budget_gb: float = 5.0


_PATH_FIELDS = ("model", "trainer_model", "tasks", "workdir")


def _yaml_module() -> Any:
    try:
        import yaml
    except ImportError:
        return None
    return yaml


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """A ``RunConfig`` from a ``.yaml``/``.yml`` (needs PyYAML) or ``.json`` file; unknown keys
    and wrong types are ``ConfigError``s naming the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        yaml = _yaml_module()
        if yaml is None:
            raise ConfigError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                "or write the same keys as a .json file"
            )
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: malformed YAML: {_short(exc)}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: malformed JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    config = config_from_dict(data, where=str(path))
    base = path.resolve().parent
    for name in _PATH_FIELDS:
        value = getattr(config, name)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            setattr(config, name, str(base / value))
    return config


def config_from_dict(data: dict[str, Any], where: str = "config") -> RunConfig:
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})"
        )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("harnesses", "apis", "images"):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: {key}: expected a list of strings")
        elif key == "engine_options":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key}: expected a mapping")
        elif key == "disk_budget_gb":
            if type(value) not in (int, float) or value < 0:
                raise ConfigError(f"{where}: {key}: expected a non-negative number")
            value = float(value)
        elif value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: {key}: expected a string")
        kwargs[key] = value
    config = RunConfig(**kwargs)
    if config.sandbox not in SANDBOXES and config.sandbox != "none":
        raise ConfigError(f"{where}: sandbox: expected one of {', '.join(SANDBOXES)}, none")
    bad = [a for a in config.apis if a not in API_NAMES]
    if bad:
        raise ConfigError(
            f"{where}: apis: unknown {', '.join(bad)} (known: {', '.join(API_NAMES)})"
        )
    return config


# --------------------------------------------------------------------------------------------
# Model and template
# --------------------------------------------------------------------------------------------

_MODEL_FIX = (
    "point --model (or model:) at a local model folder with config.json, tokenizer.json, "
    "a chat template (chat_template.jinja or tokenizer_config.json) and *.safetensors weights"
)


def _safetensors_tensors(path: Path) -> int:
    """Number of tensors in a safetensors file, read from its header only."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name}: shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > 100_000_000:
            raise ValueError(f"{path.name}: implausible safetensors header size {size}")
        header = json.loads(fh.read(size))
    return sum(1 for k in header if k != "__metadata__")


def check_model(model: str | None) -> CheckResult:
    """Config, tokenizer and weights are present and readable (the weights' headers only: the
    engine check loads them for real)."""
    name = "model"
    if not model:
        return _fail(name, "no model configured", _MODEL_FIX)
    path = Path(model)
    if not path.is_dir():
        return _fail(name, f"{path}: no such folder", _MODEL_FIX)
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        return _fail(name, f"{path}: missing {', '.join(missing)}", _MODEL_FIX)
    try:
        config = json.loads((path / "config.json").read_text())
        arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    except (OSError, json.JSONDecodeError) as exc:
        return _fail(name, f"{path}/config.json: {_short(exc)}", _MODEL_FIX)
    try:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    except Exception as exc:
        return _fail(name, f"{path}/tokenizer.json does not load: {_short(exc)}", _MODEL_FIX)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        if sorted(path.glob("pytorch_model*.bin")):
            return _fail(
                name,
                f"{path}: only pytorch_model*.bin weights",
                "convert the weights to safetensors (transformers save_pretrained does)",
            )
        return _fail(name, f"{path}: no *.safetensors weights", _MODEL_FIX)
    try:
        tensors = sum(_safetensors_tensors(w) for w in weights)
    except (OSError, ValueError) as exc:
        return _fail(name, f"unreadable weights: {_short(exc)}", "re-download the weights")
    size = sum(w.stat().st_size for w in weights)
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    return _pass(
        name,
        f"{path.name}: {arch}, vocab {vocab}, {tensors} tensors in {len(weights)} file(s), {shown}",
    )


_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "str_replace",
            "description": "Replace text in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
]
_CALLS = [
    ("bash", {"command": "ls -la src | head -n 5", "timeout": 30}),
    ("str_replace", {"path": "src/app.py", "old": "x = 1", "new": 'x = "é\\n"  # {braces}'}),
]
_TEXT = "I will look at the files, then fix the bug."
_TEMPLATE_FIX = (
    "use the model's own chat template; the proxy parses tool calls written as "
    '<tool_call>{"name": …, "arguments": {…}}</tool_call> (Qwen) or Qwen3-Coder XML, and needs '
    "assistant turns that end with the eos token"
)


def check_template(model: str) -> CheckResult:
    """Render a conversation whose last assistant turn has text and two tool calls, cut out that
    turn, encode and decode it, and parse it with the proxy's parser: same text, same calls."""
    from legorl.proxy.parse import OutputParser
    from legorl.proxy.tokens import ChatTokenizer

    name = "template"
    try:
        tok = ChatTokenizer(model)
    except Exception as exc:  # TemplateError, ValueError, jinja errors
        return _fail(name, f"the chat template does not load: {_short(exc)}", _TEMPLATE_FIX)
    head = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug in src/app.py."},
    ]
    assistant = {
        "role": "assistant",
        "content": _TEXT,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(_CALLS)
        ],
    }
    try:
        prefix = tok.render(head, _TOOLS, add_generation_prompt=True)
        full = tok.render([*head, assistant], _TOOLS, add_generation_prompt=False)
    except Exception as exc:
        return _fail(
            name, f"rendering a tool-call conversation failed: {_short(exc)}", _TEMPLATE_FIX
        )
    if not full.startswith(prefix):
        return _fail(
            name,
            "the render with the assistant turn does not start with the render of the prompt "
            "(the template rewrites earlier text): sampled tokens would not be a prefix",
            _TEMPLATE_FIX,
        )
    body = full[len(prefix) :]
    end = body.find(tok.eos_text)
    if end < 0:
        return _fail(name, f"the assistant turn does not end with {tok.eos_text!r}", _TEMPLATE_FIX)
    body = body[:end]
    decoded = tok.decode(tok.encode(body))
    if decoded != body:
        return _fail(
            name,
            f"the assistant text does not survive encode → decode ({body[:40]!r}… → "
            f"{decoded[:40]!r}…)",
            "use the tokenizer that belongs to the model",
        )
    counter = iter(range(1_000_000))
    parser = OutputParser(lambda: f"call_{next(counter)}")
    parser.feed(decoded)
    parser.finish()
    want = [(n, a) for n, a in _CALLS]
    got = []
    for call in parser.calls:
        try:
            got.append((call.name, json.loads(call.arguments)))
        except json.JSONDecodeError:
            got.append((call.name, call.arguments))
    if parser.malformed or got != want:
        return _fail(
            name,
            f"rendered {len(want)} tool call(s) ({', '.join(n for n, _ in want)}); the parser "
            f"read back {len(got)}"
            + (f" ({', '.join(n for n, _ in got)})" if got else "")
            + (" and flagged a malformed call" if parser.malformed else "")
            + (f"; assistant text: {body[:80]!r}" if not got else ""),
            _TEMPLATE_FIX,
        )
    text = "".join(parser.text).strip()
    if text != _TEXT:
        return _fail(name, f"text came back as {text[:60]!r}, not {_TEXT[:60]!r}", _TEMPLATE_FIX)
    return _pass(
        name,
        f"{len(want)} tool calls and the text round-trip (render → tokens → parse); "
        f"eos {tok.eos_text!r}",
    )


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


# --------------------------------------------------------------------------------------------
# Tasks, harnesses, sandbox, disk
# --------------------------------------------------------------------------------------------


def check_tasks(tasks: str | None, task_format: str | None = None) -> CheckResult:
    from legorl.tasks import TaskError, load_tasks

    name = "tasks"
    if not tasks:
        return _skip(name, "no task file configured (--tasks)")
    fix = (
        "fix the line and field named; tasks are legorl/task@1 records or SWE-bench rows "
        "(instance_id, repo, base_commit, problem_statement, test_patch, FAIL_TO_PASS, …)"
    )
    try:
        loaded = load_tasks(tasks, task_format=task_format)
    except TaskError as exc:
        return _fail(name, str(exc), fix)
    if not loaded:
        return _fail(name, f"{tasks}: no tasks", "add at least one task")
    counts = Counter(t.instance_id for t in loaded)
    dupes = sorted(iid for iid, n in counts.items() if n > 1)
    if dupes:
        return _fail(name, f"duplicate instance_id(s): {', '.join(dupes[:5])}", "make ids unique")
    base = Path(tasks).parent
    missing = [t.instance_id for t in loaded if t.source and not (base / t.source).exists()]
    if missing:
        return _fail(
            name,
            f"{len(missing)} task(s) name a repository that does not exist, e.g. {missing[0]}",
            "put the bundles beside the task file (source is relative to its folder)",
        )
    no_source = sum(1 for t in loaded if not t.source and not t.image)
    repos = len({t.repo for t in loaded})
    note = f"; {no_source} without source or image" if no_source else ""
    return _pass(name, f"{len(loaded)} tasks from {repos} repositories, all valid{note}")


def _version(cmd: list[str], timeout: float = 60) -> tuple[int | None, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, _short(exc)
    out = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    if not out:
        return proc.returncode, ""
    # A version is the last line printed; an error is best told by its first.
    return proc.returncode, out[-1] if proc.returncode == 0 else out[0]


def check_harness(name: str, sandbox: str = "local", path: str | None = None) -> CheckResult:
    """Is harness ``name`` installed where the run will start it? ``path`` overrides PATH. What
    to look for is the harness class's own ``requires``."""
    from legorl.harnesses import HARNESSES, default_venv_python

    label = f"harness: {name}"
    try:
        cls = HARNESSES.resolve(name)
    except ConfigError as exc:
        return _fail(label, str(exc), f"use one of {HARNESSES.names()}")
    if sandbox == "docker":
        return _skip(label, "runs from the sandbox image's harness-runtime layer, not the host")
    need = cls.requires
    if need.binary is not None:
        found = shutil.which(need.binary, path=path)
        if found is None:
            return _fail(label, f"{need.binary} is not on PATH", need.install)
        code, version = _version([found, "--version"])
        if code != 0:
            return _fail(label, f"{found} --version failed: {version}", need.install)
        return _pass(label, f"{found}: {version}")
    venvs = ("openhands", "miniswe")
    python = default_venv_python(need.python) if need.python in venvs else (need.python or "")
    found = python if os.path.isabs(python) else shutil.which(python, path=path)
    if not found or not os.path.exists(found):
        return _fail(
            label, f"no Python at {python or '(none named)'} for {need.module}", need.install
        )
    probe = (
        "import importlib.util, sys; "
        f"sys.exit(0 if importlib.util.find_spec({need.module!r}) else 3)"
    )
    code, out = _version([found, "-c", probe])
    if code != 0:
        return _fail(
            label, f"{found} cannot import {need.module}{': ' + out if out else ''}", need.install
        )
    return _pass(label, f"{need.module} importable from {found}")


def check_sandbox(
    backend: str,
    *,
    docker_host: str | None = None,
    images: list[str] | None = None,
    tasks: str | None = None,
    task_format: str | None = None,
) -> CheckResult:
    name = f"sandbox: {backend}"
    if backend == "none":
        return _skip("sandbox", "no sandbox configured")
    if backend == "local":
        fix = "apt-get install bubblewrap, and allow unprivileged user namespaces"
        found = shutil.which("bwrap")
        if found is None:
            return _fail(name, "bubblewrap (bwrap) is not on PATH", fix)
        code, out = _version([found, "--ro-bind", "/", "/", "--unshare-all", "true"], timeout=30)
        if code != 0:
            return _fail(name, f"bwrap cannot start a sandbox: {out}", fix)
        return _pass(name, f"{found} starts an isolated sandbox")
    if backend != "docker":
        return _fail(
            name, f"unknown sandbox backend {backend!r}", f"use one of {', '.join(SANDBOXES)}"
        )
    return check_docker(
        docker_host=docker_host, images=images or [], tasks=tasks, task_format=task_format
    )


def _task_layers(tasks: str | None, task_format: str | None = None) -> tuple[list[Any], str]:
    """The image layers the tasks' sandboxes stand on (``legorl.sandbox.layers.plan``), unique
    and bottom first; empty with a note when they cannot be planned."""
    if not tasks:
        return [], ""
    try:
        from legorl.sandbox.layers import plan
        from legorl.tasks import load_tasks

        layers: dict[str, Any] = {}
        for task in load_tasks(tasks, task_format=task_format, notice=lambda _line: None):
            for layer in plan(task):
                layers.setdefault(layer.tag, layer)
    except ImportError:
        return [], "; task layers not checked (legorl.sandbox.layers is not available)"
    except Exception as exc:  # the tasks check reports a bad task file
        return [], f"; task layers not planned: {_short(exc, 120)}"
    return list(layers.values()), ""


def check_docker(
    *,
    docker_host: str | None = None,
    images: list[str],
    tasks: str | None = None,
    task_format: str | None = None,
) -> CheckResult:
    """Ping the daemon with the Docker SDK, look each configured image up, and, given tasks,
    see which of their sandbox layers (base → env → instance) are present or can be built."""
    name = "sandbox: docker"
    where = docker_host or os.environ.get("DOCKER_HOST") or "the default socket"
    fix = (
        "start the daemon (`sudo systemctl start docker`, or `dockerd &`), point DOCKER_HOST "
        "or docker_host: at it, or use --sandbox local"
    )
    try:
        import docker
        from docker.errors import DockerException, ImageNotFound
    except ImportError:
        return _fail(name, "the docker Python SDK is not installed", "pip install docker")
    try:
        client = (
            docker.DockerClient(base_url=docker_host, timeout=10)
            if docker_host
            else docker.from_env(timeout=10)
        )
        client.ping()
    except Exception as exc:
        return _fail(name, f"cannot reach the Docker daemon at {where}: {_short(exc, 200)}", fix)
    layers, note = _task_layers(tasks, task_format)

    def present(tag: str) -> bool:
        try:
            client.images.get(tag)
        except ImageNotFound:
            return False
        return True

    try:
        version = client.version().get("Version", "?")
        missing = [image for image in images if not present(image)]
        absent = [layer for layer in layers if not present(layer.tag)]
    except DockerException as exc:
        return _fail(name, f"the daemon at {where} failed: {_short(exc, 200)}", fix)
    finally:
        client.close()
    if missing:
        return _fail(
            name,
            f"daemon {version} is up, but {len(missing)} image(s) are missing: "
            f"{', '.join(missing)}",
            "build or load them before the run (`docker image ls` lists what is there; "
            "no registry may be reachable)",
        )
    # Missing layers are built on first use: a base needs debootstrap, a prebuilt image a pull.
    unpullable = [layer.tag for layer in absent if layer.kind == "image"]
    if unpullable:
        from legorl.sandbox.images import build_hint

        return _fail(
            name,
            f"{len(unpullable)} prebuilt task image(s) are not here and must be pulled: "
            f"{', '.join(unpullable[:3])}",
            f"get each before the run, e.g. {unpullable[0]} with {build_hint(unpullable[0])}",
        )
    bases = [layer.tag for layer in absent if layer.kind == "base"]
    if bases and shutil.which("debootstrap") is None:
        return _fail(
            name,
            f"{len(bases)} base layer(s) are not built and debootstrap is not installed",
            "apt-get install debootstrap, or build the layers elsewhere: "
            "legorl sandbox build --tasks …",
        )
    what = f"{len(images)} image(s) present"
    if layers:
        what += f"; task layers: {len(layers) - len(absent)} of {len(layers)} built" + (
            f", {len(absent)} to build on first use" if absent else ""
        )
    return _pass(name, f"daemon {version} at {where}; {what}{note}")


def check_disk(workdir: str, budget_gb: float) -> CheckResult:
    name = "disk"
    path = Path(workdir).resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 1e9
    if free < budget_gb:
        return _fail(
            name,
            f"{free:.1f} GB free at {probe}, the budget is {budget_gb:g} GB",
            "free space, point workdir at a bigger disk, or lower disk_budget_gb",
        )
    return _pass(name, f"{free:.1f} GB free at {probe} (budget {budget_gb:g} GB)")


# --------------------------------------------------------------------------------------------
# All together
# --------------------------------------------------------------------------------------------


def run_checks(
    config: RunConfig,
    *,
    dry_run: bool = False,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Every check in order; ``on_result`` sees each result as it is known."""
    results: list[CheckResult] = []

    def add(*new: CheckResult) -> None:
        for r in new:
            results.append(r)
            if on_result is not None:
                on_result(r)

    model = check_model(config.model)
    add(model)
    template = check_template(config.model) if model.ok and config.model else None
    add(template or _skip("template", "needs the model"))
    if model.ok:
        asyncio.run(_engine_checks(config, dry_run, add))
    else:
        add(_skip("engine", "needs the model"))
        add(_skip("proxy", "needs the model"))
        if dry_run:
            add(_skip("fidelity", "needs the model"))
    add(check_tasks(config.tasks, config.task_format))
    for harness in config.harnesses:
        add(check_harness(harness, config.sandbox))
    add(
        check_sandbox(
            config.sandbox,
            docker_host=config.docker_host,
            images=config.images,
            tasks=config.tasks,
            task_format=config.task_format,
        )
    )
    add(check_disk(config.workdir, config.disk_budget_gb))
    return results


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


async def _engine_checks(config: RunConfig, dry_run: bool, add: Callable[..., None]) -> None:
    if config.engine == "vllm":
        row = check_vllm(config)
        add(row)
        if not row.ok:
            add(_skip("engine", "needs vllm"))
            add(_skip("proxy", "needs the engine"))
            if dry_run:
                add(_skip("fidelity", "needs the engine"))
            return
    result, engine = await check_engine(config)
    add(result)
    if engine is None:
        add(_skip("proxy", "needs the engine"))
        if dry_run:
            add(_skip("fidelity", "needs the engine"))
        return
    try:
        add(*await check_proxy(config, engine))
        if dry_run:
            add(await check_fidelity(config, engine))
    finally:
        await _close(engine)


__all__ = [
    "CheckResult",
    "ConfigError",
    "RunConfig",
    "check_disk",
    "check_docker",
    "check_engine",
    "check_fidelity",
    "check_harness",
    "check_model",
    "check_proxy",
    "check_sandbox",
    "check_tasks",
    "check_template",
    "check_vllm",
    "config_from_dict",
    "load_config",
    "run_checks",
]
