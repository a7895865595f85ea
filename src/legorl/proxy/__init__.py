"""The token-faithful LLM proxy: `legorl proxy serve` (HTTP server) and `legorl proxy intercept`
(mitmproxy addon) over one core (`core.py`): wire formats (`wire/`), token bookkeeping
(`session.py`, `tokens.py`), output parsing (`parse.py`)."""
