"""Before Qt starts on Linux: say what stops its X11 (xcb) platform plugin from loading.

Without a display, or without the few xcb libraries a bare Debian/Ubuntu lacks, Qt only
prints "could not load the Qt platform plugin xcb" and aborts. We ask `ldd` which of the
plugin's libraries are missing and name the packages that provide them instead.
Every check here is skipped where it could be wrong, so it never stops a start that works.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

XCB_PLUGIN = Path("platforms") / "libqxcb.so"

# Libraries whose Debian package does not follow the naming rule in debian_package.
PACKAGE_EXCEPTIONS = {
    "libglib-2.0.so.0": "libglib2.0-0",
    "libgthread-2.0.so.0": "libglib2.0-0",
    "libz.so.1": "zlib1g",
}


def platform_problem(env: Mapping[str, str] = os.environ, system: str = sys.platform) -> str | None:
    """What keeps the window from opening, with the fix; None when nothing is known to."""
    if not system.startswith("linux") or not would_use_xcb(env):
        return None
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        return NO_DISPLAY
    ldd_output = run_ldd(xcb_plugin_path())
    missing = missing_libraries(ldd_output) if ldd_output else []
    return missing_libraries_message(missing) if missing else None


def would_use_xcb(env: Mapping[str, str]) -> bool:
    """Whether Qt would load its xcb plugin: asked for by name, or by default outside a
    Wayland session (in one, Qt tries its Wayland plugin first, which needs none of these)."""
    requested = env.get("QT_QPA_PLATFORM", "")
    if requested:
        return requested.startswith("xcb")
    return not (env.get("WAYLAND_DISPLAY") and env.get("XDG_SESSION_TYPE") == "wayland")


def xcb_plugin_path() -> Path:
    # QtCore only: no QGuiApplication may exist yet, and QLibraryInfo honours a qt.conf.
    from PySide6.QtCore import QLibraryInfo
    return Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath)) / XCB_PLUGIN


def run_ldd(library: Path) -> str | None:
    """ldd's report on `library`; None when ldd or the library is not there to ask."""
    if not library.is_file():
        return None
    try:
        return subprocess.run(["ldd", str(library)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def missing_libraries(ldd_output: str) -> list[str]:
    """The sonames ldd marks "=> not found", each once (ldd repeats them per dependant), sorted."""
    missing = set()
    for line in ldd_output.splitlines():
        name, arrow, where = line.strip().partition("=>")
        if arrow and where.strip() == "not found":
            missing.add(name.strip())
    return sorted(missing)


def debian_package(soname: str) -> str:
    """Debian's package for a shared library: the soname's name and version joined, with a
    hyphen between them when the name ends in a digit (Debian policy 8.1), lower case.
    libxcb-icccm.so.4 -> libxcb-icccm4, libxkbcommon-x11.so.0 -> libxkbcommon-x11-0."""
    if soname in PACKAGE_EXCEPTIONS:
        return PACKAGE_EXCEPTIONS[soname]
    name, _, version = soname.partition(".so.")
    joiner = "-" if name[-1:].isdigit() else ""
    return f"{name}{joiner}{version}".lower().replace("_", "-")


def missing_libraries_message(missing: list[str]) -> str:
    packages = sorted({debian_package(soname) for soname in missing})
    return ("Cannot open the workbench window: Qt's X11 (xcb) platform plugin needs system libraries "
            f"that are not installed: {', '.join(missing)}.\n"
            f"On Debian or Ubuntu, install them with:\n    sudo apt-get install {' '.join(packages)}\n"
            "On another distribution, install the packages that provide these libraries. "
            "Then start the workbench again.")


NO_DISPLAY = ("Cannot open the workbench window: there is no display (neither DISPLAY nor WAYLAND_DISPLAY "
              "is set).\nStart it from a desktop session (or over `ssh -X`), or, for a headless run, set "
              "QT_QPA_PLATFORM=offscreen.")
