"""Session profiles: every setting of a workbench session as versioned JSON data.

A profile file is plain data, never code:
    {"format": "inference-workbench-profile", "version": 2, "name": ..., "model": ..., ...}
with one key per row of engine.config.SETTINGS (the settings table), "workload": the
load panel's serving workload (engine.workload.Workload, its fields; missing ones at their
defaults), and "quality": what these settings were measured to cost in quality (a row of
engine.quality: on which model and text, when, KL divergence, perplexity change, decode tok/s),
or null where never measured.
Profiles live in platformdirs' user_config_dir("inference-workbench")/profiles; the
environment variable WORKBENCH_CONFIG_DIR replaces the config dir (tests use tmp dirs).
Writes are atomic (temp file + os.replace), so a crash never leaves half a profile.
A corrupt file, or one from a newer workbench, raises ProfileError and changes nothing.
Qt-free: the app and headless scripts share it.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, field, make_dataclass
from pathlib import Path

from engine import config
from engine.config import EngineConfig, SamplingParams
from engine.errors import ConfigError, WorkbenchError
from engine.workload import Workload
from resources import PROFILES_DIR

FORMAT = "inference-workbench-profile"
# 1: the first 14 settings. 2: every row of engine.config.SETTINGS (n-gram sizes, pool,
# device, dtype, ...); a version 1 file reads as is, the new settings at their defaults.
# 3: "workload" (engine.workload); an older file reads with the default workload.
# 4: "quality" (engine.quality's row for these settings, or null); an older file reads with none.
VERSION = 4
APP_NAME = "inference-workbench"
LAST_SESSION_FILE = "last_session.json"
RECENT_FILE = "recent.json"
MAX_RECENT = 10
_NAME_PATTERN = re.compile(r"^[\w][\w .-]{0,63}$")


class ProfileError(WorkbenchError):
    """A profile that cannot be read, parsed or written; the message names the file and the fix."""


class _ProfileMethods:
    def __post_init__(self):
        # Every value is checked against its row of the settings table, so a profile can
        # never hold a setting the engine would refuse.
        for key in self.__dataclass_fields__:
            if key not in (WORKLOAD_KEY, QUALITY_KEY):
                object.__setattr__(self, key, config.validate(key, getattr(self, key)))
        if not isinstance(self.workload, Workload):          # plain data from a file
            object.__setattr__(self, WORKLOAD_KEY, Workload.from_dict(self.workload))
        if self.quality is not None and not isinstance(self.quality, dict):
            raise ConfigError(f"quality must be a measurement (an object) or null, got {type(self.quality).__name__}")
        self.engine_config()

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(**{key: getattr(self, key) for key in config.keys(config.ENGINE)} | overrides)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**{key: getattr(self, key) for key in config.keys(config.SAMPLING)})

    def engine_settings(self) -> dict:
        """Keyword arguments for LLMEngine.reconfigure: the settings that change without a reload."""
        return {key: getattr(self, key) for key in config.keys(config.ENGINE, applies=(config.LIVE, config.NEXT_REQUEST))}

    def to_json_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json_dict(cls, data, source: str = "profile") -> "SessionProfile":
        _check_header(data, source)
        values = {k: v for k, v in data.items() if k not in ("format", "version")}
        unknown = sorted(set(values) - set(config.BY_KEY) - {WORKLOAD_KEY, QUALITY_KEY})
        if unknown:
            raise ProfileError(f"{source}: unknown settings {unknown}; remove them or fix their spelling")
        # An older version lacks the settings added since: they take their defaults.
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ProfileError(f"{source}: {exc}") from exc


# Every row of the settings table is a profile field, with the table's default; the workload;
# and the measured quality.
WORKLOAD_KEY = "workload"
QUALITY_KEY = "quality"
SessionProfile = make_dataclass(
    "SessionProfile", [(s.key, s.type if not s.optional else s.type | None, field(default=s.default))
                       for s in config.SETTINGS] + [(WORKLOAD_KEY, Workload, field(default_factory=Workload)),
                                                    (QUALITY_KEY, dict | None, field(default=None))],
    bases=(_ProfileMethods,), frozen=True,
    namespace={"__doc__": "Every setting of a session (engine.config.SETTINGS) as plain data.",
               "__module__": __name__})


def _check_header(data, source: str) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{source} is not an inference-workbench profile (no \"format\": \"{FORMAT}\")")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ProfileError(f"{source}: \"version\" must be a positive integer, got {version!r}")
    if version > VERSION:
        raise ProfileError(f"{source} was written by a newer workbench (profile version {version}; this one "
                           f"reads version {VERSION}); update the workbench to open it")


def config_dir() -> Path:
    from platformdirs import user_config_dir
    return Path(os.environ.get("WORKBENCH_CONFIG_DIR") or user_config_dir(APP_NAME))


def builtin_profiles() -> dict[str, Path]:
    """Profiles shipped in resources/profiles, by name (file stem)."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.json"))}


def read_profile(path: str | os.PathLike) -> SessionProfile:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                           "fix the file or delete it") from exc
    return SessionProfile.from_json_dict(data, source=str(path))


def find_profile(name_or_path: str | os.PathLike, store: "ProfileStore | None" = None) -> tuple[SessionProfile, Path]:
    """A profile by name (the user's saved ones, then the built-ins) or by path, and its file:
    a script's look-up, which leaves the user's recent list as it was."""
    path = (store or ProfileStore()).locate(name_or_path)
    return read_profile(path), path


def write_json_atomic(path: Path, data) -> None:
    """Write to a temp file in the same folder, then os.replace: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ProfileStore:
    """The user's profiles folder, the recent list and the last session."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else config_dir()
        self.profiles_dir = self.root / "profiles"

    # ---- named profiles -------------------------------------------------------
    def path_for(self, name: str) -> Path:
        if not _NAME_PATTERN.match(name or ""):
            raise ProfileError(f"{name!r} is not a usable profile name: use letters, digits, spaces, '.', '_' "
                               "or '-' (at most 64 characters, not starting with '.' or '-')")
        return self.profiles_dir / f"{name}.json"

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.profiles_dir.glob("*.json")) if self.profiles_dir.is_dir() else []

    def save(self, profile: SessionProfile, name: str | None = None) -> Path:
        """Save under `name` (default: the profile's own name); returns the file written."""
        name = profile.name if name is None else name
        path = self.path_for(name)
        data = profile.to_json_dict() | {"name": name}
        try:
            write_json_atomic(path, data)
        except OSError as exc:
            raise ProfileError(f"cannot save profile {name!r} to {path}: {exc.strerror or exc}") from exc
        self.add_recent(path)
        return path

    def load(self, name_or_path: str | os.PathLike) -> SessionProfile:
        """A saved profile by name, a built-in by name, or any profile file by path."""
        path = self.locate(name_or_path)
        profile = read_profile(path)
        self.add_recent(path)
        return profile

    def locate(self, name_or_path: str | os.PathLike) -> Path:
        text = str(name_or_path)
        if text.endswith(".json") or os.sep in text or "/" in text:
            return Path(text).expanduser()
        own = self.path_for(text)
        if own.is_file():
            return own
        builtin = builtin_profiles().get(text)
        if builtin is not None:
            return builtin
        raise ProfileError(f"no profile named {text!r} in {self.profiles_dir} or the built-in profiles "
                           f"({', '.join(builtin_profiles())}); give one of those or a profile file's path")

    def delete(self, name: str) -> None:
        path = self.path_for(name)
        if not path.is_file():
            raise ProfileError(f"no profile named {name!r} to delete in {self.profiles_dir}")
        path.unlink()
        self._write_recent([p for p in self.recent() if p != path])

    # ---- recent list ----------------------------------------------------------
    def recent(self) -> list[Path]:
        """Recently saved or loaded profile files that still exist, newest first."""
        try:
            entries = json.loads((self.root / RECENT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []     # the recent list is a convenience: a broken one is just empty
        if not isinstance(entries, list):
            return []
        return [Path(e) for e in entries if isinstance(e, str) and Path(e).is_file()]

    def add_recent(self, path: Path) -> None:
        path = Path(path).resolve()
        self._write_recent([path] + [p for p in self.recent() if p.resolve() != path])

    def _write_recent(self, paths: list[Path]) -> None:
        try:
            write_json_atomic(self.root / RECENT_FILE, [str(p) for p in paths[:MAX_RECENT]])
        except OSError:
            pass          # never fail a save or load because the recent list could not be updated

    # ---- last session ---------------------------------------------------------
    def save_last_session(self, profile: SessionProfile) -> None:
        try:
            write_json_atomic(self.root / LAST_SESSION_FILE, profile.to_json_dict() | {"name": "last_session"})
        except OSError as exc:
            raise ProfileError(f"cannot save the session to {self.root}: {exc.strerror or exc}") from exc

    def load_last_session(self) -> SessionProfile | None:
        path = self.root / LAST_SESSION_FILE
        return read_profile(path) if path.is_file() else None

    def startup_profile(self, path: str | os.PathLike | None = None) -> tuple[SessionProfile, str | None]:
        """What the app starts from: the given profile, else the last session, else defaults.
        Returns (profile, warning); a broken file gives defaults plus a warning, never a crash."""
        try:
            if path is not None:
                return self.load(path), None
            return self.load_last_session() or SessionProfile(), None
        except ProfileError as exc:
            return SessionProfile(), f"{exc} — starting with the default settings"
