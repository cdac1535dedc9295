"""A wheel of tidal, installed by pip into a fresh virtual environment, carries its recipes and
its ``tidal`` command (issue 17: from a non-editable install, ``tidal train --recipe tiny`` said
"unknown recipe 'tiny' (known: none found)").

The fresh environment has no network to fetch torch from, so it sees the test environment's
installed packages through a path file (a plain path: the editable tidal there is not
activated, its finder is a ``.pth`` of that folder, which a path line does not run)."""

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
def test_a_wheel_installed_into_a_fresh_venv_trains_a_shipped_recipe(tmp_path: Path) -> None:
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

    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()]
    (site / "dependencies.pth").write_text("\n".join(ours) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300)  # fmt: skip
    elsewhere = tmp_path / "elsewhere"  # no recipes/ here, and not the checkout
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = [str(fresh / "bin" / "tidal"), "train", "--recipe", "tiny", "--no-plots",
           "--set", "training.steps=2", "--set", "training.val_every=0",
           "--set", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    result = subprocess.run(run, cwd=elsewhere, env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    where = subprocess.run([str(python), "-c", "import tidal; print(tidal.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's tidal, not the checkout
    version = subprocess.run([str(fresh / "bin" / "tidal"), "--version"], cwd=elsewhere, env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert version.stdout.startswith(f"tidal {_project_version()} (torch "), version.stdout
    assert (tmp_path / "run" / "summary.json").is_file()


def _project_version() -> str:
    import tomllib

    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])
