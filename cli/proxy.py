"""`legorl proxy`: the token-faithful LLM proxy.

legorl proxy serve --model fixtures/models/tiny-qwen3 --port 8000 --out runs/turns
legorl proxy intercept --model fixtures/models/tiny-qwen3 --port 8080 --out runs/turns
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    MaxCallTokens,
    MaxEpisodeS,
    MaxEpisodeTokens,
    MaxEpisodeTurns,
    budget,
    choices,
    console,
    engine_log_beside,
    fail,
    key_values,
)

HELP = "Token-faithful LLM proxy: serve the engine, or intercept harness traffic."

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False)

Model = Annotated[
    Path, typer.Option("--model", "-m", help="Model folder (weights, tokenizer, template).")
]
EngineName = Annotated[str, typer.Option("--engine", "-e", help=choices("engine"))]
EngineOpts = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-opt", help="Engine setting KEY=VALUE (repeatable), e.g. dtype=bfloat16."
    ),
]
Script = Annotated[
    Path | None,
    typer.Option("--script", help="forced engine: JSON/JSONL file of scripted completions."),
]
Out = Annotated[
    Path | None, typer.Option("--out", "-o", help="Folder for {session}.jsonl Turn records.")
]
Host = Annotated[str, typer.Option("--host", help="Address to listen on.")]
Port = Annotated[int, typer.Option("--port", "-p", help="Port (0 picks a free one).")]
ServedName = Annotated[str, typer.Option("--served-name", help="Model name in /v1/models.")]


def _engine_options(pairs: list[str] | None, script: Path | None) -> dict[str, Any]:
    opts = key_values("proxy", "--engine-opt", pairs)
    if script is not None:
        if not script.is_file():
            fail("proxy", f"--script {script}: no such file", 2)
        opts["script"] = str(script)
    return opts


def _build(
    model: Path,
    engine: str,
    engine_opts: dict[str, Any],
    out: Path | None,
    served_name: str,
    admin_token: str | None,
    registered_only: bool,
    caps: Any = None,
):
    from legorl.engines import ENGINES, make_engine
    from legorl.protocols import EngineError
    from legorl.proxy.core import Budget, ProxyConfig, ProxyCore

    if engine not in ENGINES and ":" not in engine:
        fail("proxy", f"--engine {engine!r}: unknown engine (one of {ENGINES.names()})", 2)
    if not (model / "tokenizer.json").is_file():
        fail("proxy", f"--model {model}: not a model folder (no tokenizer.json)", 2)
    engine_log_beside(engine, engine_opts, out or Path.cwd())
    try:
        eng = make_engine(engine, model_path=str(model), **engine_opts)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        fail("proxy", f"--engine {engine}: {exc}", 2)
    except EngineError as exc:  # e.g. a vLLM server that legorl could not start
        fail("proxy", f"--engine {engine}: {exc}")
    config = ProxyConfig(
        model=model,
        served_name=served_name,
        out=out,
        admin_token=admin_token,
        open_sessions=not registered_only,
        log_errors=True,
        budget=caps or Budget(),
    )
    return ProxyCore(config, eng)


@app.command()
def serve(
    model: Model,
    engine: EngineName = "embedded",
    engine_opt: EngineOpts = None,
    script: Script = None,
    out: Out = None,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    served_name: ServedName = "",
    admin_token: Annotated[
        str | None,
        typer.Option(help="Token for /admin routes (default: $LEGORL_ADMIN_TOKEN or a new one)."),
    ] = None,
    registered_only: Annotated[
        bool,
        typer.Option(
            help="Only sessions opened via POST /admin/sessions (each reachable only at the "
            "route it answers); no open sessions named by the client."
        ),
    ] = False,
    max_call_tokens: MaxCallTokens = None,
    max_episode_turns: MaxEpisodeTurns = None,
    max_episode_tokens: MaxEpisodeTokens = None,
    max_episode_s: MaxEpisodeS = None,
) -> None:
    """Answer OpenAI Chat, Anthropic Messages and Responses calls from an engine."""
    from legorl.proxy.server import ProxyServer, tune_gc_for_serving

    token = admin_token or os.environ.get("LEGORL_ADMIN_TOKEN") or secrets.token_hex(16)
    caps = budget("proxy", max_call_tokens, max_episode_turns, max_episode_tokens, max_episode_s)
    core = _build(
        model,
        engine,
        _engine_options(engine_opt, script),
        out,
        served_name,
        token,
        registered_only,
        caps,
    )
    tune_gc_for_serving()

    async def main() -> None:
        server = ProxyServer(core, host, port)
        try:
            bound = await server.start()
        except OSError as exc:
            fail("proxy", f"cannot listen on {host}:{port}: {exc.strerror or exc}")
        console.print(
            f"legorl proxy: serving {core.served_name} ({engine}) on http://{host}:{bound} "
            f"— {'' if registered_only else 'open sessions at /s/{session}/v1/…; '}"
            f"POST /admin/sessions opens one at the route it answers; admin token {token}",
            markup=False,
            soft_wrap=True,
        )
        # SIGTERM (docker stop, systemd) and SIGINT stop it the same way: the engine closed, so
        # a vLLM server it launched ends with it. SIGINT too is taken here, since a process
        # started in the background of a script inherits it ignored. A second signal of the
        # kind ends the process at once.
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        stopping: list[signal.Signals] = []

        def stop(sig: signal.Signals) -> None:
            loop.remove_signal_handler(sig)
            console.print(f"legorl proxy: {sig.name}: stopping", markup=False)
            stopping.append(sig)
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig)
        try:
            await server.serve_forever()
        except asyncio.CancelledError:
            if not stopping:
                raise
            task.uncancel()
        finally:
            await core.engine.close()
        console.print("legorl proxy: stopped", markup=False)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(os.environ.get("LEGORL_DATA_DIR", Path(base) / "legorl"))


@app.command()
def intercept(
    model: Model,
    engine: EngineName = "embedded",
    engine_opt: EngineOpts = None,
    script: Script = None,
    out: Out = None,
    host: Host = "127.0.0.1",
    port: Port = 8080,
    served_name: ServedName = "",
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", help="Also pass this host through (repeatable)."),
    ] = None,
) -> None:
    """Forward proxy (mitmproxy) that answers api.anthropic.com / api.openai.com itself."""
    from legorl.proxy.addon import run_intercept
    from legorl.proxy.server import tune_gc_for_serving

    core = _build(model, engine, _engine_options(engine_opt, script), out, served_name, None, False)
    tune_gc_for_serving()
    confdir = data_dir() / "mitmproxy"
    confdir.mkdir(parents=True, exist_ok=True)
    ca = confdir / "mitmproxy-ca-cert.pem"
    console.print(
        f"legorl proxy: intercepting on http://{host}:{port} with CA {ca} (created on first start)\n"
        f"  export HTTPS_PROXY=http://{host}:{port}\n"
        f"  export NODE_EXTRA_CA_CERTS={ca} SSL_CERT_FILE={ca} REQUESTS_CA_BUNDLE={ca}",
        markup=False,
        soft_wrap=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            run_intercept(
                core,
                host=host,
                port=port,
                confdir=str(confdir),
                allow_hosts=tuple(allow_host or ()),
            )
        )
