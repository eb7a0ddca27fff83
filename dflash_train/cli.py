"""`dflash-train`: data preparation, feature extraction, training and evaluation of drafters.

Only this module reads argv and prints for humans; heavy imports happen inside commands so
`--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dflash_train.errors import run_cli

app = typer.Typer(help="Train DFlash drafters for a target model.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)

TARGET_HELP = "Target model: HF folder or hub id (default: the embedded SmolLM2-135M-Instruct)."
OVERWRITE_HELP = ("Replace outputs an earlier dflash-toolkit command wrote (never files or folders it did not write, "
                  "never a source).")


@app.command("target-info")
def target_info(target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
                num_features: int = typer.Option(5, help="Number of target layers the drafter reads."),
                json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Locate (and on first use convert) the target; print its architecture, shape, default layer ids,
    a spare mask token and whether vLLM / SGLang serve DFlash drafters for it."""
    import json

    from dflash_train.features.target_info import describe_target

    info = describe_target(target, num_features)
    if json_out:
        typer.echo(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            typer.echo(f"{k:28s} {v}")


@app.command("init-drafter")
def init_drafter(output: Path = typer.Option(..., "--output", help="Folder to write the drafter to."),
                 target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
                 num_layers: int = typer.Option(1, help="Draft decoder layers."),
                 block_size: int = typer.Option(8, help="Block size B (B-1 speculative tokens)."),
                 mask_token_id: Optional[int] = typer.Option(None, help="Mask token id (default: by target)."),
                 num_features: int = typer.Option(5, help="Number of target layers the drafter reads."),
                 seed: int = typer.Option(0, help="Initialisation seed."),
                 overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP)) -> None:
    """Write a freshly initialised drafter for the target in the speculators format."""
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.init import new_drafter_for_target
    from dflash_train.output_lock import output_lock
    from dflash_train.outputs import plan_output

    with output_lock(output, "--output", "init-drafter"):
        plan_output(output, "--output", sources=[target], overwrite=overwrite)
        model = new_drafter_for_target(target, num_layers=num_layers, block_size=block_size,
                                       mask_token_id=mask_token_id, num_features=num_features, seed=seed)
        save_drafter(model, output, overwrite=overwrite, command="init-drafter", flag="--output", sources=[target])
    typer.echo(f"wrote {output}")


@app.command("prepare")
def prepare(data: list[str] = typer.Option(..., "--data", help="Hub dataset id, local JSON/JSONL/Parquet file or "
                                           "folder, or a shipped dataset: sharegpt, chitchat. Repeat it to mix "
                                           "sources: rows then carry a `source` label (eval reports tau per "
                                           "source) and --max-samples applies to each."),
            output: Path = typer.Option(..., "--output", help="Folder to write the prepared dataset to."),
            target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
            max_samples: Optional[int] = typer.Option(None, "--max-samples", help="Read at most N conversations."),
            max_length: int = typer.Option(2048, "--max-length", help="Truncate rendered rows to L tokens."),
            split: Optional[str] = typer.Option(None, "--split", help="Hub dataset split (default: train)."),
            subset: Optional[str] = typer.Option(None, "--subset", help="Hub dataset config name."),
            max_turns: Optional[int] = typer.Option(None, "--max-turns",
                                                    help="Keep each conversation up to its N-th assistant turn."),
            overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP)) -> None:
    """Render conversations with the target's chat template; mask assistant tokens; count token frequencies."""
    import json

    from dflash_train.data.prepare import prepare_dataset
    from dflash_train.output_lock import output_lock

    with output_lock(output, "--output", "prepare"):
        summary = prepare_dataset(target, data[0] if len(data) == 1 else data, output, max_samples=max_samples,
                                  max_length=max_length, split=split, subset=subset, max_turns=max_turns,
                                  overwrite=overwrite)
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "inputs"}, indent=2))
    typer.echo(f"wrote {output}")


@app.command("regenerate")
def regenerate(data: Path = typer.Option(..., "--data", help="A prepared dataset folder (from `prepare`)."),
               output: Path = typer.Option(..., "--output", help="Folder to write the regenerated dataset to."),
               target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
               max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Longest answer per turn."),
               temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
               thinking: Optional[str] = typer.Option(None, "--thinking", help="on|off: the template's "
                                                      "enable_thinking (default: the template's default)."),
               engine: str = typer.Option("hf", "--engine", help="hf (transformers generate), vllm (here or in $DFLASH_VLLM_PYTHON / the `make vllm-venv` venv), or auto (vllm where it runs, else hf)."),
               batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Conversations taken together "
                                                        "(default 256 on CPU, 16384 on CUDA, where each turn's prompts "
                                                        "are sorted by length and cut into groups sized to the free "
                                                        "GPU memory)."),
               seed: int = typer.Option(0, "--seed", help="Sampling seed."),
               dtype: str = typer.Option("auto", "--dtype", help="What the target generates in: auto (bfloat16 "
                                         "on CUDA, float32 on CPU), float32 or bfloat16."),
               overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP)) -> None:
    """Replace every assistant turn with the target's own answer (resumable)."""
    import json

    from dflash_train.data.regenerate import regenerate_dataset
    from dflash_train.errors import ConfigError

    if thinking not in (None, "on", "off"):
        raise ConfigError(f"--thinking {thinking!r}: use on or off")
    from dflash_train.output_lock import output_lock

    with output_lock(output, "--output", "regenerate"):
        summary = regenerate_dataset(target, data, output, max_new_tokens=max_new_tokens, temperature=temperature,
                                     thinking=None if thinking is None else thinking == "on", engine=engine,
                                     batch_size=batch_size, seed=seed, dtype=dtype, overwrite=overwrite)
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "inputs"}, indent=2))
    typer.echo(f"wrote {output}")


@app.command("features")
def features(ctx: typer.Context,
             data: Optional[Path] = typer.Option(None, "--data", help="A prepared dataset folder."),
             output: Optional[Path] = typer.Option(None, "--output", help="Feature cache folder (resumable)."),
             config: Optional[Path] = typer.Option(None, "--config", help="Instead of --data and --output: write the "
                                                   "cache this recipe's `train` reads (its rows prepared and "
                                                   "regenerated first, its teacher, its labels' greedy tokens) into "
                                                   "the data cache, where `train` finds it."),
             overrides: list[str] = typer.Option([], "--set", help="With --config: override a recipe field."),
             target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
             layer_ids: Optional[list[str]] = typer.Option(None, "--layer-ids", help="z-lab target layer ids, "
                                                           "e.g. 1,8,14 or repeated (default: z-lab's choice of 5)."),
             batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Rows per target forward "
                                                      "(default 8 on CPU; on CUDA no row limit, see --batch-tokens)."),
             batch_tokens: Optional[int] = typer.Option(None, "--batch-tokens", help="Padded tokens per forward "
                                                        "(default on CUDA: 65536 or what fits the free memory)."),
             io_threads: Optional[int] = typer.Option(None, "--io-threads", help="Writer threads (default 1 on "
                                                      "CPU, 4 on CUDA)."),
             rows_per_shard: int = typer.Option(256, "--rows-per-shard", help="Rows per safetensors shard."),
             topk: Optional[int] = typer.Option(None, "--topk", help="Also store the target's top-k next-token "
                                                "log-probs per token (objective.loss: kl; its kl_topk, e.g. 32)."),
             target_dtype: str = typer.Option("auto", "--target-dtype", help="What the target computes in: auto "
                                              "(bfloat16 on CUDA, float32 on CPU), float32 or bfloat16 "
                                              "(data.target_dtype)."),
             greedy: bool = typer.Option(True, "--greedy/--no-greedy", help="Store the target's greedy next "
                                         "tokens (objective.labels: greedy). --no-greedy, for dataset labels, "
                                         "skips the LM head (~1.2x faster for SmolLM2).")) -> None:
    """Write offline target features (sharded safetensors + manifest)."""
    from dflash_train.errors import ConfigError
    from dflash_train.features.cache import FeatureCache, bytes_per_token, write_feature_cache

    if config is not None:
        # every writer flag given on the command line (the recipe decides them, or the cache writer's defaults do):
        # refused, not silently ignored
        given = [flag for name, flag in (("data", "--data"), ("output", "--output"), ("target", "--target"),
                                         ("layer_ids", "--layer-ids"), ("topk", "--topk"),
                                         ("batch_size", "--batch-size"), ("batch_tokens", "--batch-tokens"),
                                         ("io_threads", "--io-threads"), ("rows_per_shard", "--rows-per-shard"),
                                         ("target_dtype", "--target-dtype"), ("greedy", "--no-greedy"))
                 if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]  # typer's own click
        if given:
            raise ConfigError(f"{', '.join(given)}: not with --config, where the recipe says them (--set "
                              "target=..., drafter.target_layer_ids=..., objective.kl_topk=..., "
                              "data.target_dtype=..., objective.labels=...)")
        from dflash_train.train.data_stage import recipe_feature_cache
        from dflash_train.train.recipe import load_recipe

        path, stats = recipe_feature_cache(load_recipe(config, list(overrides))).path, {}
    elif data is None or output is None:
        raise ConfigError("give --data (prepared rows) and --output (the cache folder), or --config (a recipe)")
    elif overrides:
        raise ConfigError("--set: only with --config (it overrides the recipe's fields)")
    else:
        try:
            ids = [int(x) for v in layer_ids or [] for x in v.replace(",", " ").split()]
        except ValueError:
            raise ConfigError(f"--layer-ids {layer_ids}: give integers, e.g. --layer-ids 1,8,14,20,27") from None
        from dflash_train.output_lock import output_lock

        stats: dict = {}
        with output_lock(output, "--output", "features"):
            path = write_feature_cache(target, data, output, target_layer_ids=ids or None, batch_size=batch_size,
                                       rows_per_shard=rows_per_shard, batch_tokens=batch_tokens,
                                       io_threads=io_threads, stats=stats, topk=topk, target_dtype=target_dtype,
                                       greedy=greedy)
    m = FeatureCache(path).manifest
    per_token = bytes_per_token(m["feature_dim"], m["dtype"], m["topk"])
    greedy_note = {True: "", False: ", without greedy tokens", "prompts": ", greedy tokens at the prompts' positions"}
    typer.echo(f"wrote {path}: {m['num_rows']} rows, {m['num_tokens']} tokens, {len(m['shards'])} shards, "
               f"layers {m['target_layer_ids']} computed in {m.get('target_dtype', 'float32')}"
               + greedy_note[m.get("greedy_next", True)] + f"; {per_token * 1e6 / 1e9:.2f} GB per 1M tokens "
               f"({len(m['target_layer_ids'])} layers x {m['hidden_size']} {m['dtype']} + 17 bytes of ids and mask"
               + (f" + {6 * m['topk']} of top-{m['topk']} log-probs" if m["topk"] else "")
               + (f" over the drafter's {m['topk_vocab'].split('-')[0]} ids)" if m.get("topk_vocab") else ")"))
    if stats.get("tokens"):
        typer.echo(f"computed {stats['tokens']} tokens in {stats['seconds']:.1f} s "
                   f"({stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tokens/s); the forward waited "
                   f"{stats['waited_s']:.1f} s on the writers")


@app.command("train")
def train(config: Path = typer.Option(..., "--config", help="Recipe YAML (see recipes/)."),
          output: Optional[Path] = typer.Option(None, "--output", help="Run folder (default: runs/<recipe name>)."),
          max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after N optimizer steps."),
          save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps."),
          resume: Optional[str] = typer.Option(None, "--resume", metavar="[auto]",
                                               help="Continue the run in --output from its newest whole checkpoint "
                                                    "(an error when there is none); `--resume auto` starts the run "
                                                    "when there is nothing to resume."),
          overrides: list[str] = typer.Option([], "--set", help="Override a recipe field: --set optim.lr=1e-4."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe and print it; train nothing."),
          local_rank: int = typer.Option(0, "--local_rank", "--local-rank", hidden=True,
                                         help="Set by the deepspeed launcher.")) -> None:
    """Train a drafter from a recipe; the drafter lands in OUTPUT/final (speculators format)."""
    from dflash_train.train.auto_dtypes import resolve_auto_dtypes
    from dflash_train.train.init_from import resolve_init_from
    from dflash_train.train.recipe import load_recipe

    flags = list(overrides)
    if max_steps is not None:
        flags.append(f"optim.max_steps={max_steps}")
    if save_every is not None:
        flags.append(f"checkpoint.save_every={save_every}")
    resolved = load_recipe(config, flags)
    if dry_run:
        resolved = resolve_auto_dtypes(resolve_init_from(resolved))  # `# auto: ...` says what it picked, and why
        typer.echo(resolved.to_yaml(), nl=False)
        return
    from dflash_train.output_lock import output_lock
    from dflash_train.train.loop import train as run_training

    out = output or Path("runs") / config.stem
    with output_lock(out, "--output", "train"):  # rank 0 holds it for every rank
        summary = run_training(resolved, out, resume=resume, sources=[config],
                               notify=lambda msg: typer.echo(msg, err=True))
    if summary.get("nothing_to_do"):
        return
    if summary and resolved.recipe.eval.enabled:  # rank 0 only: other ranks return no summary
        import torch

        from dflash_train.eval.run import evaluate_run

        ev = resolved.recipe.eval
        report = evaluate_run(out, target=resolved.recipe.target, max_prompts=ev.max_prompts,
                              max_new_tokens=ev.max_new_tokens, device="cuda" if torch.cuda.is_available() else None,
                              measure_speedup=ev.measure_speedup)
        speedup = f" speedup={report['speedup']:.2f}" if report.get("speedup") is not None else ""
        typer.echo(f"held-out spec decode: tau={report['tau']:.3f} lossless={report['lossless']}{speedup}")
    if summary:
        keys = ("steps", "train_loss", "val_loss", "val_accept_len", "fit_accept_len", "wall_time_s")
        typer.echo(" ".join(f"{k}={summary.get(k)}" for k in keys))
        typer.echo(f"drafter: {summary['final']}")


@app.command("eval")
def eval_command(
        draft: str = typer.Option(..., "--draft", help="Drafter folder (speculators or z-lab), or a trainer output "
                                                       "folder (uses final/, else the newest checkpoints/step-*)."),
        prompts: str = typer.Option(..., "--prompts", help="JSONL with `prompt` or `messages` rows, or any data "
                                                           "source `prepare` accepts (user turns only are used)."),
        target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
        split: Optional[str] = typer.Option(None, "--split", help="Dataset split (hub datasets)."),
        subset: Optional[str] = typer.Option(None, "--subset", help="Dataset subset/config (hub datasets)."),
        num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use at most this many prompts."),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="New tokens per prompt (EOS stops earlier)."),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (checked lossless); > 0 samples "
                                                                     "with the accept/reject rule."),
        block_size: Optional[int] = typer.Option(None, "--block-size", help="Block size B <= the drafter's trained "
                                                                            "block (default: trained)."),
        seed: int = typer.Option(0, "--seed", help="Sampling seed (prompt i uses seed + i)."),
        speedup: bool = typer.Option(True, "--speedup/--no-speedup", help="Time plain decoding for the speedup (one prompt at a time); --no-speedup decodes every prompt at once."),
        mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="For z-lab drafters that name "
                                                                                  "their mask only by string."),
        dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
        device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, ... (default: cpu)."),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full report here."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the histogram and per-position rates."),
        overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
) -> None:
    """Speculative decoding with the drafter on real prompts: tau, acceptance, speedup, lossless check."""
    from dflash_train.errors import ConfigError
    from dflash_train.eval.report import summary_lines
    from dflash_train.eval.run import EvalConfig, run_eval

    try:
        cfg = EvalConfig(draft=draft, target=target, prompts=prompts, split=split, subset=subset,
                         num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                         block_size=block_size, seed=seed, measure_speedup=speedup, mask_token_id=mask_token_id,
                         dtype=dtype, device=device, json_out=str(json_out) if json_out else None,
                         plot=str(plot) if plot else None, overwrite=overwrite)
    except ValueError as exc:
        bad = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"eval: {bad}") from None
    report = run_eval(cfg)
    typer.echo(f"drafter {report['draft']} on {report['target']}: {len(report['prompts'])} prompts, "
               f"{report['new_tokens']} new tokens, block size {report['settings']['block_size']}")
    for line in summary_lines(report):
        typer.echo(line)
    for out in (json_out, plot):
        if out:
            typer.echo(f"wrote {out}")


@app.command("replay")
def replay(
        draft: str = typer.Option(..., "--draft", help="Drafter folder (any format), or a trainer output folder."),
        rows: str = typer.Option(..., "--rows", help="A training run folder, or its holdout_rows.json: the held-out "
                                                     "rows whose answers are replayed."),
        target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
        max_rows: Optional[int] = typer.Option(None, "--max-rows", min=1, help="At most this many rows (default: all)."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=2,
                                                     help="Cut each answer to this many tokens (default: whole)."),
        block_size: Optional[int] = typer.Option(None, "--block-size", help="Block size B <= the drafter's trained "
                                                                            "block (default: trained)."),
        baseline: Optional[Path] = typer.Option(None, "--baseline", help="Another drafter's replay report (--json) "
                                                                         "on the same rows: the paired difference."),
        dtype: str = typer.Option("float32", "--dtype", help="What the target and the drafter compute in: float32, "
                                                             "bfloat16 or float16 (a bf16 server's verify)."),
        device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, ... (default: cpu)."),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report (per row) here."),
        overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
) -> None:
    """Greedy serving replayed on every held-out answer of a run: tau with its standard error, in a
    minute (one target forward per row instead of a decoding loop)."""
    from dflash_train.eval.replay import run_replay, summary_lines

    report = run_replay(draft, rows, target, max_rows, max_new_tokens, block_size, device,
                        str(json_out) if json_out else None, str(baseline) if baseline else None, overwrite,
                        dtype=dtype)
    typer.echo(f"drafter {report['draft']} on {report['target']}")
    for line in summary_lines(report):
        typer.echo(line)
    if json_out:
        typer.echo(f"wrote {json_out}")


@app.command("demo")
def demo(output: Path = typer.Option(Path("runs/demo"), "--output", help="Demo folder (the drafter lands in OUTPUT/drafter)."),
         config: Optional[Path] = typer.Option(None, "--config", help="Recipe (default: recipes/smollm2-135m-demo.yaml)."),
         overrides: list[str] = typer.Option([], "--set", help="Override a recipe field: --set optim.epochs=2."),
         num_prompts: int = typer.Option(24, "--num-prompts", help="Held-out prompts for the spec-decode eval (the sources take turns)."),
         max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per eval prompt.")) -> None:
    """The whole pipeline on the embedded SmolLM2 target: prepare, regenerate, train, eval, validate, convert, serve."""
    from rich.console import Console
    from rich.table import Table

    from dflash_train.demo import run_demo
    from dflash_train.machine import describe
    from dflash_train.output_lock import output_lock

    with output_lock(output, "--output", "demo"):
        s = run_demo(output, config, overrides, num_prompts, max_new_tokens)
    table = Table(title="dflash-toolkit demo (SmolLM2-135M target, greedy, held-out prompts)")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    table.add_row("tau (tokens per target forward)", f"{s['tau']:.3f}  (block size {s['block_size']})")
    for label, v in (s.get("per_source") or {}).items():
        table.add_row(f"tau on held-out {label} prompts", f"{v['tau']:.3f}  ({v['prompts']} prompts)")
    rp = s["replay"]
    table.add_row("tau replayed on every held-out row (± se)", f"{rp['tau']:.3f} ± {rp['tau_se'] or 0:.3f}  "
                  f"({rp['rows']} rows" + "".join(f"; {k} {v['tau']:.3f}" for k, v in rp["per_source"].items()) + ")")
    table.add_row("per-position acceptance", " ".join(f"{r:.2f}" for r in s["per_position"]))
    table.add_row("committed-length histogram", " ".join(str(c) for c in s["histogram"]))
    table.add_row("speedup over plain decoding", f"{s['speedup']:.2f}x" if s["speedup"] else
                  "not timed (a CPU says little about it; `dflash-train eval` without --no-speedup times it)")
    table.add_row("lossless (all prompts)", f"{s['lossless']}  (checked against {s.get('lossless_check') or 'n/a'})")
    tf = s.get("teacher_forced")
    if tf and tf["steps"]:
        table.add_row("teacher-forced accept len: every position / at decode steps / served",
                      f"{tf['all']:.3f} / {tf['at_decode_steps']:.3f} / {tf['served']:.3f}  ({tf['verdict']}; "
                      f"{100 * tf['step_agreement']:.1f}% of {tf['steps']} steps agree)")
    by_source = "".join(f", {k} {v:.3f}" for k, v in (s.get("val_accept_len_by_source") or {}).items())
    table.add_row("train: steps / rows / val accept len / the same on training rows",
                  f"{s['train_steps']} / {s['train_rows']} / {s['val_accept_len'] or float('nan'):.3f}"
                  + (f"  ({by_source[2:]})" if by_source else "")
                  + f" / {s.get('fit_accept_len') or float('nan'):.3f}")
    table.add_row("validate (vLLM + SGLang rules)", "pass" if s["validate_ok"] else "FAIL")
    for name, path in s["paths"].items():
        table.add_row(name, path)
    table.add_row("serve (dry run)", s["serve_command"] or "")
    table.add_row("stage seconds", " ".join(f"{k}={v}" for k, v in s["stage_seconds"].items()))
    if s.get("train_stage_seconds"):
        table.add_row("train stage seconds", " ".join(f"{k}={v}" for k, v in s["train_stage_seconds"].items()))
    if s.get("stage_peak_gib"):
        table.add_row("RAM at the peak, GiB", f"{s['peak_gib']} (every stage, the lanes' at once); "
                      + " ".join(f"{k}={v}" for k, v in s["stage_peak_gib"].items()))
    table.add_row("machine", describe(s["machine"]))
    dtypes = s.get("dtypes") or {}
    if dtypes:  # one line per distinct reason: "bfloat16 / bfloat16 / bf16-mixed (auto: this CPU has ...)"
        table.add_row("regenerate / features / training dtypes",
                      " / ".join(str(v["value"]) for v in dtypes.values())
                      + "".join(f"  ({why})" for why in dict.fromkeys(v["set_by"] for v in dtypes.values())))
    Console(width=160).print(table)


@app.command("sweep")
def sweep(output: Path = typer.Option(..., "--output", help="Sweep folder: one run folder per setting and fraction."),
          config: Optional[Path] = typer.Option(None, "--config", help="Recipe (default: recipes/smollm2-135m-demo.yaml)."),
          overrides: list[str] = typer.Option([], "--set", help="Override a recipe field in every run."),
          variants: list[str] = typer.Option([], "--variant", help="A setting to compare with the baseline: "
                                             "'NAME: key=value key=value' (repeatable)."),
          fractions: str = typer.Option("1", "--fractions", help="Shares of the training rows to train on, e.g. "
                                        "0.25,0.5,1 (a curve of tau against data)."),
          seeds: Optional[str] = typer.Option(None, "--seeds", help="Train every setting once per seed, e.g. 0,1,2; "
                                              "the table adds each setting's mean and spread over them."),
          num_prompts: int = typer.Option(24, "--num-prompts", help="Held-out prompts per eval (alternating sources)."),
          max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per eval prompt."),
          decode: bool = typer.Option(True, "--decode/--no-decode", help="Decode the eval's prompts for real before "
                                      "the replay (--no-decode: the replay alone, its tau and paired differences).")
          ) -> None:
    """Train a recipe under several settings and data sizes; table of held-out tau per source."""
    from dflash_train.output_lock import output_lock
    from dflash_train.sweep import markdown_table, parse_fractions, parse_seeds, parse_variant, run_sweep

    settings = [parse_variant(v) for v in variants]  # every flag is checked before anything is written
    shares, seed_list = parse_fractions(fractions), parse_seeds(seeds)
    with output_lock(output, "--output", "sweep"):
        result = run_sweep(output, config, overrides, settings, shares, num_prompts, max_new_tokens, seed_list,
                           decode)
    typer.echo(markdown_table(result), nl=False)
    typer.echo(f"wrote {output / 'sweep.json'}, {output / 'sweep.md'}")


def bare_resume(argv: list[str]) -> list[str]:
    """`--resume` with no value means `--resume must` (typer options take no optional values)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--resume" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out[i] = "--resume=must"
    return out


def main() -> None:
    import sys

    sys.argv[1:] = bare_resume(sys.argv[1:])
    run_cli(app)


if __name__ == "__main__":
    main()
