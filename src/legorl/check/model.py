"""The model folder and its chat template."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from legorl.check.results import CheckResult, _fail, _pass, _short

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
