"""`dflash-serve`: start vLLM (or SGLang) on a DFlash drafter with the right flags."""

from __future__ import annotations

import typer

from dflash_train.errors import DFlashError, run_cli

app = typer.Typer(help="Serve a DFlash drafter with vLLM or SGLang.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.command("stats")
def stats(url: str) -> None:
    """Read acceptance metrics from a running server's /metrics."""
    raise DFlashError("`dflash-serve stats` is not implemented in this build yet")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
