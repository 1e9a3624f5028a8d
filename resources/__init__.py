"""Data shipped with the workbench: built-in profiles, the style sheet, icons and the
draft for the default model, the quality measurement's reference text. A package (data only, no code) so that a plain, non-editable
`pip install .` installs these files next to `engine` and `app`."""
from pathlib import Path

RESOURCES_DIR = Path(__file__).resolve().parent
PROFILES_DIR = RESOURCES_DIR / "profiles"
DRAFTS_DIR = RESOURCES_DIR / "drafts"
STYLE_SHEET = RESOURCES_DIR / "style.qss"
APP_ICON = RESOURCES_DIR / "icons" / "workbench.svg"
QUALITY_TEXT = RESOURCES_DIR / "quality" / "reference_text.txt"
