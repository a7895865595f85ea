"""A FAKE vLLM server for the vllm engine's tests: no model, only vLLM's documented HTTP shapes.

It answers ``GET /v1/models`` (with ``max_model_len``), ``POST /v1/completions`` (token-id
prompts; ``logprobs`` with ``"token_id:N"`` tokens, ``token_ids``; streamed as server-sent events
ending in ``data: [DONE]`` or as one JSON body) and the development endpoints
``POST /collective_rpc`` and ``POST /reset_prefix_cache``, and ``GET /health``. ``kill`` ends it
as a killed process would (new connections refused, open ones cut without an answer),
``revive`` starts it again on its port; a cleared ``hold`` stalls completions and ``/health``
both, as a hung server would. The "completion" is scripted: the
tokens in ``FakeVllm.completion`` (cut after the first of the request's ``stop_token_ids`` and
at ``max_tokens``), with log-prob ``-0.1 * (i + 1)`` for the i-th token. Every request body is
kept in ``FakeVllm.requests`` for the tests to inspect.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeVllm:
    def __init__(
        self,
        *,
        model: str = "policy",
        max_model_len: int = 64,
        journal: list[tuple[str, str]] | None = None,
    ) -> None:
        self.model = model
        self.logprob_step = 0.1  # the i-th token's log-prob is -logprob_step * (i + 1)
        # (url, path) of every request, in arrival order; shared by fakes to see their order
        self.journal = journal if journal is not None else []
        self.max_model_len = max_model_len
        self.completion: list[int] = [11, 12, 13, 14, 15, 16]
        self.requests: list[tuple[str, Any]] = []
        self.chunk_delay_s = 0.0
        self.hold = threading.Event()  # cleared: /v1/completions waits before answering
        self.hold.set()
        self.stall_health = False  # True: /health waits on ``hold`` too (a hung server)
        self.dead = False
        # runtime LoRA loading on (as with --enable-lora): the LoRA names it holds, no weights
        self.lora = False
        self.loras: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def __enter__(self) -> FakeVllm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.dead:
            self._server.shutdown()
            self._server.server_close()

    def kill(self) -> None:
        """End as a killed server: refuse connections, cut the open ones without an answer."""
        self.dead = True
        self._server.shutdown()
        self._server.server_close()

    def revive(self) -> None:
        """Serve again on the same port (a relaunched server)."""
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self.dead = False
        self.loras = set()  # a relaunched server holds no adapter
        self._thread.start()

    def _wait_hold(self) -> bool:
        """Wait while ``hold`` is clear; False when the server died meanwhile."""
        deadline = time.monotonic() + 30
        while not self.hold.wait(0.02) and time.monotonic() < deadline:
            if self.dead:
                return False
        return not self.dead

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    def _answer(self, body: dict[str, Any]) -> tuple[list[int], list[float], str, int | None]:
        ids: list[int] = []
        reason, stop_reason = "length", None
        for token in self.completion:
            if len(ids) == body["max_tokens"]:
                break
            ids.append(token)
            if token in body.get("stop_token_ids", []):
                reason, stop_reason = "stop", token
                break
        values = [round(-self.logprob_step * (i + 1), 6) for i in range(len(ids))]
        return ids, values, reason, stop_reason

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _json(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client went away (or was cut)
                    self.wfile.write(data)

            def _cut(self) -> None:
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

            def do_GET(self) -> None:
                fake.requests.append((self.path, None))
                fake.journal.append((fake.url, self.path))
                if self.path == "/health":
                    if fake.stall_health and not fake._wait_hold():
                        self._cut()
                        return
                    self._json(200, {})
                    return
                if self.path != "/v1/models":
                    self._json(404, {"detail": "Not Found"})
                    return
                card = {
                    "id": fake.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "root": "/ckpt/policy",
                    "parent": None,
                    "max_model_len": fake.max_model_len,
                }
                self._json(200, {"object": "list", "data": [card]})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                fake.requests.append((self.path.split("?")[0], body))
                fake.journal.append((fake.url, self.path.split("?")[0]))
                if self.path in ("/collective_rpc", "/reset_prefix_cache"):
                    self._json(200, {"results": [None]} if body else {})
                elif self.path == "/v1/completions":
                    if not fake._wait_hold():
                        self._cut()  # killed while it held the request: no answer
                        return
                    self._complete(body or {})
                elif fake.lora and self.path == "/v1/load_lora_adapter":
                    name = (body or {})["lora_name"]
                    if name in fake.loras:
                        self._json(400, {"error": {"message": f"{name!r} already loaded"}})
                    else:
                        fake.loras.add(name)
                        self._json(200, {})
                elif fake.lora and self.path == "/v1/unload_lora_adapter":
                    fake.loras.discard((body or {})["lora_name"])
                    self._json(200, {})
                else:
                    self._json(404, {"detail": "Not Found"})

            def _complete(self, body: dict[str, Any]) -> None:
                prompt = body["prompt"]
                if len(prompt) + body["max_tokens"] > fake.max_model_len:
                    message = (
                        f"This model's maximum context length is {fake.max_model_len} tokens. "
                        f"However, you requested {len(prompt) + body['max_tokens']} tokens."
                    )
                    self._json(
                        400,
                        {
                            "error": {
                                "message": message,
                                "type": "BadRequestError",
                                "param": None,
                                "code": 400,
                            }
                        },
                    )
                    return
                ids, logprobs, reason, stop_reason = fake._answer(body)
                base = {"id": "cmpl-fake", "created": int(time.time()), "model": fake.model}

                def logprob_block(tokens: list[int], values: list[float], offset: int) -> dict:
                    names = [f"token_id:{t}" for t in tokens]
                    return {
                        "text_offset": list(range(offset, offset + len(tokens))),
                        "token_logprobs": values,
                        "tokens": names,
                        "top_logprobs": [{n: v} for n, v in zip(names, values, strict=True)],
                    }

                if not body.get("stream"):
                    choice = {
                        "index": 0,
                        "text": "x" * len(ids),
                        "logprobs": logprob_block(ids, logprobs, 0),
                        "finish_reason": reason,
                        "stop_reason": stop_reason,
                        "token_ids": ids,
                        "prompt_token_ids": prompt,
                    }
                    usage = {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(ids),
                        "total_tokens": len(prompt) + len(ids),
                    }
                    self._json(
                        200,
                        {**base, "object": "text_completion", "choices": [choice], "usage": usage},
                    )
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                for i, (token, value) in enumerate(zip(ids, logprobs, strict=True)):
                    if fake.dead or not fake._wait_hold():
                        self._cut()  # killed mid-stream
                        return
                    last = i == len(ids) - 1
                    choice = {
                        "index": 0,
                        "text": "x",
                        "logprobs": logprob_block([token], [value], i),
                        "finish_reason": reason if last else None,
                        "stop_reason": stop_reason if last else None,
                        "token_ids": [token],
                    }
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                    chunk = {**base, "object": "text_completion", "choices": [choice]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(fake.chunk_delay_s)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler
