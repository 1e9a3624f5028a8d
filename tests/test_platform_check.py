"""A bare Linux machine gets told which packages to install, not Qt's generic plugin error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import platform_check
from app.platform_check import (debian_package, missing_libraries, missing_libraries_message, platform_problem,
                                would_use_xcb)

REPO = Path(__file__).resolve().parent.parent

# `ldd libqxcb.so` on a Debian 12 container without libxcb-cursor0, libxcb-icccm4 and
# libxcb-keysyms1 (shortened). ldd repeats a missing library for each library needing it.
LDD_OUTPUT = """\
\tlinux-vdso.so.1 (0x00007ffd5b9f2000)
\tlibQt6XcbQpa.so.6 => /venv/lib/python3.11/site-packages/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f1ff9eb3000)
\tlibQt6Gui.so.6 => /venv/lib/python3.11/site-packages/PySide6/Qt/plugins/platforms/../../lib/libQt6Gui.so.6 (0x00007f1ff9200000)
\tlibGL.so.1 => /lib/x86_64-linux-gnu/libGL.so.1 (0x00007f1ff9e23000)
\tlibxkbcommon-x11.so.0 => /lib/x86_64-linux-gnu/libxkbcommon-x11.so.0 (0x00007f1ff9dd0000)
\tlibxcb-cursor.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxcb-util.so.1 => /lib/x86_64-linux-gnu/libxcb-util.so.1 (0x00007f1ff9dc1000)
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-randr.so.0 => /lib/x86_64-linux-gnu/libxcb-randr.so.0 (0x00007f1ff9da8000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f1ff801e000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f1ff9f83000)
"""
X11_DESKTOP = {"DISPLAY": ":0", "XDG_SESSION_TYPE": "x11"}


def test_ldd_output_gives_each_missing_library_once():
    assert missing_libraries(LDD_OUTPUT) == ["libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


def test_nothing_is_missing_when_every_library_resolves():
    resolved = "\n".join(line for line in LDD_OUTPUT.splitlines() if "not found" not in line)
    assert missing_libraries(resolved) == []


@pytest.mark.parametrize("soname, package", [
    ("libxcb-icccm.so.4", "libxcb-icccm4"),
    ("libxcb-keysyms.so.1", "libxcb-keysyms1"),
    ("libxcb-cursor.so.0", "libxcb-cursor0"),
    ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),   # name ends in a digit: a hyphen
    ("libxcb-render-util.so.0", "libxcb-render-util0"),
    ("libX11-xcb.so.1", "libx11-xcb1"),                # package names are lower case
    ("libEGL.so.1", "libegl1"),
    ("libpng16.so.16", "libpng16-16"),
    ("libglib-2.0.so.0", "libglib2.0-0"),               # Debian's own exception
])
def test_debian_package_follows_the_library_naming_rule(soname, package):
    assert debian_package(soname) == package


def test_message_names_exactly_the_missing_libraries_and_their_packages():
    message = missing_libraries_message(missing_libraries(LDD_OUTPUT))
    assert "libxcb-cursor.so.0, libxcb-icccm.so.4, libxcb-keysyms.so.1" in message
    assert "sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1\n" in message
    assert "libxcb-randr" not in message and "libxkbcommon" not in message


def test_missing_xcb_libraries_stop_the_start_with_the_install_command(monkeypatch):
    monkeypatch.setattr(platform_check, "run_ldd", lambda library: LDD_OUTPUT)
    message = platform_problem(X11_DESKTOP, "linux")
    assert "sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1" in message


@pytest.mark.parametrize("env", [
    {"QT_QPA_PLATFORM": "offscreen"},
    {"QT_QPA_PLATFORM": "offscreen:configfile=/tmp/screens.json"},
    {"QT_QPA_PLATFORM": "wayland", "WAYLAND_DISPLAY": "wayland-0"},
    {"QT_QPA_PLATFORM": "minimal"},
    {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland", "DISPLAY": ":0"},
])
def test_platforms_other_than_xcb_are_not_checked(env, monkeypatch):
    monkeypatch.setattr(platform_check, "run_ldd", lambda library: pytest.fail("ldd ran for a non-xcb platform"))
    assert not would_use_xcb(env)
    assert platform_problem(env, "linux") is None


@pytest.mark.parametrize("env", [X11_DESKTOP, {"QT_QPA_PLATFORM": "xcb", "DISPLAY": ":0"},
                                 {"QT_QPA_PLATFORM": "", "DISPLAY": ":1"}])
def test_xcb_is_checked_when_asked_for_or_by_default_outside_wayland(env):
    assert would_use_xcb(env)


def test_other_systems_are_not_checked(monkeypatch):
    monkeypatch.setattr(platform_check, "run_ldd", lambda library: pytest.fail("ldd ran on Windows"))
    assert platform_problem({}, "win32") is None


def test_no_display_says_to_use_a_desktop_session_or_offscreen():
    message = platform_problem({}, "linux")
    assert "DISPLAY" in message and "QT_QPA_PLATFORM=offscreen" in message


def test_without_ldd_the_start_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))          # an empty folder: no ldd to run
    assert platform_check.run_ldd(platform_check.xcb_plugin_path()) is None
    assert platform_problem(X11_DESKTOP, "linux") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check runs on Linux only")
def test_python_m_app_without_a_display_explains_instead_of_aborting(tmp_path):
    env = {key: value for key, value in os.environ.items()
           if key not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env |= {"WORKBENCH_CONFIG_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "app"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "there is no display" in result.stderr and "QT_QPA_PLATFORM=offscreen" in result.stderr
    assert "Qt platform plugin" not in result.stderr
