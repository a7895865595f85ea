"""The one registry behind engines, sandbox backends and harnesses: short names and
``module:Class``, options checked against the class's dataclass fields, every failure a
``ConfigError`` naming what was wrong; and every registered harness declaring its whole
contract on its class."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from legorl.engines import ENGINES, ForcedConfig, make_engine
from legorl.harnesses import HARNESSES, MiniHarness, make_harness
from legorl.harnesses.testing import SCRIPTED, ScriptedHarness
from legorl.protocols import ConfigError, Harness, Requirement
from legorl.registry import Registry
from legorl.sandbox import SANDBOXES, make_backend


@dataclass(slots=True, kw_only=True)
class _Widget:
    size: int
    colour: str = "red"


class _NotOptions:
    pass


def test_short_names_and_import_paths_build_the_same_class() -> None:
    reg: Registry[_Widget] = Registry("widget", {"w": _Widget})
    assert reg.build("w", size=3) == _Widget(size=3)
    assert reg.build(f"{__name__}:_Widget", size=3, colour="blue") == _Widget(size=3, colour="blue")
    assert "w" in reg and list(reg) == ["w"]


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gadget", {}, "unknown widget 'gadget' (one of w, or module:Class)"),
        (
            "w",
            {"size": 1, "weight": 2},
            "unknown option(s) for widget 'w': weight (known: colour, size)",
        ),
        ("w", {}, "widget 'w': "),  # the missing required option, in Python's own words
        ("no.such.module:Thing", {}, "widget 'no.such.module:Thing': cannot import it"),
        (f"{__name__}:_Nothing", {}, f"widget '{__name__}:_Nothing': cannot import it"),
        (f"{__name__}:SCRIPTED", {}, "is not a class"),
        (f"{__name__}:_NotOptions", {}, "its options are not a dataclass"),
    ],
)
def test_every_bad_name_or_option_is_a_config_error(name: str, options: dict, message: str) -> None:
    reg: Registry[_Widget] = Registry("widget", {"w": _Widget})
    with pytest.raises(ConfigError) as err:
        reg.build(name, **options)
    assert message in str(err.value)
    if name == "w" and not options:
        assert "size" in str(err.value)


def test_engines_and_backends_are_built_from_their_config_class() -> None:
    with pytest.raises(ConfigError, match=r"unknown option.*engine 'vllm': model_pth"):
        make_engine("vllm", model_pth="x")
    with pytest.raises(ConfigError, match="unknown sandbox backend 'k8s'"):
        make_backend("k8s")
    assert ENGINES["forced"].config_class is ForcedConfig
    for _, cls in SANDBOXES.items():
        assert cls.config_class.__name__.endswith("Config")


def test_every_registered_harness_declares_its_whole_contract() -> None:
    apis = {"openai_chat", "anthropic", "responses", "gemini"}
    for name, cls in HARNESSES.items():
        assert cls.name == name
        assert cls.api in apis and isinstance(cls.streams, bool)
        assert isinstance(cls.requires, Requirement) and cls.requires.install
        assert (cls.requires.binary is None) != (cls.requires.module is None), name
        assert isinstance(cls.needs_runtime, bool)
        assert isinstance(make_harness(name), Harness)


def test_the_test_double_is_not_registered_but_can_be_named() -> None:
    assert "scripted" not in HARNESSES
    assert all(cls is not ScriptedHarness for _, cls in HARNESSES.items())
    built = make_harness(SCRIPTED, command="exit 3")
    assert isinstance(built, ScriptedHarness) and built.command == "exit 3"
    with pytest.raises(ConfigError, match=r"unknown option.*max_turns"):
        make_harness(SCRIPTED, max_turns=3)
    assert isinstance(make_harness("mini", max_turns=2), MiniHarness)
