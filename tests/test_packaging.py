"""A plain, non-editable `pip install` gives a workbench that finds its own data files.

The wheel is built from a copy of the sources (building writes build/ and *.egg-info next
to pyproject.toml; the working tree stays as it is), installed with `pip --target` into a
temporary folder, and imported from there by a Python whose sys.path holds neither the
repository nor the editable install. Dependencies (torch, PySide6...) come from this venv.
"""
import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("engine", "app", "resources", "pyproject.toml", "README.md")
DRAFT = "resources/drafts/smollm2-135m-eagle"
RUNTIME_DATA = ("resources/style.qss", "resources/icons/workbench.svg", f"{DRAFT}/config.json",
                f"{DRAFT}/model.safetensors", f"{DRAFT}/distill_report.json")

# Run in the installed copy: where each package and data file was found.
PROBE = """
import json, sys
import app, engine, resources
from app.theme import style_sheet
from engine.profiles import builtin_profiles
print(json.dumps({
    "modules": [m.__file__ for m in (app, engine, resources)],
    "profiles": {name: str(path) for name, path in builtin_profiles().items()},
    "style_sheet": style_sheet(),
    "draft_files": sorted(str(p) for p in (resources.DRAFTS_DIR / "smollm2-135m-eagle").iterdir()),
    "icon_exists": resources.APP_ICON.is_file(),
    "sys_path": sys.path,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), "."],
        cwd=source)
    [built] = dist.glob("inference_workbench-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(target),
         str(wheel)], cwd=target)
    return target


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_the_wheel_ships_the_data_the_app_and_engine_open(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(RUNTIME_DATA) <= names
    profiles = {n for n in names if n.startswith("resources/profiles/") and n.endswith(".json")}
    assert {"resources/profiles/baseline.json", "resources/profiles/all_optimizations.json"} <= profiles


def test_the_wheel_declares_the_workbench_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        [entry_points] = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_points).decode())
    assert parser["console_scripts"]["workbench"].strip() == "app.__main__:main"


def test_an_installed_copy_finds_profiles_style_and_draft_outside_the_repository(installed, tmp_path):
    # A clean environment and -s: no PYTHONPATH but the install, no user site, cwd outside the repo.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PYTHONPATH": str(installed),
           "WORKBENCH_CONFIG_DIR": str(tmp_path / "config"), "QT_QPA_PLATFORM": "offscreen"}
    found = json.loads(run([sys.executable, "-s", "-c", PROBE], cwd=tmp_path, env=env).stdout)
    installed = installed.resolve()
    assert str(REPO) not in found["sys_path"]
    assert all(Path(module).is_relative_to(installed) for module in found["modules"])
    assert set(found["profiles"]) == {"all_optimizations", "baseline"}
    assert all(Path(path).is_relative_to(installed) for path in found["profiles"].values())
    assert found["style_sheet"] == (REPO / "resources" / "style.qss").read_text(encoding="utf-8")
    assert all(Path(path).is_relative_to(installed) for path in found["draft_files"])
    assert {"config.json", "model.safetensors", "distill_report.json"} <= {Path(p).name for p in found["draft_files"]}
    assert found["icon_exists"]
