"""Layer recipes and keys, output caps, limit classification: pure functions, no Docker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sandbox_fixtures import task, variant

from legorl.protocols import ConfigError, SandboxError
from legorl.sandbox import SANDBOXES, make_backend
from legorl.sandbox.common import (
    Counters,
    OutputCap,
    classify,
    owner_alive,
    owner_tag,
    parse_counters,
)
from legorl.sandbox.docker_images import LayerReport
from legorl.sandbox.layers import keep_up_to, plan
from legorl.sandbox.relay import split_proxy_url


def tags(t: object) -> dict[str, str]:
    return {layer.kind: layer.tag for layer in plan(t)}


def test_a_changed_recipe_changes_that_layer_and_those_above_only() -> None:
    base = task()
    same = tags(variant(base))
    assert same == tags(base)  # keys are stable: the same recipe, the same tags

    env_changed = tags(variant(base, env={"python": "3.11", "packages": ["pytest", "attrs"]}))
    assert env_changed["base"] == same["base"]
    assert env_changed["env"] != same["env"] and env_changed["instance"] != same["instance"]

    commit_changed = tags(variant(base, base_commit="1" * 40))
    assert commit_changed["base"] == same["base"] and commit_changed["env"] == same["env"]
    assert commit_changed["instance"] != same["instance"]

    py_changed = tags(variant(base, env={"python": "3.13", "packages": ["pytest"]}))
    assert py_changed["base"] != same["base"]  # another Debian suite ships that Python


def test_tasks_of_one_repo_share_base_and_env() -> None:
    a, b = tags(task("legorl-toy__geometry-1")), tags(task("legorl-toy__bank-1"))
    assert a["base"] == b["base"] and a["env"] == b["env"] and a["instance"] != b["instance"]


def test_a_task_with_a_prebuilt_image_stands_on_it() -> None:
    layers = plan(variant(task(), image="example.org/swe/env:1.0"))
    assert [layer.kind for layer in layers] == ["image", "instance"]
    assert layers[0].tag == "example.org/swe/env:1.0"


def test_bad_recipes_are_one_line_errors() -> None:
    with pytest.raises(SandboxError, match=r"no Debian base ships Python 2\.7"):
        plan(variant(task(), env={"python": "2.7"}))
    with pytest.raises(SandboxError, match="neither an image nor an env"):
        plan(_no_env())


def _no_env() -> object:
    t = variant(task())
    t.env = None
    return t


def test_cache_levels() -> None:
    layers = plan(task())
    assert [layer.kind for layer in keep_up_to(layers, "none")] == []
    assert [layer.kind for layer in keep_up_to(layers, "base")] == ["base"]
    assert [layer.kind for layer in keep_up_to(layers, "env")] == ["base", "env"]
    assert [layer.kind for layer in keep_up_to(layers, "instance")] == ["base", "env", "instance"]
    with pytest.raises(SandboxError, match="unknown cache level"):
        keep_up_to(layers, "all")


def test_output_cap_keeps_head_and_tail_and_counts_the_rest() -> None:
    cap = OutputCap(10)
    cap.add(b"0123456789" * 3)
    assert cap.truncated and cap.total == 30
    data = cap.data()
    assert data.startswith(b"01234") and data.endswith(b"56789") and b"20 bytes" in data
    small = OutputCap(100)
    small.add(b"abc")
    small.add(b"def")
    assert not small.truncated and small.data() == b"abcdef"


def test_counters_and_classification() -> None:
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    assert parse_counters(v1, "max 5\n") == Counters(oom_kills=2, pids_max_hits=5)
    before, after = Counters(1, 0), Counters(2, 0)
    assert classify(137, timed_out=False, wall_hit=False, before=before, after=after) == "memory"
    assert (
        classify(1, timed_out=False, wall_hit=False, before=before, after=Counters(1, 3)) == "pids"
    )
    assert classify(None, timed_out=True, wall_hit=True, before=None, after=None) == "wall"
    assert classify(None, timed_out=True, wall_hit=False, before=None, after=None) == "timeout"
    assert classify(0, timed_out=False, wall_hit=False, before=before, after=before) is None


def test_owner_tags_tell_live_from_dead_processes() -> None:
    assert owner_alive(owner_tag()) is True
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    tag = owner_tag(proc.pid)
    proc.wait()
    assert owner_alive(tag) is False
    assert owner_alive(f"some-other-host:{os.getpid()}:1") is None  # cannot tell: left alone


def test_proxy_url_maps_to_the_same_port_on_loopback_inside() -> None:
    assert split_proxy_url("http://10.1.2.3:8123/s/abc") == (
        "10.1.2.3",
        8123,
        "http://127.0.0.1:8123/s/abc",
    )
    assert split_proxy_url("http://localhost/s/x")[2] == "http://127.0.0.1:10080/s/x"
    with pytest.raises(SandboxError, match="expected http"):
        split_proxy_url("unix:///tmp/x.sock")


def test_registry_and_unknown_options() -> None:
    assert set(SANDBOXES) == {"docker", "local"}
    with pytest.raises(ConfigError, match="unknown sandbox backend 'k8s'"):
        make_backend("k8s")
    with pytest.raises(ConfigError, match="unknown option"):
        make_backend("docker", colour="blue")
    assert LayerReport("env", "t", "n", "built").action == "built"
