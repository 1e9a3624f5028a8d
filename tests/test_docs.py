"""The README and docs/ stay true to the code: every command they show runs as written.

- every `python -m engine.bench ...` parses with the bench's own command line
  (engine.bench.cli.parser) and its scenario takes the model flags given
  (engine.bench.model_flags, as the command line checks them before running);
- every other `python -m` module of ours exists, and so does every `scripts/*.sh` and every
  repository path named in code (`engine/...`, `tests/...`);
- every relative link and image resolves, down to the heading a `#anchor` names;
- the README stays a door (at most 200 lines, no work-item numbers); every setting of the app
  is on docs/app.md and every bench scenario on docs/benchmarks.md.

The documents are read as Markdown tokens (markdown-it-py): commands from code spans and
code blocks, links and images from their tokens. The checkers return what is wrong, so the
last tests can show that each one catches a broken document.
"""
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from engine.bench import cli, model_flags
from engine.config import SETTINGS
from engine.errors import WorkbenchError
from engine.workload import WORKLOAD_SETTINGS

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OUR_PACKAGES = {"engine", "app"}                    # `python -m` of anything else is another project's tool
REPO_PATH = re.compile(r"^(engine|app|tests|scripts|resources|docs)/[\w./-]*$")
SCRIPT = re.compile(r"\bscripts/[\w.-]+\.sh\b")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
README_MAX_LINES = 200


def tokens(path: Path):
    """Every token of a Markdown file, inline children included."""
    md = MarkdownIt("commonmark").enable("table")
    for token in md.parse(path.read_text(encoding="utf-8")):
        yield token
        yield from token.children or ()


def code_texts(path: Path) -> list[str]:
    """The text of every code span, and every line of every code block (a line ending in a
    backslash joined to the next, as the shell joins it)."""
    texts = []
    for token in tokens(path):
        if token.type == "code_inline":
            texts.append(token.content)
        elif token.type in ("fence", "code_block"):
            texts.extend(token.content.replace("\\\n", " ").splitlines())
    return texts


def commands(path: Path) -> list[list[str]]:
    """Each `python -m MODULE ARGS` in the file's code, as argv from the module on (the
    environment assignments before it and a trailing `# comment` left out)."""
    found = []
    for text in code_texts(path):
        start = text.find("python -m ")
        if start < 0:
            continue
        try:
            words = shlex.split(text[start:], comments=True)
        except ValueError:                   # an unbalanced quote: not a command
            continue
        for stop in ("|", "&&", ";", ">", "2>&1"):
            if stop in words:
                words = words[:words.index(stop)]
        found.append(words[2:])
    return found


def bench_problems(argv: list[str]) -> list[str]:
    """What is wrong with `python -m engine.bench ARGV`: a flag its parser refuses, or model
    flags its scenario does not take. An upper-case scenario (SCENARIO) is a placeholder; the
    command alone, or with --help, names the tool."""
    if argv in ([], ["--help"]):
        return []
    placeholder = argv[0].isupper()
    parser = cli.parser()
    parser.allow_abbrev = False                 # a flag's prefix would parse, and mislead a reader
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(["all", *argv[1:]] if placeholder else argv)
    except SystemExit:
        why = said.getvalue().strip().splitlines()[-1:]
        return [f"python -m engine.bench {' '.join(argv)}: the bench's parser refuses it ({''.join(why)})"]
    if placeholder or args.scenario == "all":
        return []
    try:
        model_flags.model_source(args.scenario, args)
    except WorkbenchError as refusal:
        return [f"python -m engine.bench {' '.join(argv)}: {refusal}"]
    return []


def command_problems(path: Path) -> list[str]:
    problems = []
    for argv in commands(path):
        module = argv[0] if argv else ""
        if module.split(".")[0] not in OUR_PACKAGES:
            continue
        if module == "engine.bench":
            problems += bench_problems(argv[1:])
        elif importlib.util.find_spec(module) is None:
            problems.append(f"python -m {module}: no such module")
    return problems


def path_problems(path: Path) -> list[str]:
    """Scripts named anywhere, and repository paths named in code, that do not exist."""
    text = path.read_text(encoding="utf-8")
    named = set(SCRIPT.findall(text))
    named |= {word for code in code_texts(path) for word in code.split() if REPO_PATH.match(word)}
    return [f"{name}: no such file or folder" for name in sorted(named) if not (REPO / name.rstrip("/")).exists()]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, heading = set(), False
    for token in tokens(path):
        if token.type == "heading_open":
            heading = True
        elif heading and token.type == "inline":
            found.add(slug(token.content))
            heading = False
    return found


def link_problems(path: Path) -> list[str]:
    problems = []
    for token in tokens(path):
        target = token.attrGet("href") if token.type == "link_open" else (
            token.attrGet("src") if token.type == "image" else None)
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):       # none, or a URL with a scheme
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            problems.append(f"{path.name}: {target} does not resolve")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{path.name}: {target}: no heading with that anchor")
    return problems


@pytest.fixture(params=DOCS, ids=lambda path: path.relative_to(REPO).as_posix())
def doc(request) -> Path:
    return request.param


# ---- the docs ------------------------------------------------------------------------
def test_every_command_shown_runs_as_written(doc):
    assert command_problems(doc) == []


def test_every_script_and_path_named_exists(doc):
    assert path_problems(doc) == []


def test_every_relative_link_and_image_resolves(doc):
    assert link_problems(doc) == []


def test_the_docs_show_bench_commands_and_name_no_work_items():
    shown = [argv for path in DOCS for argv in commands(path) if argv[:1] == ["engine.bench"]]
    assert len(shown) >= 30                     # the checks above have something to check
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bissues? \d+|\bin progress\b", text, re.IGNORECASE), path.name


def test_the_readme_is_a_door():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "scripts/launch.sh" in readme and "scripts/test.sh" in readme     # the two commands (CI runs the second)
    linked = {token.attrGet("href") for token in tokens(REPO / "README.md") if token.type == "link_open"}
    assert {f"docs/{path.name}" for path in DOCS[1:]} <= linked             # a map of every page


def test_every_setting_of_the_app_is_on_its_page():
    shown = {code for code in code_texts(REPO / "docs" / "app.md")}
    settings = [s.key for s in SETTINGS if s.section in ("engine", "sampling")] + [s.key for s in WORKLOAD_SETTINGS]
    assert [key for key in settings if key not in shown] == []


def test_every_bench_scenario_is_on_the_benchmarks_page():
    shown = {code for code in code_texts(REPO / "docs" / "benchmarks.md")}
    assert [name for name in [*cli.SCENARIOS, "all"] if name not in shown] == []


# ---- the checkers catch what they are for ---------------------------------------------
def test_the_checks_catch_a_bad_flag_a_refused_model_a_missing_module_and_script(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `python -m engine.bench decode --no-such-flag --json` and "
                    "`python -m engine.bench peer --busy-core 1 --json`, then\n\n"
                    "```bash\nWORKBENCH_X=1 python -m engine.bench agreement --against llama.cpp \\\n"
                    "    --model folder --json   # a folder: llama.cpp reads GGUF only\n"
                    "python -m engine.no_such_tool\nbash scripts/no_such.sh\n```\n"
                    "and `python -m engine.bench peer --model m.gguf --json`, `python -m vllm.whatever`.\n")
    problems = command_problems(page)
    assert len(problems) == 4
    assert "--no-such-flag" in problems[0] and "refuses" in problems[0]
    assert "--busy-core 1" in problems[1] and "refuses" in problems[1]      # a prefix of --busy-cores
    assert "agreement" in problems[2] and "GGUF" in problems[2]
    assert "engine.no_such_tool" in problems[3]
    assert path_problems(page) == ["scripts/no_such.sh: no such file or folder"]


def test_the_checks_catch_a_broken_link_image_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) ![pic](pic.png) "
                    "[bad anchor](other.md#no-such-section) [web](https://example.com/x)\n")
    assert link_problems(page) == ["page.md: missing.md does not resolve", "page.md: pic.png does not resolve",
                                   "page.md: other.md#no-such-section: no heading with that anchor"]
