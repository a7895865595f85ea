"""`nox -s lint` type-checks everything the wheel ships: each folder that pyproject's
package-dir installs (src/legorl, and cli/ as legorl.cli) is in mypy's files."""

from __future__ import annotations

import tomllib

from conftest import ROOT


def test_mypy_checks_every_folder_the_wheel_installs() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    shipped = {folder.rstrip("/") for folder in config["setuptools"]["package-dir"].values()}
    checked = {folder.rstrip("/") for folder in config["mypy"]["files"]}
    assert shipped == {"src/legorl", "cli"}
    assert shipped <= checked, f"not type-checked: {sorted(shipped - checked)}"
