"""House rules that a reviewer would otherwise check by hand (style.md §1-2)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for top in ("dflash_train", "convert", "serve_shim") for p in (ROOT / top).rglob("*.py"))
# a stage may import only stages before it: data -> features -> model -> train -> eval
ORDER = ["data", "features", "model", "train", "eval"]
MAX_LINES = 450
# the one modeling file holds the whole drafter top to bottom (style.md §3), so it may run longer
MAX_LINES_MODELING = 550


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import mod` is pkg.mod
    return names


def test_no_utils_junk_drawers():
    assert not [p for p in SOURCES if p.stem in ("utils", "helpers", "misc", "common")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size(path):
    limit = MAX_LINES_MODELING if path.name.startswith("modeling_") else MAX_LINES
    assert len(path.read_text().splitlines()) <= limit, f"{path.name}: split it by job"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_import_direction(path):
    rel = path.relative_to(ROOT).parts
    imports = _imports(path)
    if rel[0] == "dflash_train" and len(rel) > 2 and rel[1] in ORDER:
        stage = ORDER.index(rel[1])
        later = {f"dflash_train.{s}" for s in ORDER[stage + 1:]}
        bad = [i for i in imports if any(i == s or i.startswith(s + ".") for s in later)]
        assert not bad, f"{path.name} imports later stages {bad}"
        # the converters come after every stage: checkpoint formats and tensor I/O live in the model
        assert not [i for i in imports if i.startswith(("serve_shim", "convert"))], f"{path.name} imports {imports}"
    if rel[0] == "convert":
        bad = [i for i in imports if i.startswith("dflash_train.") and not i.startswith((
            "dflash_train.model.config", "dflash_train.errors", "dflash_train.features", "dflash_train.data.vocab",
            "dflash_train.model.checkpoint", "dflash_train.model.modeling_dflash", "dflash_train.model.formats",
            "dflash_train.model.weights", "dflash_train.model.stream", "dflash_train.model.checks",
            "dflash_train.model.locate", "dflash_train.target", "dflash_train.architectures", "dflash_train.outputs",
            "dflash_train.output_lock"))]
        assert not bad, f"{path.name}: convert needs only the model config, checkpoints and formats, got {bad}"
    if rel[0] == "serve_shim":
        bad = [i for i in imports if i.startswith("dflash_train.")
               and not i.startswith(("dflash_train.errors", "dflash_train.model.config", "dflash_train.outputs",
                                     "dflash_train.model.checks", "dflash_train.model.formats",
                                     "dflash_train.model.weights", "dflash_train.model.locate"))]
        assert not bad, f"{path.name}: serve_shim needs only convert's detection, got {bad}"


@pytest.mark.parametrize("name", ["errors", "outputs"])
def test_shared_modules_import_no_stage(name):
    """errors and the output policy are used by every stage, convert and serve_shim: they import none."""
    imports = _imports(ROOT / "dflash_train" / f"{name}.py")
    assert not [i for i in imports if i.startswith(("dflash_train.", "convert", "serve_shim"))
                and not i.startswith("dflash_train.errors")]


def test_core_modules_never_import_typer():
    offenders = [p.name for p in SOURCES if p.name != "cli.py" and "typer" in _imports(p)]
    assert not offenders


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolved_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (relative imports resolved, `from pkg import mod` as pkg.mod)."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules}


def test_no_two_modules_import_each_other():
    """Each shared piece has one home below its users (style.md §1): no module imports one that imports
    it back (a package's __init__ and its own modules excepted)."""
    modules = {_module(p): p for p in SOURCES}
    graph = {m: _resolved_imports(p, set(modules)) - {m} for m, p in modules.items()}
    pairs = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b]
                   and not (b.startswith(a + ".") and modules[a].name == "__init__.py"))
    assert not pairs


def test_data_flows_one_way_through_the_stage_folders():
    """No stage folder imports a later one, not even from one module (target loading lies below them all)."""
    modules = {_module(p): p for p in SOURCES}
    stage = {m: m.split(".")[1] for m in modules if m.count(".") >= 2 and m.split(".")[1] in ORDER}
    for name, path in modules.items():
        if name in stage:
            later = ORDER[ORDER.index(stage[name]) + 1:]
            assert not [m for m in _resolved_imports(path, set(modules)) if stage.get(m) in later], name


def test_one_conftest_for_the_helpers_tests_import():
    """Tests import helpers with `from conftest import ...`; pytest registers every conftest.py as the module
    `conftest`, so a second one shadows the first for whichever tests import after it (a fresh-clone run failed 22
    e2e tests that way, 2026-12-06)."""
    importers = [p for p in (ROOT / "tests").rglob("*.py") if "from conftest import" in p.read_text()]
    assert importers  # the pattern this guards is in use
    assert sorted((ROOT / "tests").rglob("conftest.py")) == [ROOT / "tests" / "conftest.py"]
