"""Task sets load as published: SWE-bench, SWE-Gym, SWE-smith and R2E-Gym rows from JSONL,
JSON, Parquet and a ``datasets`` folder; extra columns in meta; one-line errors naming the row.

The rows below are written here in the shapes each set publishes on Hugging Face (columns,
JSON-text test lists, image naming); no network is used.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from legorl.protocols import SandboxError
from legorl.tasks import TaskError, detect_format, load_tasks

SWEBENCH_ROW: dict[str, Any] = {
    "repo": "django/django",
    "instance_id": "django__django-11099",
    "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
    "patch": "diff --git a/django/contrib/auth/validators.py b/django/contrib/auth/validators.py\n",
    "test_patch": "diff --git a/tests/auth_tests/test_validators.py b/tests/auth_tests/test_validators.py\n",
    "problem_statement": "UsernameValidator allows trailing newline in usernames",
    "hints_text": "",
    "created_at": "2019-03-20T03:46:18Z",
    "version": "3.0",
    "FAIL_TO_PASS": json.dumps(
        ["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"]
    ),
    "PASS_TO_PASS": json.dumps(["test_help_text (auth_tests.test_validators.NumericTests)"]),
    "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
    "difficulty": "<15 min fix",  # SWE-bench Verified's extra column
}
SWEGYM_ROW: dict[str, Any] = {
    "instance_id": "getmoto__moto-5752",
    "hints_text": "",
    "patch": "diff --git a/moto/ssm/models.py b/moto/ssm/models.py\n",
    "test_patch": "diff --git a/tests/test_ssm/test_ssm.py b/tests/test_ssm/test_ssm.py\n",
    "created_at": "2022-12-10T20:23:01Z",
    "problem_statement": "describe_parameters ignores the ParameterFilters Name filter",
    "repo": "getmoto/moto",
    "base_commit": "b2300f1eae1323e3e8bc45f97e530ce129dff12e",
    "version": "4.0",
    "PASS_TO_PASS": ["tests/test_ssm/test_ssm.py::test_get_parameter"],
    "FAIL_TO_PASS": ["tests/test_ssm/test_ssm.py::test_describe_parameters__multiple_tags"],
}
SWESMITH_ROW: dict[str, Any] = {
    "instance_id": "oauthlib__oauthlib.1fd52536.combine_file__09vlzwgc",
    "repo": "swesmith/oauthlib__oauthlib.1fd52536",
    "patch": "diff --git a/oauthlib/oauth1/rfc5849/signature.py b/oauthlib/oauth1/rfc5849/signature.py\n",
    "FAIL_TO_PASS": ["tests/oauth1/rfc5849/test_signatures.py::SignatureTests::test_hmac_sha1"],
    "PASS_TO_PASS": ["tests/oauth1/rfc5849/test_client.py::ClientRealmTests::test_client_realm"],
    "created_at": dt.datetime(2025, 3, 14, 22, 5, 1),
    "image_name": "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
    "base_commit": "oauthlib__oauthlib.1fd52536.combine_file__09vlzwgc",
    "problem_statement": "HMAC-SHA1 signatures no longer verify",
}
R2EGYM_ROW: dict[str, Any] = {
    "repo_name": "aiohttp",
    "docker_image": "namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198",
    "commit_hash": "f0d74880deec8fcd982bce639c93c5e130d41198",
    "parsed_commit_content": json.dumps({"file_diffs": []}),
    "execution_result_content": json.dumps({"test_file_codes": []}),
    "modified_files": ["aiohttp/web_response.py"],
    "num_non_test_files": 1,
    "relevant_files": ["aiohttp/web_response.py"],
    "problem_statement": "StreamResponse.set_cookie drops samesite",
    "expected_output_json": json.dumps(
        {"TestCookies.test_samesite": "PASSED", "TestCookies.test_known_bug": "FAILED"}
    ),
}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r, default=str) + b"\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _quiet(path: Path, **kw: Any) -> tuple[list[Any], list[str]]:
    lines: list[str] = []
    return load_tasks(path, notice=lines.append, **kw), lines


# --------------------------------------------------------------------------------------------
# Each set, each format
# --------------------------------------------------------------------------------------------


def test_swebench_row_decodes_json_text_lists_names_its_image_and_keeps_extra_columns(
    tmp_path: Path,
) -> None:
    (task,), notes = _quiet(_jsonl(tmp_path / "verified.jsonl", [SWEBENCH_ROW]))
    assert json.loads(SWEBENCH_ROW["FAIL_TO_PASS"]) == task.FAIL_TO_PASS
    assert json.loads(SWEBENCH_ROW["PASS_TO_PASS"]) == task.PASS_TO_PASS
    assert task.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert task.meta["difficulty"] == "<15 min fix"
    assert task.meta["task_format"] == "swebench"
    assert notes == [
        f"note: {tmp_path / 'verified.jsonl'}: columns kept in Task.meta, not used: difficulty"
    ]


def test_rows_without_extra_columns_print_no_note(tmp_path: Path) -> None:
    row = {k: v for k, v in SWEBENCH_ROW.items() if k != "difficulty"}
    _, notes = _quiet(_jsonl(tmp_path / "t.jsonl", [row, row | {"instance_id": "a__b-2"}]))
    assert notes == []


def test_extra_columns_are_named_once_for_the_whole_file(tmp_path: Path) -> None:
    rows = [SWEBENCH_ROW | {"instance_id": f"django__django-{i}"} for i in range(5)]
    rows[3] = rows[3] | {"note_for_me": "x"}
    _, notes = _quiet(_jsonl(tmp_path / "t.jsonl", rows))
    assert len(notes) == 1
    assert notes[0].endswith("not used: difficulty, note_for_me")


def test_default_notice_goes_to_stderr(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    load_tasks(_jsonl(tmp_path / "t.jsonl", [SWEBENCH_ROW]))
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "not used: difficulty" in err


def test_json_list_hf_rows_answer_and_parquet_load_the_same_tasks(tmp_path: Path) -> None:
    rows = [SWEBENCH_ROW, SWEBENCH_ROW | {"instance_id": "django__django-11133"}]
    want, _ = _quiet(_jsonl(tmp_path / "t.jsonl", rows))
    (tmp_path / "list.json").write_bytes(orjson.dumps(rows))
    viewer = {"features": [], "rows": [{"row_idx": i, "row": r} for i, r in enumerate(rows)]}
    (tmp_path / "viewer.json").write_bytes(orjson.dumps(viewer))
    for path in (tmp_path / "list.json", tmp_path / "viewer.json"):
        assert _quiet(path)[0] == want
    assert _quiet(_parquet(tmp_path / "t.parquet", rows))[0] == want


def test_swegym_rows_need_the_flag_for_their_image_name(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "gym.jsonl", [SWEGYM_ROW])
    # Control: SWE-Gym shares SWE-bench's columns, and lacks environment_setup_commit, which
    # a SWE-bench row needs.
    with pytest.raises(TaskError, match="environment_setup_commit: missing"):
        _quiet(path)
    (task,), _ = _quiet(path, task_format="swegym")
    assert task.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest"
    assert task.environment_setup_commit == SWEGYM_ROW["base_commit"]
    assert SWEGYM_ROW["FAIL_TO_PASS"] == task.FAIL_TO_PASS


def test_swesmith_row_is_detected_and_keeps_its_image_and_timestamp(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "smith.parquet", [SWESMITH_ROW])
    (task,), notes = _quiet(path)
    assert task.meta["task_format"] == "swesmith"
    assert task.image == SWESMITH_ROW["image_name"]
    assert task.test_patch == ""  # the bug is already committed at base_commit
    assert task.created_at == "2025-03-14T22:05:01"
    assert notes == []


def test_r2egym_row_gets_an_id_and_must_pass_tests_from_expected_output(tmp_path: Path) -> None:
    (task,), notes = _quiet(_jsonl(tmp_path / "r2e.jsonl", [R2EGYM_ROW]))
    assert task.instance_id == "aiohttp__f0d74880deec8fcd982bce639c93c5e130d41198"
    assert task.image == R2EGYM_ROW["docker_image"]
    assert task.FAIL_TO_PASS == ["TestCookies.test_samesite"]
    assert task.meta["modified_files"] == ["aiohttp/web_response.py"]
    assert "parsed_commit_content" in notes[0]


def test_detect_format_from_columns() -> None:
    assert detect_format(SWEBENCH_ROW) == "swebench"
    assert detect_format(SWEGYM_ROW) == "swebench"
    assert detect_format(SWESMITH_ROW) == "swesmith"
    assert detect_format(R2EGYM_ROW) == "r2egym"
    assert detect_format({"schema": "legorl/task@1"}) == "legorl"


def test_task_format_overrides_detection(tmp_path: Path) -> None:
    # An R2E-Gym row read as SWE-bench misses SWE-bench's fields: the override is obeyed.
    path = _jsonl(tmp_path / "r2e.jsonl", [R2EGYM_ROW])
    with pytest.raises(TaskError, match=r"r2e\.jsonl:1: instance \?: instance_id: missing"):
        _quiet(path, task_format="swebench")
    with pytest.raises(TaskError, match="--task-format 'swe-bench': unknown"):
        _quiet(path, task_format="swe-bench")


def test_native_records_stay_strict(tmp_path: Path) -> None:
    tasks, _ = _quiet(Path("fixtures/tasks/train.jsonl"))
    assert len(tasks) == 100 and tasks[0].meta.get("task_format") is None
    row = json.loads(Path("fixtures/tasks/train.jsonl").read_text().splitlines()[0])
    with pytest.raises(TaskError, match=r"bad\.jsonl:1: .*surprise"):
        _quiet(_jsonl(tmp_path / "bad.jsonl", [row | {"surprise": 1}]))


# --------------------------------------------------------------------------------------------
# Missing fields
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "field", "fmt"),
    [
        (SWEBENCH_ROW, "test_patch", "swebench"),
        (SWESMITH_ROW, "image_name", "swesmith"),
        (R2EGYM_ROW, "expected_output_json", "r2egym"),
        (SWEGYM_ROW, "FAIL_TO_PASS", "swegym"),
    ],
)
def test_missing_field_names_file_line_and_field(
    tmp_path: Path, row: dict[str, Any], field: str, fmt: str
) -> None:
    bad = {k: v for k, v in row.items() if k != field}
    # Without image_name a SWE-smith row no longer looks like one; SWE-Gym never does.
    kw: dict[str, Any] = {"task_format": fmt} if fmt in ("swesmith", "swegym") else {}
    path = _jsonl(tmp_path / "t.jsonl", [row, bad])
    with pytest.raises(TaskError) as err:
        _quiet(path, **kw)
    assert str(err.value).startswith(f"{path}:2: instance ")
    assert f"{field}: missing; a {fmt} row needs" in str(err.value)


def test_missing_field_in_parquet_names_the_row_index(tmp_path: Path) -> None:
    bad = {k: v for k, v in SWEBENCH_ROW.items() if k != "version"}
    path = _parquet(tmp_path / "t.parquet", [SWEBENCH_ROW, SWEBENCH_ROW, bad])
    with pytest.raises(TaskError, match=r"t\.parquet\[2\]: instance django__django-11099: version"):
        _quiet(path)


def test_a_list_that_is_not_json_names_the_row_and_field(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [SWEBENCH_ROW | {"PASS_TO_PASS": "[not json"}])
    with pytest.raises(TaskError, match=r"t\.jsonl:1: instance django__django-11099: PASS_TO"):
        _quiet(path)


def _legorl(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        capture_output=True,
        env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"},
        timeout=120,
    )


def test_cli_missing_field_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = {k: v for k, v in SWEBENCH_ROW.items() if k != "test_patch"}
    path = _jsonl(tmp_path / "t.jsonl", [SWEBENCH_ROW, SWEBENCH_ROW, bad])
    for argv in (
        ["rollout", "--tasks", str(path), "--model", "m"],
        ["sandbox", "build", "--tasks", str(path), "--backend", "local"],
    ):
        result = _legorl(*argv)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.decode().strip().splitlines()
        assert len(lines) == 1
        assert f"{path}:3: instance django__django-11099: test_patch: missing" in lines[0]


# --------------------------------------------------------------------------------------------
# A datasets save_to_disk folder; the sandbox stage's loader is the same one
# --------------------------------------------------------------------------------------------


def test_datasets_folder_loads_a_dataset_and_a_dataset_dict(tmp_path: Path) -> None:
    try:
        import datasets
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("datasets is not installed (it is in the [dev] extra)")
        pytest.skip("datasets is not installed")
    rows = [SWEBENCH_ROW, SWEBENCH_ROW | {"instance_id": "django__django-11133"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    (first, second), _ = _quiet(tmp_path / "one")
    assert second.instance_id == "django__django-11133"
    assert first == _quiet(_jsonl(tmp_path / "t.jsonl", rows))[0][0]
    bad = {k: v if k != "repo" else None for k, v in SWEBENCH_ROW.items()}
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(rows), "dev": datasets.Dataset.from_list([bad])}
    ).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(TaskError, match=r"dict/dev\[0\]: instance django__django-11099: repo"):
        _quiet(tmp_path / "dict")


def test_datasets_folder_without_the_package_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(
        TaskError, match=r"ds: a datasets save_to_disk folder; .*pip install datasets"
    ):
        _quiet(tmp_path / "ds")
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskError, match="not one written by datasets' save_to_disk"):
        _quiet(tmp_path / "plain")


def test_sandbox_stage_reads_published_rows_through_the_same_loader(tmp_path: Path) -> None:
    from legorl.sandbox.stage import task_refs

    path = _parquet(tmp_path / "t.parquet", [SWESMITH_ROW])
    refs = task_refs([path])
    assert refs[SWESMITH_ROW["instance_id"]].task.image == SWESMITH_ROW["image_name"]
    assert refs[SWESMITH_ROW["instance_id"]].tasks_dir == tmp_path.resolve()
    with pytest.raises(SandboxError, match=r"--tasks .*t\.parquet\[0\]: .*repo_name: missing"):
        task_refs([path], "r2egym")
    broken = copy.deepcopy(SWESMITH_ROW)
    del broken["image_name"]
    with pytest.raises(SandboxError, match="image_name: missing"):
        task_refs([_parquet(tmp_path / "b.parquet", [broken])], "swesmith")


def test_bench_tasks_section_runs_in_quick_mode() -> None:
    from legorl.bench import BENCHMARKS
    from legorl.bench.tasks import bench_tasks

    assert "tasks" in BENCHMARKS
    report = bench_tasks(quick=True)
    assert report["rows"] == 1_000
    for name in ("jsonl", "parquet"):
        assert report[name]["rows_per_s"] > 0 and report[name]["load_s"] > 0


def test_check_tasks_takes_the_task_format(tmp_path: Path) -> None:
    from legorl.check import check_tasks

    path = str(_jsonl(tmp_path / "gym.jsonl", [SWEGYM_ROW]))
    detected = check_tasks(path)
    assert detected.status == "fail" and "environment_setup_commit: missing" in detected.reason
    assert check_tasks(path, "swegym").status == "pass"
