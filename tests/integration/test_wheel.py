"""A wheel of tidal carries its recipes (issue 17: from a non-editable install, ``tidal train
--recipe tiny`` said "unknown recipe 'tiny' (known: none found)")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_wheel_installed_apart_from_the_checkout_trains_a_shipped_recipe(tmp_path: Path) -> None:
    # Built from a copy: pip builds in the source tree, which would leave build/ in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("tidal", "benchmarks"):
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))  # fmt: skip
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(source)], check=True, timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("tidal-*.whl")
    assert "tidal/recipes/tiny.toml" in zipfile.ZipFile(wheel).namelist()

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)  # fmt: skip
    elsewhere = tmp_path / "elsewhere"  # no recipes/ here, and not the checkout
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = [sys.executable, "-m", "tidal", "train", "--recipe", "tiny", "--no-plots",
           "--set", "training.steps=2", "--set", "training.val_every=0",
           "--set", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    result = subprocess.run(run, cwd=elsewhere, env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    where = subprocess.run([sys.executable, "-c", "import tidal; print(tidal.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's tidal, not the checkout
    assert (tmp_path / "run" / "summary.json").is_file()
