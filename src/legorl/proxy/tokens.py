"""The proxy's tokenizer and chat template: full renders for a segment's first call, and
incremental renders of only the new messages for every later call.

The template is compiled once with Jinja (no transformers import on the serving path). An
incremental render is the template's own text for ``[anchor…] + new`` minus its text for
``[anchor…]``, where the anchor is a constant user → assistant exchange: so every template rule
that looks at the previous message (tool-result grouping, turn openers) still applies, and the
cost depends on the new messages only, never on the history.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import Any

from legorl.proxy.chat import Message, Tool

_ANCHOR = [
    {"role": "user", "content": "legorl-anchor-user"},
    {"role": "assistant", "content": "legorl-anchor-assistant"},
]


class PromptTooLong(ValueError):
    """A text that holds at least ``tokens`` tokens, past ``limit``: known before encoding it."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"at least {tokens} tokens, past {limit}")
        self.tokens, self.limit = tokens, limit


class TemplateError(ValueError):
    """The chat template cannot render incrementally (its renders are not prefix-stable)."""


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kw: Any) -> str:
    # The `tojson` chat templates expect (as Hugging Face's): no HTML escaping, key order kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


class ChatTokenizer:
    """Tokenizer + chat template of one model folder (``tokenizer.json`` and a Jinja template)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        tok_file = self.model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model folder")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        config = self._json("tokenizer_config.json")
        template = config.get("chat_template")
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if not isinstance(template, str):
            raise ValueError(f"{self.model_dir}: no chat template (chat_template.jinja)")
        self.template_source = template
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        gen = self._json("generation_config.json")
        eos_ids = gen.get("eos_token_id")
        self.eos_id: int
        eos_by_name = self.tokenizer.token_to_id(eos) if isinstance(eos, str) else None
        if eos_by_name is not None:
            self.eos_id = eos_by_name
        elif isinstance(eos_ids, int):
            self.eos_id = eos_ids
        elif isinstance(eos_ids, list) and eos_ids:
            self.eos_id = int(eos_ids[0])
        else:
            raise ValueError(f"{self.model_dir}: no eos token in tokenizer_config.json")
        added = [t for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self._special_by_text: dict[str, int] = {
            t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self.special_ids = set(self._special_by_text.values())
        # The tokenizer cuts special tokens out before anything else, so the pieces between them
        # encode independently; long pieces (a harness's system prompt and tool schemas) repeat
        # across sessions and are encoded once. Only sound when no special token eats the
        # whitespace around it.
        self._pieces_exact = all(not (t.lstrip or t.rstrip or t.single_word) for t in added)
        self._split = re.compile(
            "("
            + "|".join(re.escape(t.content) for t in sorted(added, key=lambda t: -len(t.content)))
            + ")"
        )
        self._piece_cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_lock = threading.Lock()  # the proxy encodes in worker threads
        #: Texts that must hold fewer tokens than this (the proxy's: the model's context) are
        #: refused before they are encoded where a bound shows they cannot (``at_least``).
        self.limit: int | None = None
        self._template = self._compile(template)
        eos_text = self.tokenizer.id_to_token(self.eos_id)
        if eos_text is None:
            raise ValueError(
                f"{self.model_dir}: eos token id {self.eos_id} is not in the vocabulary"
            )
        self.eos_text: str = eos_text
        # Fail at load, not at the first continuation, when the template cannot split.
        self._split_after_anchor(
            self.render(
                [*_ANCHOR, {"role": "user", "content": "x"}], None, add_generation_prompt=True
            )
        )

    def _json(self, name: str) -> dict[str, Any]:
        path = self.model_dir / name
        return json.loads(path.read_text()) if path.is_file() else {}

    @staticmethod
    def _compile(source: str) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        # The same environment options Hugging Face tokenizers compile chat templates with.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        return env.from_string(source)

    # ---- rendering ----------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
    ) -> str:
        return str(
            self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
            )
        )

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's ids of ``text``. A long text goes through ``encode_batch``, which
        lets go of the GIL while it runs: the proxy encodes in worker threads, and a prompt of
        megabytes must not hold its event loop (round 72: 30 MB held it 79 s, and another
        sandbox's command timed out)."""
        if len(text) < 1024:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of (normalized) text one token stands for, where the tokenizer
        bounds it: a BPE with no unknown token (byte-level, as causal models have) covers the
        text with its vocabulary's pieces, none longer than the longest (a mapped byte counts
        as its UTF-8 form, which is never shorter). None for other models (WordPiece's unknown
        token stands for a whole word; a BPE's may fuse)."""
        model = self.tokenizer.model
        if type(model).__name__ != "BPE" or getattr(model, "unk_token", None) is not None:
            return None
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(len(piece.encode("utf-8")) for piece in vocab)

    def at_least(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, in time linear in its length and far less
        memory than encoding it (round 73: encoding takes about 170 bytes a byte of text)."""
        most = self.max_token_bytes
        if most is None:
            return 0
        normalizer = self.tokenizer.normalizer
        normal = normalizer.normalize_str(text) if normalizer is not None else text
        return -(-len(normal.encode("utf-8", "surrogatepass")) // most)

    def _check_limit(self, text: str) -> None:
        limit, most = self.limit, self.max_token_bytes
        # A text of n characters is at most 4n bytes: only one that long can be over the bound.
        if limit is None or most is None or 4 * len(text) < limit * most:
            return
        if (lower := self.at_least(text)) >= limit:
            raise PromptTooLong(lower, limit)

    def encode(self, text: str) -> list[int]:
        self._check_limit(text)
        if not self._pieces_exact or len(text) < 2048:
            return self._encode(text)
        out: list[int] = []
        cache = self._piece_cache
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._special_by_text.get(piece)
            if special is not None:
                out.append(special)
                continue
            if len(piece) < 1024:
                out.extend(self._encode(piece))
                continue
            with self._cache_lock:
                ids = cache.get(piece)
                if ids is not None:
                    cache.move_to_end(piece)
            if ids is None:
                ids = self._encode(piece)
                with self._cache_lock:
                    cache[piece] = ids
                    if len(cache) > 64:
                        cache.popitem(last=False)
            out.extend(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def full_prompt(self, messages: list[Message], tools: list[Tool]) -> list[int]:
        """Token ids of a whole conversation, ending with the generation prompt."""
        text = self.render(
            [m.template_dict() for m in messages],
            [t.template_dict() for t in tools],
            add_generation_prompt=True,
        )
        return self.encode(text)

    def count(self, messages: list[Message], tools: list[Tool]) -> int:
        """Exact prompt size of a conversation (no generation prompt), for count_tokens."""
        text = self.render(
            [m.template_dict() for m in messages],
            [t.template_dict() for t in tools],
            add_generation_prompt=False,
        )
        self._check_limit(text)
        return len(self._encode(text))

    def _split_after_anchor(self, text: str) -> int:
        """Where the anchor assistant turn's end-of-turn token ends in ``text``."""
        at = text.find(_ANCHOR[1]["content"])
        end = text.find(self.eos_text, at) if at >= 0 else -1
        if end < 0:
            raise TemplateError(
                "the chat template does not end assistant turns with the eos token "
                f"{self.eos_text!r}: incremental rendering needs it"
            )
        return end + len(self.eos_text)

    def continuation(self, new: list[Message], *, completion_ended: bool) -> list[int]:
        """Tokens that follow a sampled completion: the template's glue after the assistant
        turn, the new messages, and the generation prompt."""
        full = self.render(
            _ANCHOR + [m.template_dict() for m in new], None, add_generation_prompt=True
        )
        rest = full[self._split_after_anchor(full) :]
        return self.encode(rest if completion_ended else self.eos_text + rest)

    @cached_property
    def stop_ids(self) -> list[int]:
        return [self.eos_id]
