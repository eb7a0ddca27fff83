"""`dflash-convert`: formats, validation and hub upload for DFlash drafters."""

from __future__ import annotations

import typer

from dflash_train.errors import DFlashError, run_cli

app = typer.Typer(help="Convert, validate and publish DFlash drafter checkpoints.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


def _not_yet(what: str) -> None:
    raise DFlashError(f"`dflash-convert {what}` is not implemented in this build yet")


@app.command("to-speculators")
def to_speculators() -> None:
    """Convert a z-lab / SpecForge / speculators folder to the speculators format."""
    _not_yet("to-speculators")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
