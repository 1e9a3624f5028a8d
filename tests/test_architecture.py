"""Import contracts: engine/ has no import cycles and never imports Qt; inference never
imports the training recipe; in app/, only the worker (and the fidelity tool, which
measures the headless engine, and the screenshot tool, which starts a llama-server) reaches the
engine's running parts."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QT = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "shiboken6")
# The engine's plain-data modules: settings, metrics, profiles, errors. The app may read them.
PLAIN_DATA = {"engine", "engine.config", "engine.metrics", "engine.profiles", "engine.errors"}
RUNS_THE_ENGINE = {"app.engine_worker", "app.fidelity", "app.screenshot"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module imported anywhere in the file (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_graph(package: str) -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in files and m != name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}        # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [node])
                if cycle:
                    return cycle
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def test_engine_has_no_import_cycle():
    graph = package_graph("engine")
    # `engine/__init__` re-exports LLMEngine lazily; every engine module imports the package
    # implicitly, so edges into the package itself are not cycles of our making.
    graph = {name: deps - {"engine"} for name, deps in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_engine_never_imports_qt():
    for path in (ROOT / "engine").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.split(".")[0] in QT}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


TRAINING = {"engine.distill", "engine.distill_data"}     # the recipe and its data generator


def test_inference_never_imports_the_training_recipe():
    importers = [module_name(p) for p in (ROOT / "engine").rglob("*.py")
                 if imports_of(p) & TRAINING and module_name(p) not in TRAINING]
    assert importers == []


def test_only_the_worker_runs_the_engine():
    for path in (ROOT / "app").rglob("*.py"):
        name = module_name(path)
        engine_imports = {m for m in imports_of(path) if m == "engine" or m.startswith("engine.")}
        running = {m for m in engine_imports if m not in PLAIN_DATA and not m.startswith(tuple(f"{p}." for p in PLAIN_DATA))}
        if name not in RUNS_THE_ENGINE:
            assert not running, f"{name} imports {sorted(running)}: only the worker may"
