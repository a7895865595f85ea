"""--report-to: the Metric records reach TensorBoard event files and an offline wandb run, read
back and compared with the JSONL; the loop's run folder is followed while it grows; a tracker
that cannot be served is one line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import struct
import threading
from pathlib import Path

import pytest
from train_helpers import MODEL, legorl, make_samples

from legorl.records import Metric, read_jsonl, write_jsonl
from legorl.train.trackers import Reporter, TrackerError, follow_metrics, parse_report_to


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def wandb_history(folder: Path) -> list[dict]:
    """The history rows of the offline run under ``folder``: its ``.wandb`` file is a LevelDB-
    style log (7-byte header, 32 KiB blocks of crc/length/type chunks) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, part, rows = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        part += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # "a/b" may be stored as the nested key [a, b]
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_train_reports_to_tensorboard_and_offline_wandb(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "samples.jsonl", make_samples(groups=2, group_size=4, n_new=6))
    run = legorl(
        "train", str(tmp_path / "samples.jsonl"), "--model", str(MODEL), "--out",
        str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "m.jsonl"), "--steps", "2",
        "--report-to", "tensorboard,wandb", "lr=1e-3",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()
    jsonl = {(m.name, m.step): m.value for m in read_jsonl(tmp_path / "m.jsonl", Metric)}
    assert {step for _, step in jsonl} == {1, 2}
    scalars = tensorboard_scalars(tmp_path / "trackers" / "ckpt")
    for (name, step), value in jsonl.items():
        if value is None:  # undefined figures are left out, not sent as 0
            assert f"train/{name}" not in scalars or step not in dict(scalars[f"train/{name}"])
        else:
            assert dict(scalars[f"train/{name}"])[step] == pytest.approx(value, rel=1e-6)
    rows = [
        r for r in wandb_history(tmp_path / "trackers") if any(k.startswith("train/") for k in r)
    ]
    assert [r["train/step"] for r in rows] == [1, 2]
    for row in rows:
        for key, value in row.items():
            if key.startswith("train/") and key != "train/step":
                name = key.removeprefix("train/")
                assert value == pytest.approx(jsonl[(name, row["train/step"])], rel=1e-6)
    assert rows[1]["train/loss"] == pytest.approx(jsonl[("loss", 2)])


def test_the_loop_folder_is_followed_while_it_grows(tmp_path: Path) -> None:
    top, it = tmp_path / "metrics.jsonl", tmp_path / "iter-001" / "metrics.jsonl"
    write_jsonl(top, [Metric(step=0, name="heldout_success", value=0.25, source="loop")])
    reporter = Reporter(["tensorboard"], run_name="run", logging_dir=tmp_path / "tb", config={})
    stop = threading.Event()
    patterns = ["metrics.jsonl", "iter-*/metrics.jsonl"]
    thread = threading.Thread(
        target=follow_metrics, args=(tmp_path, patterns, reporter, stop, 0.05)
    )
    thread.start()
    # files appear and grow after the follower started, the iteration's folder included
    write_jsonl(it, [Metric(step=1, name="loss", value=0.5), Metric(step=1, name="lr", value=0.1)])
    write_jsonl(it, [Metric(step=2, name="loss", value=0.75)])
    write_jsonl(top, [Metric(step=1, name="reward_mean", value=0.5, source="loop")])
    stop.set()
    thread.join()
    reporter.close()
    scalars = tensorboard_scalars(tmp_path / "tb" / "run")
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.75)]
    assert scalars["train/lr"] == [(1, pytest.approx(0.1))]
    assert scalars["loop/heldout_success"] == [(0, 0.25)]
    assert scalars["loop/reward_mean"] == [(1, 0.5)]


def test_a_tracker_that_cannot_be_served_is_one_line(tmp_path: Path) -> None:
    assert parse_report_to(["tensorboard,wandb", "none", "wandb"]) == ["tensorboard", "wandb"]
    with pytest.raises(TrackerError, match="unknown tracker"):
        parse_report_to(["comet"])
    run = legorl("train", "x.jsonl", "--model", str(MODEL), "--dry-run", "--report-to", "bogus")
    assert run.returncode == 2
    assert run.stderr.decode().strip().splitlines() == [
        "legorl train: error: --report-to bogus: unknown tracker (known: wandb, tensorboard, "
        "mlflow, none)"
    ]
    # mlflow is optional: without it the command says which package to install
    run = legorl("loop", "--out", str(tmp_path / "loop"), "--report-to", "mlflow")
    if importlib.util.find_spec("mlflow") is None:
        assert run.returncode == 2
        lines = run.stderr.decode().strip().splitlines()
        assert lines == [
            "legorl loop: error: --report-to mlflow: the 'mlflow' package is not installed "
            "(pip install mlflow)"
        ]
    else:
        assert b"--report-to" not in run.stderr
