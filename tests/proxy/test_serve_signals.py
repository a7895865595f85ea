"""`legorl proxy serve` stops on SIGTERM and on SIGINT, closing its engine (which ends a vLLM
server it launched), even where it inherited SIGINT ignored, as a process started in the
background of a script does. The engine is `forced`, a fake that ships in the package."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from proxy_harness import MODEL, ROOT


def _serve(tmp: Path) -> tuple[subprocess.Popen[str], Path, str]:
    err, script = tmp / "stderr", tmp / "script.json"
    script.write_text('[{"text": "ok", "repeat": true}]')
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "legorl.cli.main", "proxy", "serve", "--engine", "forced",
             "--model", str(MODEL), "--out", str(tmp / "turns"), "--script", str(script), "--port", "0"],
            stdout=subprocess.DEVNULL, stderr=fh, text=True, cwd=ROOT,
            env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"},
            # as `cmd &` in a script starts it: SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (found := re.search(r"on (http://127\.0\.0\.1:\d+)", err.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.2)
    return proc, err, found[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_on_a_signal_and_closes_its_engine(tmp_path: Path, sig: int) -> None:
    proc, err, url = _serve(tmp_path)
    try:
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{url}/s/a/v1/chat/completions", json=body).status_code == 200
        proc.send_signal(sig)
        assert proc.wait(60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.read_text().splitlines()
    assert f"legorl proxy: {signal.Signals(sig).name}: stopping" in lines
    assert lines[-1] == "legorl proxy: stopped"  # after the engine closed
    assert (tmp_path / "turns" / "a.jsonl").read_bytes().count(b"\n") == 1
