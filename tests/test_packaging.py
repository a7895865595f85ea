"""The console script works from a built wheel in a fresh venv, not only from a checkout."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_wheel_installs_a_working_console_script(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("legorl-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # --help needs only the light dependencies; the rest are heavy and already tested elsewhere.
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)
    subprocess.run([*pip, "typer", "rich", "orjson"], check=True, timeout=300)
    legorl = env_dir / "bin" / "legorl"
    result = subprocess.run([str(legorl), "--help"], capture_output=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert b"rollout" in result.stdout and b"verify" in result.stdout
    version = subprocess.run([str(legorl), "--version"], capture_output=True, cwd=tmp_path)
    assert version.stdout.decode().startswith("legorl ")
    # The installed package, not the checkout, answered.
    where = subprocess.run(
        [str(py), "-c", "import legorl.cli.main as m; print(m.__file__)"],
        capture_output=True,
        cwd=tmp_path,
        check=True,
    )
    assert str(env_dir) in where.stdout.decode()


def test_every_package_is_in_the_wheel() -> None:
    # pyproject lists packages by hand (cli/ installs as legorl.cli); a forgotten one would be
    # missing from the wheel while the editable install still works.
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {"legorl.cli"} | {
        ".".join(p.parent.relative_to(ROOT / "src").parts)
        for p in (ROOT / "src" / "legorl").rglob("__init__.py")
    }
    assert listed == on_disk
