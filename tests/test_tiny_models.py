"""Checks of the tiny offline models built by `fixtures/make_models.py`.

* The committed files in `fixtures/models/` are reproducible by the script.
* The tokenizer keeps special and tag tokens whole and round-trips text.
* Sampled tokens' log-probs from `generate` match a single teacher-forced forward pass, and
  the models are peaky enough for that comparison to mean something.
* The Qwen3-style chat template behaves like Qwen3's where it matters for RL on agent traces:
  re-rendering a conversation does not reproduce the tokens the model generated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "fixtures" / "make_models.py"
MODELS = ROOT / "fixtures" / "models"
MODEL_NAMES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-moe-hd32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODELS / "tiny-qwen3")


def render(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def render_ids(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any
) -> list[int]:
    return encode(tok, render(tok, messages, **kwargs))


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- reproducibility


def test_script_rebuilds_committed_models(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different hash seed must not matter
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=180,
        capture_output=True,
    )
    assert (tmp_path / "README.md").read_bytes() == (MODELS / "README.md").read_bytes()
    for name in MODEL_NAMES:
        new, old = tmp_path / name, MODELS / name
        assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
        for fname in TOKENIZER_FILES:
            assert (new / fname).read_bytes() == (old / fname).read_bytes(), f"{name}/{fname}"
            # Both models share one tokenizer.
            assert (old / fname).read_bytes() == (MODELS / MODEL_NAMES[0] / fname).read_bytes()
        for fname in ("config.json", "generation_config.json"):
            new_cfg = json.loads((new / fname).read_text())
            old_cfg = json.loads((old / fname).read_text())
            # The only field that may legitimately change when transformers is upgraded.
            new_cfg.pop("transformers_version", None)
            old_cfg.pop("transformers_version", None)
            assert new_cfg == old_cfg, f"{name}/{fname}"
        new_weights = load_file(new / "model.safetensors")
        old_weights = load_file(old / "model.safetensors")
        assert new_weights.keys() == old_weights.keys()
        for key, tensor in old_weights.items():
            assert tensor.dtype == torch.float32, key
            assert torch.equal(new_weights[key], tensor), f"{name}: {key}"
        assert (old / "model.safetensors").stat().st_size < 5_000_000


# --------------------------------------------------------------------------- tokenizer


def test_special_and_tag_tokens_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == 3000
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    ids = set()
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        encoded = encode(tokenizer, token)
        assert len(encoded) == 1, token
        assert tokenizer.convert_ids_to_tokens(encoded[0]) == token
        ids.add(encoded[0])
    assert len(ids) == len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    # Tags are not special: they survive skip_special_tokens, unlike the ChatML markers.
    chat_ids = encode(tokenizer, "<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    assert (
        tokenizer.decode(chat_ids, skip_special_tokens=True)
        == "assistant\n<think>\nhm\n</think>\n\nok"
    )


def test_round_trip(tokenizer: PreTrainedTokenizerBase) -> None:
    text = (
        'def load(path: str) -> dict:\n    """Read JSON."""\n\treturn json.load(open(path))\n'
        "$ grep -rn 'TODO' src/ | head -n 5\n"
        '{"name": "bash", "arguments": {"command": "ls -la"}}\n'
        "Café Zürich 東京 данные 🚀  trailing spaces   \r\n"
    )
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    # The tokenizer learned something: common code text is far shorter than its byte count.
    assert len(ids) < len(text.encode()) / 2


# --------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_generate_logprobs_match_forward_pass(
    name: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "List the files in src/ and explain them."}]
    prompt = torch.tensor([render_ids(tokenizer, messages, add_generation_prompt=True)])
    n_prompt = prompt.shape[1]

    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=20,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
    completion = out.sequences[0, n_prompt:]
    raw = torch.stack(out.logits)[:, 0, :].float()
    # Nothing may have altered the distribution that was sampled from.
    assert torch.equal(raw, torch.stack(out.scores)[:, 0, :].float())
    assert len(completion) == len(raw) >= 10
    gen_logprobs = raw.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)

    with torch.no_grad():
        logits = model(out.sequences).logits[0, n_prompt - 1 : -1].float()
    fwd_logprobs = logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)

    gen_probs, fwd_probs = gen_logprobs.exp(), fwd_logprobs.exp()
    pearson = torch.corrcoef(torch.stack([gen_probs, fwd_probs]))[0, 1].item()
    max_delta = (gen_logprobs - fwd_logprobs).abs().max().item()
    print(f"{name}: pearson={pearson:.8f} max|dlogp|={max_delta:.2e} probs={gen_probs.tolist()}")
    assert pearson >= 0.9999
    assert max_delta < 1e-4

    # Spread check: a near-uniform model (every p ~ 1/3000) would make the above vacuous.
    assert gen_probs.max().item() > 0.1
    assert gen_probs.max().item() / gen_probs.min().item() > 100
    entropy = -(raw.softmax(-1) * raw.log_softmax(-1)).sum(-1).mean().item()
    assert entropy < 0.7 * torch.log(torch.tensor(float(len(tokenizer)))).item()


# --------------------------------------------------------------------------- chat template


def test_reasoning_of_earlier_turns_is_dropped(tokenizer: PreTrainedTokenizerBase) -> None:
    user1 = {"role": "user", "content": "What is in src/?"}
    reasoning, answer = "I should look at the folder.", "It holds the package."
    assistant1 = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    user2 = {"role": "user", "content": "And tests/?"}

    prompt1 = render_ids(tokenizer, [user1], add_generation_prompt=True)
    generated = encode(tokenizer, f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>")
    turn1 = prompt1 + generated

    # While turn 1 is the last assistant turn, it keeps its <think> block: re-rendering
    # reproduces the generated tokens exactly.
    history1 = render_ids(tokenizer, [user1, assistant1])
    assert history1[: len(turn1)] == turn1

    # Reasoning given inline in the content is parsed out the same way.
    inline = {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}
    assert render_ids(tokenizer, [user1, inline]) == history1

    # Once a new user query follows, turn 1's reasoning is dropped, so the tokens the model
    # actually generated in turn 1 are NOT a prefix of the turn-2 prompt.
    text2 = render(tokenizer, [user1, assistant1, user2], add_generation_prompt=True)
    assert reasoning not in text2
    assert "<think>" not in text2
    assert f"<|im_start|>assistant\n{answer}<|im_end|>\n" in text2
    prompt2 = encode(tokenizer, text2)
    assert prompt2[: len(prompt1)] == prompt1
    assert prompt2[: len(turn1)] != turn1


def test_reasoning_is_kept_across_tool_results(tokenizer: PreTrainedTokenizerBase) -> None:
    # Tool results come back as user turns, but they are not user queries: the reasoning of
    # the assistant turn that called the tool stays, as in Qwen3's multi-step tool use.
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Run the tests."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "pytest is the runner.",
            "tool_calls": [{"name": "bash", "arguments": {"command": "pytest -q"}}],
        },
        {"role": "tool", "content": "3 passed"},
    ]
    text = render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
    assert "<think>\npytest is the runner.\n</think>\n\n<tool_call>\n" in text


def test_tool_call_is_reprinted_not_echoed(tokenizer: PreTrainedTokenizerBase) -> None:
    user = {"role": "user", "content": "List the files."}
    reasoning = "I will use bash."
    call_json = '{"name":"bash","arguments":{"command":"ls -la","timeout":5}}'
    emitted = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call_json}\n</tool_call>"
    prompt1 = render_ids(tokenizer, [user], tools=TOOLS, add_generation_prompt=True)
    turn1 = prompt1 + encode(tokenizer, emitted + "<|im_end|>")

    def history(arguments: dict[str, Any] | str) -> str:
        assistant = {
            "role": "assistant",
            "content": "",
            "reasoning_content": reasoning,
            "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": arguments}}
            ],
        }
        return render(tokenizer, [user, assistant], tools=TOOLS)

    # The harness parses the call and the template re-prints it with json.dumps separators.
    parsed = json.loads(call_json)["arguments"]
    text = history(parsed)
    assert (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la", "timeout": 5}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert call_json not in text
    ids = encode(tokenizer, text)
    assert ids[: len(prompt1)] == prompt1
    assert ids[: len(turn1)] != turn1

    # A harness that rebuilds the arguments in another key order gets that order.
    text = history({"timeout": 5, "command": "ls -la"})
    assert '"arguments": {"timeout": 5, "command": "ls -la"}}' in text

    # Arguments given as a JSON string are printed verbatim; only the name part is re-spaced.
    text = history('{"command":"ls -la","timeout":5}')
    assert '{"name": "bash", "arguments": {"command":"ls -la","timeout":5}}' in text
    assert encode(tokenizer, text)[: len(turn1)] != turn1


def test_tools_tool_results_and_generation_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Look around."},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"name": "bash", "arguments": {"command": "ls"}},
                {"name": "read_file", "arguments": {"path": "README.md"}},
            ],
        },
        {"role": "tool", "content": "README.md\nsrc"},
        {"role": "tool", "content": "# legorl"},
    ]
    text = render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)

    # Tools are listed in the system turn, merged with the system message, one JSON a line.
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    tools_block = "<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>"
    assert tools_block in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' in text

    # Assistant text, then each call on its own line.
    assert (
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>'
        "<|im_end|>\n"
    ) in text

    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\nREADME.md\nsrc\n</tool_response>\n"
        "<tool_response>\n# legorl\n</tool_response><|im_end|>\n"
    ) in text
    assert text.count("<|im_start|>user") == 2

    # add_generation_prompt only appends the assistant header.
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert text == render(tokenizer, messages, tools=TOOLS) + "<|im_start|>assistant\n"
    header = encode(tokenizer, "<|im_start|>assistant\n")
    assert header[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert encode(tokenizer, text)[-len(header) :] == header

    # Without tools the system message is rendered on its own.
    plain = render(tokenizer, messages[:2])
    assert plain == (
        "<|im_start|>system\nYou are a coding agent.<|im_end|>\n"
        "<|im_start|>user\nLook around.<|im_end|>\n"
    )
