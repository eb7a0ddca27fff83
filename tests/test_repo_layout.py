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
# target loading is the root of the pipeline: the data stage renders with the target's tokenizer
# and regenerates with the target, so it may use this one features module
SHARED_ROOTS = ("dflash_train.features.target",)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
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
        bad = [i for i in imports if any(i == s or i.startswith(s + ".") for s in later) and i not in SHARED_ROOTS]
        assert not bad, f"{path.name} imports later stages {bad}"
        assert not [i for i in imports if i.startswith("serve_shim")]
    if rel[0] == "convert":
        bad = [i for i in imports if i.startswith("dflash_train.") and not i.startswith((
            "dflash_train.model.config", "dflash_train.errors", "dflash_train.features", "dflash_train.data.vocab",
            "dflash_train.model.checkpoint", "dflash_train.model.modeling_dflash", "dflash_train.outputs",
            "dflash_train.output_lock"))]
        assert not bad, f"{path.name}: convert needs only the model config, checkpoints and formats, got {bad}"
    if rel[0] == "serve_shim":
        bad = [i for i in imports if i.startswith("dflash_train.")
               and not i.startswith(("dflash_train.errors", "dflash_train.model.config", "dflash_train.outputs"))]
        assert not bad, f"{path.name}: serve_shim needs only convert's detection, got {bad}"


@pytest.mark.parametrize("name", ["errors", "outputs"])
def test_shared_modules_import_no_stage(name):
    """errors and the output policy are used by every stage, convert and serve_shim: they import none."""
    imports = _imports(ROOT / "dflash_train" / f"{name}.py")
    assert not [i for i in imports if i.startswith(("dflash_train.", "convert", "serve_shim"))
                and i != "dflash_train.errors"]


def test_core_modules_never_import_typer():
    offenders = [p.name for p in SOURCES if p.name != "cli.py" and "typer" in _imports(p)]
    assert not offenders
