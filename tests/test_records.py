"""Records: round trips, every kind of bad line named by file:line and field, killed writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, example_records

from legorl.records import (
    SCHEMAS,
    Failover,
    JsonlWriter,
    RecordError,
    Sample,
    Trajectory,
    Turn,
    read_jsonl,
    segment_prompts,
    to_json,
    write_jsonl,
)

GOLDEN = ROOT / "tests" / "data" / "golden.jsonl"


def test_every_record_type_round_trips(tmp_path: Path, records: list) -> None:
    path = tmp_path / "all.jsonl"
    assert write_jsonl(path, records) == len(records)
    back = list(read_jsonl(path))
    assert back == records
    assert {type(r) for r in back} == set(SCHEMAS.values())


def test_golden_file_reads_and_rewrites_byte_for_byte() -> None:
    # Guards the wire format: a change to any record's fields shows up here.
    raw = GOLDEN.read_bytes()
    records = list(read_jsonl(GOLDEN))
    assert len(records) == len(example_records())
    assert b"".join(to_json(r) + b"\n" for r in records) == raw
    assert records == example_records()


def test_turns_written_before_replicas_still_read() -> None:
    # Turns gained ``replica`` and ``failover`` (engine replicas): a file written before reads
    # as the same records, the new fields at their defaults
    old = ROOT / "tests" / "data" / "golden-before-replicas.jsonl"
    assert b'"replica"' not in old.read_bytes()
    records = list(read_jsonl(old))
    assert records == example_records()
    turns = [r for r in records if isinstance(r, Turn)]
    assert turns and all(t.replica is None and t.failover is None for t in turns)


def test_a_failed_over_turn_round_trips(tmp_path: Path) -> None:
    turn = next(r for r in example_records() if isinstance(r, Turn))
    turn.replica = "http://127.0.0.1:8001"
    turn.failover = Failover(
        failed=["http://127.0.0.1:8000"], reprefilled_tokens=4, resumed_at=1, stalled_s=0.25
    )
    write_jsonl(tmp_path / "t.jsonl", [turn])
    (back,) = read_jsonl(tmp_path / "t.jsonl", Turn)
    assert (
        back == turn and back.failover is not None and back.failover.failed == turn.failover.failed
    )
    bad = orjson.loads((tmp_path / "t.jsonl").read_bytes())
    bad["failover"]["reprefilled_tokens"] = "4"
    (tmp_path / "bad.jsonl").write_bytes(orjson.dumps(bad) + b"\n")
    with pytest.raises(
        RecordError, match=r"bad\.jsonl:1: failover\.reprefilled_tokens: expected int"
    ):
        list(read_jsonl(tmp_path / "bad.jsonl", Turn))


def test_expected_type_filters_by_schema(tmp_path: Path, records: list) -> None:
    path = tmp_path / "all.jsonl"
    write_jsonl(path, records)
    with pytest.raises(RecordError, match=r"all\.jsonl:1: schema: expected legorl/turn@1"):
        list(read_jsonl(path, Turn))
    assert len(list(read_jsonl(path, (Turn, Trajectory), skip_bad=True))) == 3


def _write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def _good(record) -> bytes:
    return to_json(record) + b"\n"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b"{not json\n", r"bad\.jsonl:2: malformed JSON"),
        (
            b'{"schema": "legorl/turn@9", "x": 1}\n',
            r"bad\.jsonl:2: schema: unknown schema 'legorl/turn@9'",
        ),
        (b'{"x": 1}\n', r"bad\.jsonl:2: schema: missing required field"),
        (b"[1, 2]\n", r"bad\.jsonl:2: record: expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, bad_line: bytes, message: str) -> None:
    first = example_records()[1]
    path = _write_lines(tmp_path / "bad.jsonl", [_good(first), bad_line, _good(first)])
    with pytest.raises(RecordError, match=message) as info:
        list(read_jsonl(path))
    assert info.value.line == 2


def _turn_dict() -> dict:
    return orjson.loads(to_json(example_records()[1]))


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (lambda d: d.pop("completion_ids"), "completion_ids", "missing required field"),
        (lambda d: d.update(turn="3"), "turn", "expected int, got str"),
        (lambda d: d["prompt_delta"].insert(2, 1.5), "prompt_delta[2]", "expected int, got float"),
        (lambda d: d.update(api="grpc"), "api", "must be one of"),
        (
            lambda d: d["output"]["tool_calls"][0].pop("name"),
            "output.tool_calls[0].name",
            "missing",
        ),
        (lambda d: d.update(surprise=1), "surprise", "unknown field for Turn"),
        (lambda d: d["completion_logprobs"].pop(), "completion_logprobs", "2 values for 3"),
    ],
)
def test_field_errors_name_the_field(tmp_path: Path, mutate, field: str, message: str) -> None:
    data = _turn_dict()
    mutate(data)
    path = _write_lines(tmp_path / "turns.jsonl", [orjson.dumps(data) + b"\n"])
    with pytest.raises(RecordError) as info:
        list(read_jsonl(path, Turn))
    text = str(info.value)
    assert text.startswith(f"{path}:1: {field}: "), text
    assert message in text
    assert info.value.field_name == field


def test_sample_invariants_are_checked(tmp_path: Path) -> None:
    sample = orjson.loads(to_json(example_records()[4]))
    sample["loss_mask"][0] = 1  # one more loss token than recorded log-probs
    path = _write_lines(tmp_path / "s.jsonl", [orjson.dumps(sample) + b"\n"])
    with pytest.raises(RecordError, match=r"s\.jsonl:1: rollout_logprobs: has 4 values for 5"):
        list(read_jsonl(path, Sample))


def test_environment_failures_cannot_carry_a_reward(tmp_path: Path) -> None:
    traj = orjson.loads(to_json(example_records()[3]))
    traj["status"] = "sandbox_error"
    path = _write_lines(tmp_path / "t.jsonl", [orjson.dumps(traj) + b"\n"])
    with pytest.raises(RecordError, match=r"t\.jsonl:1: reward: must be null"):
        list(read_jsonl(path))


def test_truncated_last_line_is_reported_as_truncated(tmp_path: Path, records: list) -> None:
    whole = b"".join(_good(r) for r in records)
    path = _write_lines(tmp_path / "cut.jsonl", [whole, _good(records[1])[:40]])
    with pytest.raises(RecordError, match=rf"cut\.jsonl:{len(records) + 1}: truncated last line"):
        list(read_jsonl(path))


def test_skip_bad_counts_every_skipped_line(tmp_path: Path, records: list) -> None:
    lines = [_good(records[1]), b"{oops\n", b'{"schema": "nope"}\n', _good(records[2])]
    path = _write_lines(tmp_path / "mixed.jsonl", [*lines, _good(records[2])[:10]])
    reader = read_jsonl(path, skip_bad=True)
    assert [r.turn for r in reader] == [0, 1]
    assert reader.skipped == 3
    assert [e.line for e in reader.errors] == [2, 3, 5]


def test_writer_ends_a_truncated_line_before_appending(tmp_path: Path, records: list) -> None:
    path = _write_lines(tmp_path / "resume.jsonl", [_good(records[1]), _good(records[2])[:25]])
    with JsonlWriter(path) as writer:
        writer.write(records[2])
    reader = read_jsonl(path, skip_bad=True)
    assert [r.turn for r in reader] == [0, 1]
    assert reader.skipped == 1 and reader.errors[0].line == 2
    assert path.read_bytes().startswith(_good(records[1]) + _good(records[2])[:25] + b"\n")


_KILLED_WRITER = """
import sys
from legorl.records import JsonlWriter, Turn
w = JsonlWriter(sys.argv[1])
n = 0
print("ready", flush=True)
while True:
    w.write(Turn(session="s", turn=n, segment=0, api="anthropic", model="m", prompt_offset=0,
                 prompt_delta=list(range(200_000)), completion_ids=[1], completion_logprobs=[-1.0],
                 finish_reason="stop"))
    n += 1
"""


def test_killed_writer_leaves_at_most_one_truncated_line(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    deadline = time.monotonic() + 30
    while (not path.exists() or path.stat().st_size < 5_000_000) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader = read_jsonl(path, Turn, skip_bad=True)
    turns = [t.turn for t in reader]
    assert turns == list(range(len(turns))) and len(turns) >= 2
    assert reader.skipped <= 1
    if reader.skipped:
        assert "truncated last line" in str(reader.errors[0])


def test_prompts_are_stored_as_deltas_and_rebuilt_exactly(records: list) -> None:
    turn0, turn1 = records[1], records[2]
    (_t0, p0), (_t1, p1) = segment_prompts([turn0, turn1])
    assert p0 == [1, 2, 3, 4]
    assert p1 == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert turn1.prompt_len == len(p1)


def test_storage_grows_linearly_with_turns() -> None:
    # A 200-turn session must cost twice the bytes of a 100-turn one, not four times.
    def session_bytes(n_turns: int) -> int:
        total, offset = 0, 0
        for i in range(n_turns):
            turn = Turn(
                session="s",
                turn=i,
                segment=0,
                api="openai_chat",
                model="m",
                prompt_offset=offset,
                prompt_delta=list(range(50)),
                completion_ids=list(range(30)),
                completion_logprobs=[-0.5] * 30,
                finish_reason="tool_calls",
            )
            offset += 80
            total += len(to_json(turn)) + 1
        return total

    ratio = session_bytes(200) / session_bytes(100)
    assert 1.9 < ratio < 2.1


def test_offset_past_the_segment_is_an_error(records: list) -> None:
    bad = records[2]
    bad.prompt_offset = 99
    with pytest.raises(ValueError, match="prompt_offset: turn 1 of session 'traj-1' starts at 99"):
        list(segment_prompts([records[1], bad]))
