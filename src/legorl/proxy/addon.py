"""The mitmproxy addon behind `legorl proxy intercept`: harnesses whose API host cannot be
changed reach the engine through ``HTTPS_PROXY``.

    legorl proxy intercept --model fixtures/models/tiny-qwen3 --port 8080 --out runs/turns
    HTTPS_PROXY=http://127.0.0.1:8080 NODE_EXTRA_CA_CERTS=~/.local/share/legorl/mitmproxy/mitmproxy-ca-cert.pem claude -p …

Calls to the API hosts (api.anthropic.com, api.openai.com, Google's
generativelanguage.googleapis.com) are answered by `ProxyCore`, never
forwarded; the session is the API key the harness sends. Every other host is refused unless
``allow_hosts`` names it.

mitmproxy sends a response an addon makes itself in one piece, so API calls are not answered
in the ``request`` hook: they are re-pointed at a `ProxyServer` on an ephemeral loopback port in
this process, serving the same core, and ``responseheaders`` turns on mitmproxy's response
streaming for them. A streamed answer (SSE) so reaches the harness event by event, as the engine
samples, exactly as `legorl proxy serve` sends it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from legorl.proxy.core import ProxyCore

if TYPE_CHECKING:
    from mitmproxy import http

    from legorl.proxy.server import ProxyServer

API_HOSTS = frozenset({"api.anthropic.com", "api.openai.com", "generativelanguage.googleapis.com"})


class LegorlAddon:
    """One class with mitmproxy's event hooks; the work is done by the shared core."""

    def __init__(self, core: ProxyCore, allow_hosts: tuple[str, ...] = ()) -> None:
        self.core = core
        self.allow_hosts = set(allow_hosts)
        self.refused = 0
        self._server: ProxyServer | None = None
        self._starting = asyncio.Lock()

    def load(self, loader: Any) -> None:
        loader.add_option(
            "legorl_allow_hosts",
            str,
            ",".join(sorted(self.allow_hosts)),
            "Comma-separated hosts passed through untouched (all others are refused).",
        )

    def configure(self, updated: set[str]) -> None:
        if "legorl_allow_hosts" in updated:
            from mitmproxy import ctx

            value = ctx.options.legorl_allow_hosts
            self.allow_hosts = {h.strip() for h in value.split(",") if h.strip()}

    def _allowed(self, host: str) -> bool:
        return host in API_HOSTS or host in self.allow_hosts

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if not self._allowed(flow.request.pretty_host):
            self._refuse(flow)

    async def request(self, flow: http.HTTPFlow) -> None:
        host = flow.request.pretty_host
        if host not in API_HOSTS:
            if not self._allowed(host):
                self._refuse(flow)
            return
        port = await self._loopback_port()
        flow.metadata["legorl_api_host"] = host
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = port

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "legorl_api_host" in flow.metadata and flow.response is not None:
            flow.response.stream = True

    async def done(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None

    async def _loopback_port(self) -> int:
        async with self._starting:
            if self._server is None:
                from legorl.proxy.server import ProxyServer

                server = ProxyServer(self.core, "127.0.0.1", 0)
                await server.start()
                self._server = server
            return self._server.port

    def _refuse(self, flow: http.HTTPFlow) -> None:
        from mitmproxy import http

        self.refused += 1
        flow.response = http.Response.make(
            403,
            f"legorl: {flow.request.pretty_host} is not an API host and not allowed "
            "(--allow-host)\n".encode(),
            {"content-type": "text/plain"},
        )


def make_master(
    core: ProxyCore,
    *,
    host: str,
    port: int,
    confdir: str,
    allow_hosts: tuple[str, ...] = (),
) -> Any:
    """A mitmproxy DumpMaster in regular (forward-proxy) mode with the legorl addon."""
    from mitmproxy import options
    from mitmproxy.tools.dump import DumpMaster

    opts = options.Options(listen_host=host, listen_port=port, confdir=confdir)
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    # Lazy connections and no upstream certificate: mitmproxy must never reach out to the real
    # API hosts (there may be no route to them at all) before the addon answers.
    opts.update(connection_strategy="lazy", upstream_cert=False)
    master.addons.add(LegorlAddon(core, allow_hosts))
    return master


async def run_intercept(
    core: ProxyCore,
    *,
    host: str,
    port: int,
    confdir: str,
    allow_hosts: tuple[str, ...] = (),
) -> None:
    """Run the interception proxy until cancelled."""
    master = make_master(core, host=host, port=port, confdir=confdir, allow_hosts=allow_hosts)
    await master.run()
