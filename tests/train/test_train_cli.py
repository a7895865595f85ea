"""`legorl train` as a command: stdin and files, metrics on stdout or --metrics, --dry-run,
one-line errors for bad samples and config, and --push to a real proxy."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import orjson
import pytest
from train_helpers import MODEL, ROOT, legorl, load_weights, make_samples

from legorl.records import Metric, Sample, read_jsonl, to_json, write_jsonl


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("samples") / "samples.jsonl"
    write_jsonl(path, make_samples(groups=2, group_size=4, segments=2, n_new=6))
    return path


def metrics_of(data: bytes) -> list[Metric]:
    return [r for r in read_jsonl(_stream(data), Metric)]


def _stream(data: bytes):
    import io

    return io.BytesIO(data)


def test_stdin_to_checkpoint_with_metrics_on_stdout(samples_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    result = legorl(
        "train",
        "--model",
        str(MODEL),
        "--out",
        str(out),
        "lr=1e-3",
        stdin=samples_file.read_bytes(),
    )
    assert result.returncode == 0, result.stderr.decode()
    metrics = metrics_of(result.stdout)
    names = {m.name for m in metrics}
    assert {"rollout_trainer_pearson", "grad_norm", "loss", "updated"} <= names
    assert (out / "model.safetensors").is_file() and (out / "train_config.yaml").is_file()
    err = result.stderr.decode()
    assert "16 samples, 8 episodes in 2 groups" in err and "checkpoint:" in err
    assert "Loading weights" not in err  # no library progress bars in the human output


def test_files_config_and_metrics_file(samples_file: Path, tmp_path: Path) -> None:
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("algorithm: grpo\nlr: 1e-3\ncorrection: token_mask\n")
    metrics = tmp_path / "metrics.jsonl"
    result = legorl(
        "train",
        str(samples_file),
        "--model",
        str(MODEL),
        "--out",
        str(tmp_path / "ckpt"),
        "--config",
        str(run_yaml),
        "--steps",
        "2",
        "--metrics",
        str(metrics),
        "micro_batch_tokens=40",
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b""
    got = list(read_jsonl(metrics, Metric))
    assert {m.step for m in got} == {1, 2}
    saved = (tmp_path / "ckpt" / "train_config.yaml").read_text()
    assert "algorithm: grpo" in saved and "micro_batch_tokens: 40" in saved
    assert "correction: token_mask" in saved and "steps: 2" in saved


def test_dry_run_writes_metrics_and_no_checkpoint(samples_file: Path, tmp_path: Path) -> None:
    result = legorl("train", str(samples_file), "--model", str(MODEL), "--dry-run")
    assert result.returncode == 0, result.stderr.decode()
    metrics = {m.name: m.value for m in metrics_of(result.stdout)}
    assert metrics["updated"] == 0.0 and metrics["rollout_trainer_pearson"] > 0.999
    assert "dry run" in result.stderr.decode()


def _edit(samples_file: Path, tmp_path: Path, edit) -> Path:
    lines = [orjson.loads(x) for x in samples_file.read_bytes().splitlines()]
    edit(lines)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def _set(i: int, **fields):
    def edit(lines: list[dict]) -> None:
        lines[i].update(fields)

    return edit


def _drop(i: int):
    def edit(lines: list[dict]) -> None:
        del lines[i]

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_set(2, loss_mask=[0] * 40), "bad.jsonl:3: loss_mask: has 40 entries for"),
        (_set(0, rollout_logprobs=[]), "bad.jsonl:1: rollout_logprobs: has 0 values for 6"),
        (_set(1, reward=0.5), "sample 'g0-e0/1' (episode 'g0-e0'): reward 0.5 differs from"),
        (_drop(3), "sample 'g0-e1/0' (episode 'g0-e1'): episode has 2 segments but segment(s) 1"),
        (
            _set(5, input_ids=[99999] + [5] * 13, loss_mask=[0] * 8 + [1] * 6),
            "sample 'g0-e2/1' (episode 'g0-e2'): token id 99999 is outside",
        ),
        (
            _set(4, loss_mask=[1] + [0] * 13, rollout_logprobs=[-1.0], input_ids=[5] * 14),
            "sample 'g0-e2/0' (episode 'g0-e2'): loss_mask[0] is 1",
        ),
        (
            _set(6, sample_id="g0-e2/1"),
            "sample 'g0-e2/1' (episode 'g0-e3'): sample_id appears twice",
        ),
    ],
    ids=[
        "mask-longer",
        "logprobs-missing",
        "reward-differs",
        "segment-missing",
        "vocab",
        "first-token",
        "duplicate-id",
    ],
)
def test_bad_samples_fail_in_one_line_naming_them(
    samples_file: Path, tmp_path: Path, edit, expected: str
) -> None:
    bad = _edit(samples_file, tmp_path, edit)
    result = legorl("train", str(bad), "--model", str(MODEL), "--out", str(tmp_path / "c"))
    assert result.returncode == 1
    lines = result.stderr.decode().strip().splitlines()
    errors = [x for x in lines if "error:" in x]
    assert len(errors) == 1 and errors[0].startswith("legorl train: error: "), lines
    assert expected in errors[0]
    assert not (tmp_path / "c").exists()


def test_skip_bad_drops_the_episode_and_trains_on(samples_file: Path, tmp_path: Path) -> None:
    bad = _edit(samples_file, tmp_path, _set(1, reward=0.5))
    result = legorl(
        "train", str(bad), "--model", str(MODEL), "--out", str(tmp_path / "c"), "--skip-bad"
    )
    assert result.returncode == 0, result.stderr.decode()
    err = result.stderr.decode()
    assert "skipped episode: sample 'g0-e0/1'" in err
    assert "14 samples, 7 episodes" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["lrr=1"], "unknown config key 'lrr' (did you mean 'lr'?)"),
        (["algorithm=ppo"], "algorithm: must be one of gspo, grpo, drgrpo"),
        (["--push", "http://127.0.0.1:1", "--dry-run"], "--push and --dry-run together"),
        (["--push", "http://127.0.0.1:1", "--out", "x"], "--push needs --push-token"),
        ([], "--out is needed (or --dry-run)"),
    ],
)
def test_usage_errors_exit_2(samples_file: Path, args: list[str], expected: str) -> None:
    result = legorl(
        "train", str(samples_file), "--model", str(MODEL), *args, env={"LEGORL_ADMIN_TOKEN": ""}
    )
    assert result.returncode == 2
    assert expected in result.stderr.decode()


def test_empty_input_is_an_error(tmp_path: Path) -> None:
    result = legorl("train", "--model", str(MODEL), "--out", str(tmp_path / "c"), stdin=b"")
    assert result.returncode == 1
    assert result.stderr.decode().strip().endswith("legorl train: error: no samples in the input")


def test_push_reloads_the_proxy_and_turns_carry_the_version(
    samples_file: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "proxy"))
    from proxy_harness import running_proxy

    from legorl.engines.models import load_model, token_logprobs
    from legorl.records import segment_prompts

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with running_proxy(tmp_path / "turns", [], engine="embedded", admin_token="t0k") as proxy:
        versions = []
        model = MODEL
        for k in (1, 2):
            out = tmp_path / f"ckpt{k}"
            result = legorl(
                "train",
                str(samples_file),
                "--model",
                str(model),
                "--out",
                str(out),
                "--push",
                proxy.url,
                "--push-token",
                "t0k",
                "lr=1e-2",
            )
            assert result.returncode == 0, result.stderr.decode()
            metrics = metrics_of(result.stdout)
            (version,) = [m for m in metrics if m.name == "policy_version"]
            versions.append(version.value)
            model = out
        assert versions == [1.0, 2.0]
        assert proxy.core.engine.policy_version == 2
        resp = httpx.post(f"{proxy.url}/s/after/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        (turn,) = proxy.turns("after")
        wrong = legorl(
            "train",
            str(samples_file),
            "--model",
            str(MODEL),
            "--out",
            str(tmp_path / "x"),
            "--push",
            proxy.url,
            "--push-token",
            "nope",
        )
    assert turn.policy_version == 2
    # the proxy now samples from the pushed weights: its log-probs are the checkpoint's
    ((_, prompt),) = segment_prompts([turn])
    seq = prompt + turn.completion_ids
    new = token_logprobs(load_model(tmp_path / "ckpt2"), seq, start=len(prompt), temperature=1.0)
    assert max(abs(a - b) for a, b in zip(new, turn.completion_logprobs, strict=True)) < 1e-4
    assert max_diff(tmp_path / "ckpt2", MODEL) > 1e-3
    assert wrong.returncode == 1
    (line,) = [x for x in wrong.stderr.decode().splitlines() if "error:" in x]
    assert "--push" in line and "HTTP 401" in line


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_weights(a), load_weights(b)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_samples_round_trip_through_records(samples_file: Path) -> None:
    # the helper writes real Sample records: what align would hand to train
    first = next(iter(read_jsonl(samples_file, Sample)))
    assert to_json(first).startswith(b'{"schema":"legorl/sample@1"')


def test_bf16_autocast_and_other_attention_paths(samples_file: Path) -> None:
    for extra in (["precision=bf16"], ["attention=sdpa", "gradient_checkpointing=true"]):
        result = legorl("train", str(samples_file), "--model", str(MODEL), "--dry-run", *extra)
        assert result.returncode == 0, result.stderr.decode()
        got = {m.name: m.value for m in metrics_of(result.stdout)}
        assert got["grad_norm"] > 0
        # bf16 scoring against fp32 rollouts: a small, real mismatch, still healthy
        assert 0.99 < got["rollout_trainer_pearson"] <= 1.0
