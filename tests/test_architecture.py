"""Import contracts (napari's way: the architecture stated as tests that fail when it breaks).

engine/ is the request path at the top (TOP_LEVEL) and one subpackage per concept
(docs/architecture.md). Between the subpackages, CONTRACTS say who may not import whom;
engine/ has no import cycles and never imports Qt; only remote/ speaks HTTP; inference never
imports bench/ or training/. In app/, only the worker (and the fidelity tool, which measures
the headless engine, and the screenshot tool, which starts a llama-server) reaches the
engine's running parts."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QT = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "shiboken6")
# The engine's plain-data modules: settings, metrics, profiles, errors. The app may read them.
# engine.workload: the workload's fields (its driver runs only the engine it is handed: the worker's).
# engine.quality.figures: the quality figures' formulas and the Pareto front (numpy only).
PLAIN_DATA = {"engine", "engine.config", "engine.metrics", "engine.profiles", "engine.errors", "engine.workload",
              "engine.quality.figures"}
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


# The request path: what a newcomer reads first. Everything else lives in a subpackage.
TOP_LEVEL = {"engine", "engine.engine", "engine.request", "engine.scheduler", "engine.stream", "engine.config", "engine.metrics", "engine.errors",
             "engine.profiles", "engine.backend", "engine.workload", "engine.cpu_features", "engine.thread_policy",
             "engine.user_cache"}
SUBPACKAGES = {"cache", "kernels", "layers", "models", "loading", "runtime", "speculative", "remote", "bench", "training",
               "quality"}
REQUEST_PATH = ("engine.engine", "engine.request", "engine.scheduler", "engine.stream")
OFFLINE_TOOLS = ("engine.bench", "engine.training")
RUNS_MODELS = ("engine.layers", "engine.models", "engine.runtime", "engine.speculative", "engine.loading")
HTTP = ("httpx", "httpx_sse", "prometheus_client")

# (importer, what it may not import, why). A prefix names a package and everything in it.
CONTRACTS = [
    ("engine.config", ("engine.",), "plain data: the settings table needs nothing else", ("engine.errors",)),
    ("engine.errors", ("engine.",), "plain data", ()),
    ("engine.metrics", ("engine.",), "plain data: every formula from counters alone", ("engine.errors",)),
    ("engine.cache", REQUEST_PATH + RUNS_MODELS, "the cache holds tensors and block ids; it runs no model", ()),
    ("engine.kernels", REQUEST_PATH + ("engine.models", "engine.runtime", "engine.speculative", "engine.loading"),
     "kernels see tensors and attention metadata only", ("engine.layers.attention_metadata",)),
    ("engine.layers", REQUEST_PATH + ("engine.models", "engine.runtime", "engine.speculative", "engine.loading"),
     "building blocks know no model", ()),
    ("engine.models", REQUEST_PATH + ("engine.runtime", "engine.speculative", "engine.loading"),
     "a model is its forward pass; running and loading it happen elsewhere", ()),
    ("engine.loading", REQUEST_PATH + ("engine.runtime", "engine.speculative"), "loading ends where running starts", ()),
    ("engine.runtime", REQUEST_PATH + ("engine.speculative",), "the runner knows no proposer", ()),
    ("engine.speculative", REQUEST_PATH, "proposers are driven by the request path, never the reverse", ()),
    ("engine.quality.figures", ("engine.",), "plain data: the figures from per-token arrays", ()),
    ("engine.remote", REQUEST_PATH + RUNS_MODELS + ("engine.cache", "engine.kernels"),
     "the remote backend runs nothing locally", ()),
]


def engine_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / "engine").rglob("*.py")}


def contract_breaks(modules: dict[str, set[str]]) -> list[str]:
    """Every import a contract forbids, as 'importer imports imported (why)'."""
    breaks = []
    for importer, imports in sorted(modules.items()):
        for scope, forbidden, why, allowed in CONTRACTS:
            if importer != scope and not importer.startswith(scope + "."):
                continue
            for name in sorted(imports):
                if name.startswith(scope + ".") or name == scope or name == "engine":
                    continue
                if any(name == a or name.startswith(a + ".") for a in allowed):
                    continue
                if any(name == f or name.startswith(f if f.endswith(".") else f + ".") for f in forbidden):
                    breaks.append(f"{importer} imports {name} ({why})")
    return breaks


def engine_imports() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(path) if m == "engine" or m.startswith("engine.")}
            for name, path in engine_modules().items()}


def test_engine_is_the_request_path_and_one_subpackage_per_concept():
    outside = sorted(n for n in engine_modules() if n.count(".") < 2 and n not in TOP_LEVEL
                     and n.removeprefix("engine.") not in SUBPACKAGES)
    assert outside == [], f"{outside}: put each in the subpackage of its concept (docs/architecture.md)"
    assert {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"} == SUBPACKAGES


def test_the_subpackages_keep_their_contracts():
    assert contract_breaks(engine_imports()) == []


def test_a_broken_contract_is_named():
    """The checker itself: the cache reaching into the runner breaks the cache's contract."""
    modules = engine_imports()
    modules["engine.cache.kv_cache"] = modules["engine.cache.kv_cache"] | {"engine.runtime.model_runner"}
    assert contract_breaks(modules) == ["engine.cache.kv_cache imports engine.runtime.model_runner "
                                        "(the cache holds tensors and block ids; it runs no model)"]


def test_inference_never_imports_bench_or_training():
    for name, imports in engine_imports().items():
        if not name.startswith(OFFLINE_TOOLS):
            bad = {m for m in imports if m.startswith(OFFLINE_TOOLS)}
            assert not bad, f"{name} imports {sorted(bad)}: inference never imports bench/ or training/"


def test_only_remote_speaks_http():
    for name, path in engine_modules().items():
        if not name.startswith("engine.remote"):
            bad = {m for m in imports_of(path) if m.split(".")[0] in HTTP}
            assert not bad, f"{name} imports {sorted(bad)}: only engine.remote talks to servers"


def test_only_the_worker_runs_the_engine():
    for path in (ROOT / "app").rglob("*.py"):
        name = module_name(path)
        engine_imports = {m for m in imports_of(path) if m == "engine" or m.startswith("engine.")}
        # "engine" is plain data itself (its public names), not a prefix: every module starts with "engine."
        running = {m for m in engine_imports if m not in PLAIN_DATA
                   and not m.startswith(tuple(f"{p}." for p in PLAIN_DATA - {"engine"}))}
        if name not in RUNS_THE_ENGINE:
            assert not running, f"{name} imports {sorted(running)}: only the worker may"
