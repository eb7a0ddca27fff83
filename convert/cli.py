"""`dflash-convert`: formats, validation and hub upload for DFlash drafters."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dflash_train.errors import CheckpointError, run_cli

app = typer.Typer(help="Convert, validate and publish DFlash drafter checkpoints.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


def _report(result) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    if result.dropped:
        console.print(f"dropped {len(result.dropped)} tensors other writers store: {', '.join(result.dropped[:6])}"
                      + (" ..." if len(result.dropped) > 6 else ""))
    print(f"wrote {result.format} drafter to {result.out} ({', '.join(result.files)}) from {result.source} "
          f"({result.source_format})")


OVERWRITE_HELP = ("replace OUT when it is an earlier dflash-toolkit output (never a folder the toolkit did not "
                  "write, never the source)")
OUT_HELP = "output folder: a new path (an existing one only with --overwrite)"


def _layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise CheckpointError(f"--layer-ids {text!r}: expected integers like 1,8,14,20,27") from None


@app.command("to-speculators")
def to_speculators(
    src: Path = typer.Argument(..., help="z-lab / SpecForge / speculators folder, or a training run folder"),
    out: Path = typer.Argument(..., help=OUT_HELP),
    verifier: str | None = typer.Option(None, help="target hub id (or folder) written as the verifier"),
    block_size: int | None = typer.Option(None, help="override the block size B (speculative tokens = B-1)"),
    mask_token_id: int | None = typer.Option(None, help="mask id (needed when the source names it by string)"),
    layer_ids: str | None = typer.Option(None, help="z-lab target layer ids, e.g. 1,8,14,20,27 (aux = id+1)"),
    max_shard_gb: float = typer.Option(2.0, help="shard the weights above this size"),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
) -> None:
    """Convert to the speculators format (what `vllm serve DIR` auto-detects)."""
    from convert.convert import convert_checkpoint
    from dflash_train.output_lock import output_lock

    with output_lock(out, "OUT", "to-speculators"):
        _report(convert_checkpoint(src, out, "speculators", verifier=verifier, block_size=block_size,
                                   mask_token_id=mask_token_id, layer_ids=_layer_ids(layer_ids),
                                   max_shard_bytes=int(max_shard_gb * 1024**3), overwrite=overwrite))


@app.command("to-zlab")
def to_zlab(
    src: Path = typer.Argument(..., help="speculators / z-lab folder, or a training run folder"),
    out: Path = typer.Argument(..., help=OUT_HELP),
    expand_vocab: bool = typer.Option(False, help="rebuild a full-vocab drafter from a reduced one "
                                      "(borrows the target's LM head)"),
    target: str | None = typer.Option(None, help="target folder or hub id for --expand-vocab "
                                         "(default: embedded SmolLM2)"),
    mask_token_id: int | None = typer.Option(None, help="mask id (needed when the source names it by string)"),
    max_shard_gb: float = typer.Option(2.0, help="shard the weights above this size"),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
) -> None:
    """Convert to the z-lab format (SGLang and HF remote code)."""
    from dflash_train.output_lock import output_lock

    with output_lock(out, "OUT", "to-zlab"):
        _to_zlab(src, out, expand_vocab, target, mask_token_id, int(max_shard_gb * 1024**3), overwrite)


def _to_zlab(src: Path, out: Path, expand_vocab: bool, target, mask_token_id, max_bytes: int, overwrite: bool) -> None:
    from convert.convert import convert_checkpoint, read_source
    from convert.vocab import expand_vocab as expand
    from dflash_train.outputs import plan_output

    plan_output(out, "OUT", sources=[src, target], overwrite=overwrite)
    source = read_source(src, mask_token_id=mask_token_id, target=target)
    if source.config.reduced_vocab and not expand_vocab:
        raise CheckpointError(
            f"{source.folder}: reduced-vocab drafter (draft_vocab_size {source.config.draft_vocab_size} < "
            f"{source.config.vocab_size}); SGLang cannot serve it (it always uses the target's LM head). "
            "Pass --expand-vocab (with --target) to drop lm_head/d2t/t2d and borrow the target head; that is exact "
            "on the kept ids only if the draft lm_head rows equal the target's rows [t2d]")
    if expand_vocab:
        _report(expand(src, out, "zlab", target=target, max_shard_bytes=max_bytes, overwrite=overwrite))
    else:
        _report(convert_checkpoint(src, out, "zlab", source=source, max_shard_bytes=max_bytes, overwrite=overwrite))


@app.command("validate")
def validate(
    folder: Path = typer.Argument(..., help="drafter folder to check"),
    target: str | None = typer.Option(None, help="also check against this target (folder or hub id; "
                                         "'default' = embedded SmolLM2)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Check a folder against every loader rule of vLLM 0.33 and SGLang; exit 1 on any failure."""
    from convert.validate import validate_folder
    from dflash_train.model.checks import FAIL, PASS, WARN

    use_target = target is not None
    report = validate_folder(folder, None if target == "default" else target, use_target=use_target)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{folder} ({report.format or 'unknown format'})")
        table.add_column("check")
        table.add_column("result")
        table.add_column("reason", overflow="fold")
        style = {PASS: "green", FAIL: "bold red", WARN: "yellow"}
        for c in report.checks:
            table.add_row(c.check, f"[{style.get(c.status, 'white')}]{c.status}[/]", c.reason)
        console = Console(width=160)
        console.print(table)
        n = len(report.failures())
        console.print(f"{'[green]OK' if report.ok else f'[bold red]{n} check(s) failed'}[/]")
    if not report.ok:
        raise typer.Exit(1)


@app.command("reduce-vocab")
def reduce_vocab(
    src: Path = typer.Argument(..., help="full-vocab drafter folder (any format) or run folder"),
    out: Path = typer.Argument(..., help=OUT_HELP + ", speculators format"),
    token_freq: Path = typer.Option(..., help="token_freq.json (from `dflash-train prepare`) or its folder"),
    size: int = typer.Option(..., help="draft vocab size Vd"),
    target: str | None = typer.Option(None, help="target folder or hub id (default: embedded SmolLM2)"),
    max_shard_gb: float = typer.Option(2.0, help="shard the weights above this size"),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
) -> None:
    """Keep the Vd most frequent ids: lm_head = the target LM-head rows where t2d is set, plus d2t/t2d."""
    from convert.vocab import reduce_vocab as reduce
    from dflash_train.output_lock import output_lock

    with output_lock(out, "OUT", "reduce-vocab"):
        _report(reduce(src, out, token_freq, size, target=target, max_shard_bytes=int(max_shard_gb * 1024**3),
                       overwrite=overwrite))


@app.command("push-to-hub")
def push_to_hub(
    folder: Path = typer.Argument(..., help="validated drafter folder"),
    repo_id: str = typer.Argument(..., help="ORG/NAME on the hub"),
    private: bool = typer.Option(False, help="create the repo private"),
    revision: str | None = typer.Option(None, help="branch to commit to (created if missing)"),
    token_env: str = typer.Option("HF_TOKEN", help="environment variable holding the token (else the HF cache)"),
    license: str | None = typer.Option(None, help="license for the card (default: summary.json's, else 'other')"),
    dry_run: bool = typer.Option(False, help="list the files and print the card; upload nothing"),
) -> None:
    """Validate, write a model card and upload only the checkpoint files."""
    from convert.hub import check_token_env, plan_push, push

    check_token_env(token_env)  # before any output: a token passed here by mistake is never echoed
    plan = plan_push(folder, repo_id, private=private, revision=revision, license=license)
    for note in plan.notes:
        print(f"note: {note}")
    print(f"files for {repo_id}{'@' + revision if revision else ''}:")
    for name in plan.files:
        print(f"  {name}")
    if dry_run:
        print("--- README.md (model card) ---")
        print(plan.card)
        print("dry run: nothing uploaded")
        return
    url = push(plan, token_env=token_env)
    print(f"uploaded {len(plan.files)} files: {url}")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
