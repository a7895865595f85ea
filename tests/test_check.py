"""`legorl check`: every check passes on a good setup, and each failure mode, broken on purpose,
is reported with its reason and fix (missing model, bad template, engine down, Docker down,
invalid tasks, missing harness, disk budget, a trainer that scores other weights)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.check import (
    CheckResult,
    ConfigError,
    RunConfig,
    check_disk,
    check_docker,
    check_engine,
    check_fidelity,
    check_harness,
    check_model,
    check_proxy,
    check_sandbox,
    check_tasks,
    check_template,
    load_config,
    run_checks,
)

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
TASKS = ROOT / "fixtures" / "tasks" / "train.jsonl"


def legorl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        capture_output=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1", **(env or {})},
    )


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def model_copy(tmp_path: Path, template: str | None = None) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(MODEL, dest)
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    return dest


# ---- the configuration -------------------------------------------------------------------------


def test_config_from_json_and_yaml_with_relative_paths(tmp_path: Path) -> None:
    data = {
        "model": "models/tiny",
        "engine": "forced",
        "engine_options": {"dtype": "float32"},
        "harnesses": ["mini", "claude-code"],
        "tasks": "tasks/train.jsonl",
        "sandbox": "docker",
        "images": ["legorl-base:1"],
        "disk_budget_gb": 2,
    }
    (tmp_path / "run.json").write_text(json.dumps(data))
    cfg = load_config(tmp_path / "run.json")
    assert cfg.model == str(tmp_path / "models" / "tiny")
    assert cfg.tasks == str(tmp_path / "tasks" / "train.jsonl")
    assert cfg.workdir == str(tmp_path / "runs")  # the default, relative to the file too
    assert cfg.harnesses == ["mini", "claude-code"] and cfg.disk_budget_gb == 2.0
    yaml_text = "\n".join(f"{k}: {json.dumps(v)}" for k, v in data.items())
    (tmp_path / "run.yaml").write_text(yaml_text)
    assert load_config(tmp_path / "run.yaml") == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"modle": "x"}', "unknown key(s) modle"),
        ('{"harnesses": [1]}', "harnesses: expected a list of strings"),
        ('{"disk_budget_gb": "big"}', "disk_budget_gb: expected a non-negative number"),
        ('{"sandbox": "vm"}', "sandbox: expected one of local, docker, none"),
        ('{"apis": ["grpc"]}', "apis: unknown grpc"),
        ("[1, 2]", "expected a mapping"),
        ("{", "malformed JSON"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)


def test_a_config_error_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"modle": "x"}')
    result = legorl("check", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.decode().startswith(f"legorl check: error: {path}: unknown key(s) modle")


# ---- a good setup ------------------------------------------------------------------------------


def test_everything_passes_on_a_good_setup() -> None:
    result = legorl(
        "check", "--model", str(MODEL), "--engine", "forced", "--tasks", str(TASKS),
        "--harness", "mini", "--api", "responses", "--sandbox", "none", "--dry-run", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    rows = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [r["name"] for r in rows] == [
        "model",
        "template",
        "engine",
        "proxy: openai_chat (mini)",
        "proxy: responses",
        "fidelity",
        "tasks",
        "harness: mini",
        "sandbox",
        "disk",
    ]
    statuses = {r["name"]: r["status"] for r in rows}
    assert statuses.pop("sandbox") == "skip"
    assert set(statuses.values()) == {"pass"}
    reasons = {r["name"]: r["reason"] for r in rows}
    assert "Qwen3ForCausalLM, vocab 3000" in reasons["model"]
    assert "2 tool calls and the text round-trip" in reasons["template"]
    assert reasons["tasks"] == "100 tasks from 14 repositories, all valid"
    assert "Pearson(prob) 1.000000 >= 0.99" in reasons["fidelity"]


def test_the_table_says_pass_and_fail_with_reason_and_fix(tmp_path: Path) -> None:
    good = legorl("check", "--model", str(MODEL), "--engine", "forced", "--sandbox", "none")
    out = good.stdout.decode()
    assert good.returncode == 0, out + good.stderr.decode()
    assert "✓ pass" in out and "all 8 checks passed or were skipped" in out
    bad = legorl("check", "--model", str(tmp_path / "nope"), "--sandbox", "none")
    out = bad.stdout.decode()
    assert bad.returncode == 1
    assert "✗ FAIL" in out and f"{tmp_path / 'nope'}: no such folder" in out
    assert "point --model" in out  # the fix
    assert "1 check(s) failed" in out
    assert legorl("check", "--model", str(tmp_path / "nope"), "--exit-zero").returncode == 0


def test_fidelity_with_the_embedded_engine_in_bf16_still_passes() -> None:
    cfg = RunConfig(model=str(MODEL), engine="embedded", engine_options={"dtype": "bfloat16"})

    async def go() -> CheckResult:
        result, engine = await check_engine(cfg)
        assert result.status == "pass", result
        try:
            return await check_fidelity(cfg, engine)
        finally:
            await engine.close()

    fidelity = asyncio.run(go())
    assert fidelity.status == "pass", fidelity
    assert "dry-run train" in fidelity.reason and "over 128 loss tokens" in fidelity.reason


def test_the_proxy_answers_every_api_shape_each_harness_speaks() -> None:
    cfg = RunConfig(
        model=str(MODEL),
        engine="forced",
        harnesses=["mini", "claude-code", "opencode", "openhands-sdk"],
        apis=["responses", "anthropic"],
    )

    async def go() -> list[CheckResult]:
        _, engine = await check_engine(cfg)
        try:
            return await check_proxy(cfg, engine)
        finally:
            await engine.close()

    results = asyncio.run(go())
    assert [(r.name, r.status) for r in results] == [
        ("proxy: openai_chat (mini, openhands-sdk)", "pass"),
        ("proxy: anthropic (claude-code)", "pass"),
        ("proxy: openai_chat (opencode)", "pass"),
        ("proxy: responses", "pass"),
    ]
    assert results[1].reason.startswith("streaming /v1/messages answered in its shape")
    assert results[0].reason.startswith("non-streaming /v1/chat/completions")


# ---- each failure mode, on purpose -------------------------------------------------------------


def test_missing_model_fails_and_skips_what_needs_it(tmp_path: Path) -> None:
    results = by_name(
        run_checks(
            RunConfig(model=str(tmp_path / "nope"), harnesses=[], sandbox="none"), dry_run=True
        )
    )
    assert results["model"].status == "fail"
    assert results["model"].reason == f"{tmp_path / 'nope'}: no such folder"
    assert "point --model" in results["model"].fix
    for name in ("template", "engine", "proxy", "fidelity"):
        assert results[name].status == "skip" and results[name].reason == "needs the model"
    assert results["tasks"].status == "skip"  # none configured


def test_model_folder_without_weights_or_tokenizer(tmp_path: Path) -> None:
    model = model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    assert check_model(str(model)).reason == f"{model}: no *.safetensors weights"
    (model / "tokenizer.json").unlink()
    assert check_model(str(model)).reason == f"{model}: missing tokenizer.json"
    (model / "model.safetensors").write_bytes(b"\x10\x00")
    shutil.copy(MODEL / "tokenizer.json", model / "tokenizer.json")
    assert "unreadable weights" in check_model(str(model)).reason


def test_a_template_whose_tool_calls_do_not_parse_back(tmp_path: Path) -> None:
    source = (MODEL / "chat_template.jinja").read_text()
    # A template that prints tool calls in a form the proxy's parser does not read.
    bad = source.replace('\'<tool_call>\\n{"name": "\'', '\'<function_call>\\n{"name": "\'')
    bad = bad.replace("'}\\n</tool_call>'", "'}\\n</function_call>'")
    assert bad != source
    result = check_template(str(model_copy(tmp_path, bad)))
    assert result.status == "fail"
    assert result.reason.startswith(
        "rendered 2 tool call(s) (bash, str_replace); the parser read back 0"
    )
    assert "<function_call>" in result.reason
    assert "<tool_call>" in result.fix
    # The same check through the whole preflight: the engine still runs, the run cannot start.
    results = by_name(
        run_checks(
            RunConfig(model=str(tmp_path / "model"), engine="forced", harnesses=[], sandbox="none")
        )
    )
    assert results["template"].status == "fail" and results["engine"].status == "pass"


def test_a_template_that_mangles_arguments(tmp_path: Path) -> None:
    source = (MODEL / "chat_template.jinja").read_text()
    bad = source.replace("{{- call.arguments | tojson }}", "{{- '{}' }}")
    assert bad != source
    result = check_template(str(model_copy(tmp_path, bad)))
    assert result.status == "fail" and "the parser read back 2 (bash, str_replace)" in result.reason


def test_a_template_without_eos_after_assistant_turns(tmp_path: Path) -> None:
    source = (MODEL / "chat_template.jinja").read_text()
    bad = source.replace(
        "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == 'tool' %}",
        "        {{- '\\n' }}\n    {%- elif message.role == 'tool' %}",
    )
    assert bad != source
    result = check_template(str(model_copy(tmp_path, bad)))
    assert result.status == "fail"
    assert result.reason == "the assistant turn does not end with '<|im_end|>'"
    assert "end with the eos token" in result.fix


def test_a_template_that_does_not_render(tmp_path: Path) -> None:
    result = check_template(str(model_copy(tmp_path, "{{ messages[0].content + }}")))
    assert result.status == "fail"
    assert result.reason.startswith("the chat template does not load:")


def test_an_engine_that_does_not_answer(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    cfg = RunConfig(
        model=str(MODEL),
        engine="vllm",
        engine_options={"base_url": f"http://127.0.0.1:{port}", "timeout_s": 5.0},
        harnesses=["mini"],
        sandbox="none",
    )
    results = by_name(run_checks(cfg))
    # The vllm row asks the server first; the engine and proxy rows then wait for it.
    assert results["vllm"].status == "fail"
    assert results["vllm"].reason.startswith(f"no vLLM server at http://127.0.0.1:{port}")
    assert "base_url" in results["vllm"].fix
    assert results["engine"].status == "skip" and results["engine"].reason == "needs vllm"
    assert results["proxy"].status == "skip" and results["proxy"].reason == "needs the engine"


def test_a_trainer_with_other_weights_fails_fidelity() -> None:
    cfg = RunConfig(model=str(MODEL), engine="embedded", trainer_model=str(MOE))

    async def go() -> CheckResult:
        _, engine = await check_engine(cfg)
        try:
            return await check_fidelity(cfg, engine)
        finally:
            await engine.close()

    result = asyncio.run(go())
    assert result.status == "fail"
    assert result.reason.startswith("dry-run train: Pearson(prob) ")
    assert "< 0.99 over 128 loss tokens" in result.reason
    assert "same checkpoint" in result.fix


def test_docker_down(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/no-docker.sock"
    result = check_sandbox("docker", docker_host=url)
    assert result.name == "sandbox: docker" and result.status == "fail"
    assert result.reason.startswith(f"cannot reach the Docker daemon at {url}: ")
    assert "dockerd" in result.fix and "--sandbox local" in result.fix
    cli = legorl("check", "--sandbox", "docker", "--docker-host", url, "--harness", "mini")
    assert cli.returncode == 1
    assert "cannot reach the Docker daemon" in cli.stdout.decode()


def _docker_up() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception:
        return False
    return True


def _need(ok: bool, what: str) -> None:
    """Fail under CI (which installs everything), skip elsewhere."""
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is missing (required under CI=true)")
        pytest.skip(f"{what} is missing")


def test_docker_up_but_an_image_missing() -> None:
    _need(_docker_up(), "a reachable Docker daemon")
    result = check_docker(images=["legorl-no-such-image:0"])
    assert result.status == "fail"
    assert "is up, but 1 image(s) are missing: legorl-no-such-image:0" in result.reason
    assert check_docker(images=[]).status == "pass"
    # Given tasks: each task's sandbox layers are present or buildable on first use.
    with_tasks = check_docker(images=[], tasks=str(TASKS))
    assert with_tasks.status == "pass", with_tasks
    assert re.search(r"task layers: \d+ of \d+ built", with_tasks.reason)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json\n", "{path}:1: malformed JSON"),
        (b'{"instance_id": "a"}\n', "{path}:1: instance a: "),
        (b"", "{path}: no tasks"),
    ],
)
def test_invalid_task_files(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(content)
    result = check_tasks(str(path))
    assert result.status == "fail", result
    assert result.reason.startswith(reason.format(path=path)), result.reason


def test_task_file_problems_beyond_the_schema(tmp_path: Path) -> None:
    lines = TASKS.read_bytes().splitlines()[:3]
    dup = tmp_path / "dup.jsonl"
    dup.write_bytes(b"\n".join([lines[0], lines[0], lines[1]]) + b"\n")
    result = check_tasks(str(dup))
    assert result.status == "fail" and result.reason.startswith("duplicate instance_id(s): ")
    moved = tmp_path / "moved.jsonl"  # beside no bundles: their sources are relative
    moved.write_bytes(b"\n".join(lines) + b"\n")
    result = check_tasks(str(moved))
    assert result.status == "fail"
    assert result.reason.startswith("3 task(s) name a repository that does not exist")
    assert (
        check_tasks(str(tmp_path / "none.jsonl")).reason
        == f"{tmp_path / 'none.jsonl'}: no such task file"
    )
    empty_f2p = json.loads(lines[0])
    empty_f2p["FAIL_TO_PASS"] = []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(empty_f2p) + "\n")
    assert "FAIL_TO_PASS" in check_tasks(str(bad)).reason


def test_harnesses_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = str(tmp_path)  # a PATH with nothing on it
    claude = check_harness("claude-code", path=empty)
    assert (claude.status, claude.reason) == ("fail", "claude is not on PATH")
    assert claude.fix == "npm install -g @anthropic-ai/claude-code"
    assert check_harness("opencode", path=empty).fix == "npm install -g opencode-ai"
    assert check_harness("mini", path=empty).reason == "python3 is not on PATH"
    unknown = check_harness("cursor")
    assert unknown.status == "fail" and "mini, claude-code, opencode, openhands-sdk" in unknown.fix
    assert "qwen-code, mini-swe-agent" in unknown.fix
    monkeypatch.setenv("LEGORL_OPENHANDS_PYTHON", str(tmp_path / "no-venv" / "python"))
    openhands = check_harness("openhands-sdk")
    assert openhands.status == "fail" and "no Python at" in openhands.reason
    assert "LEGORL_OPENHANDS_PYTHON" in openhands.fix
    # Without the SDK: a real interpreter that cannot import it.
    monkeypatch.setenv("LEGORL_OPENHANDS_PYTHON", sys.executable)
    assert "cannot import openhands.sdk" in check_harness("openhands-sdk").reason
    qwen = check_harness("qwen-code", path=empty)
    assert (qwen.status, qwen.reason) == ("fail", "qwen is not on PATH")
    assert qwen.fix == "npm install -g @qwen-code/qwen-code@0.24.4"
    monkeypatch.setenv("LEGORL_MINISWE_PYTHON", str(tmp_path / "no-venv" / "python"))
    miniswe = check_harness("mini-swe-agent")
    assert miniswe.status == "fail" and "no Python at" in miniswe.reason
    assert "pip install mini-swe-agent==2.4.6" in miniswe.fix
    monkeypatch.setenv("LEGORL_MINISWE_PYTHON", sys.executable)  # a Python without it
    assert "cannot import minisweagent" in check_harness("mini-swe-agent").reason
    # In Docker the harness comes from the image, not the host.
    assert check_harness("claude-code", "docker", path=empty).status == "skip"
    assert check_harness("mini").status == "pass"


def test_an_installed_harness_reports_its_version() -> None:
    _need(shutil.which("claude") is not None, "Claude Code")
    result = check_harness("claude-code")
    assert result.status == "pass" and "Claude Code" in result.reason


def test_local_sandbox() -> None:
    _need(shutil.which("bwrap") is not None, "bubblewrap")
    result = check_sandbox("local")
    assert result.status == "pass", result


def test_disk_budget(tmp_path: Path) -> None:
    assert check_disk(str(tmp_path / "not" / "yet"), 0.001).status == "pass"
    result = check_disk(str(tmp_path / "not" / "yet"), 1e9)
    assert result.status == "fail"
    assert result.reason.endswith(f"GB free at {tmp_path}, the budget is 1e+09 GB")
    assert "lower disk_budget_gb" in result.fix
