"""`dflash-train eval`: load a drafter (any format, or a trainer run folder) and its target, run
speculative decoding on prompts, write the JSON report and the plot.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dflash_train.errors import ConfigError


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draft: str
    target: str | None = None
    prompts: str
    split: str | None = None
    subset: str | None = None
    num_prompts: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    block_size: int | None = Field(default=None, ge=2)
    seed: int = 0
    measure_speedup: bool = True
    mask_token_id: int | None = None
    dtype: str = "float32"
    device: str | None = None
    json_out: str | None = None
    plot: str | None = None
    overwrite: bool = False  # replace --json / --plot files an earlier toolkit run wrote (never others)


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter folder, or a trainer output folder: its `final/`, else its newest `checkpoints/step-*`."""
    from dflash_train.model.locate import require_drafter_folder

    return require_drafter_folder(path, f"--draft {path}")


def check_report_outputs(cfg: EvalConfig, draft_dir: Path) -> None:
    """The --json and --plot files may be written: new (or earlier reports with --overwrite),
    not a source, in a writable place with room."""
    from dflash_train.outputs import check_distinct, plan_output

    named = [(flag, p) for flag, p in (("--json", cfg.json_out), ("--plot", cfg.plot)) if p]
    check_distinct(*named)
    for flag, p in named:
        plan_output(p, flag, kind="file", sources=[draft_dir, cfg.prompts, cfg.target], overwrite=cfg.overwrite,
                    need_bytes=1 << 20)


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse a device this machine cannot run before any model loads."""
    import torch

    if device is None:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ConfigError(f"{flag} {device}: not a torch device; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"{flag} {device}: {why}; use --device cpu (or run where a GPU is available)")
    if kind == "cuda" and torch.device(device).index is not None and torch.device(device).index >= torch.cuda.device_count():
        raise ConfigError(f"{flag} {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def compute_dtype(name: str, flag: str = "--dtype"):
    """The torch dtype the target and the drafter compute in, refused by name before any model loads."""
    from dflash_train.model.checkpoint import DTYPES

    if name not in DTYPES:
        raise ConfigError(f"{flag} {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict:
    """Load, evaluate, write the outputs named in `cfg`; returns the report (with `draft`/`target`)."""
    import torch

    from dflash_train.eval.prompts import load_labelled_prompts
    from dflash_train.eval.report import plot_report, write_report_json
    from dflash_train.eval.spec_decode import evaluate
    from dflash_train.model.checkpoint import load_drafter, read_drafter_config
    from dflash_train.target import load_target, load_target_config, load_tokenizer, resolve_target

    dtype = compute_dtype(cfg.dtype)
    check_device(cfg.device)
    draft_dir = resolve_drafter_dir(cfg.draft)
    check_report_outputs(cfg, draft_dir)  # seconds in, not after the eval
    trained = read_drafter_config(draft_dir, mask_token_id=cfg.mask_token_id).block_size
    if cfg.block_size is not None and cfg.block_size > trained:  # fail before loading anything heavy
        raise ConfigError(f"--block-size {cfg.block_size}: larger than the drafter's trained block_size {trained} "
                          f"({draft_dir / 'config.json'}); pass at most {trained}")
    labelled = load_labelled_prompts(cfg.prompts, cfg.split, cfg.subset, cfg.num_prompts)
    prompts, sources = [m for m, _ in labelled], [label for _, label in labelled]
    # the drafter is checked against the target's config and tokenizer before the target's weights load
    target_path = resolve_target(cfg.target)
    draft = load_drafter(draft_dir, target_config=load_target_config(target_path), dtype=dtype,
                         mask_token_id=cfg.mask_token_id, tokenizer=load_tokenizer(target_path), what="--draft")
    target, tokenizer = load_target(target_path, dtype=dtype, device=cfg.device)
    draft.to(next(target.parameters()).device).eval().attach_target(target)
    torch.manual_seed(cfg.seed)
    report = evaluate(draft, target, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, block_size=cfg.block_size, seed=cfg.seed,
                      measure_speedup=cfg.measure_speedup, progress=progress, sources=sources)
    report["draft"] = str(draft_dir)
    report["target"] = target_path
    report["settings"].update(prompts=cfg.prompts, dtype=cfg.dtype)
    if cfg.json_out:
        write_report_json(report, cfg.json_out)
    if cfg.plot:
        plot_report(report, cfg.plot)
    return report


def evaluate_run(run_dir: str | Path, target: str | None = None, max_prompts: int = 20,
                 max_new_tokens: int = 128, progress: bool = True, device: str | None = None,
                 measure_speedup: bool = False) -> dict:
    """Evaluate a training run's drafter on its held-out prompts (on `device`, default CPU); write
    RUN/eval.json, RUN/eval.png and the headline numbers into RUN/summary.json under `eval`. Without
    `measure_speedup` the prompts decode as one batch (the recipe's `eval.measure_speedup`)."""
    import json

    from dflash_train.model.weights import write_json

    run = Path(run_dir)
    report = run_eval(EvalConfig(draft=str(run), target=target, prompts=str(run / "holdout_rows.json"),
                                 num_prompts=max_prompts, max_new_tokens=max_new_tokens, device=device,
                                 measure_speedup=measure_speedup,
                                 json_out=str(run / "eval.json"), plot=str(run / "eval.png"), overwrite=True), progress=progress)
    from dflash_train.eval.teacher_forced import headline as teacher_forced_headline

    headline = {k: report[k] for k in ("tau", "per_position", "histogram", "speedup", "lossless", "per_source")
                if k in report}
    headline["teacher_forced"] = teacher_forced_headline(report.get("teacher_forced"))
    headline.update(prompts=max_prompts, max_new_tokens=max_new_tokens, report=str(run / "eval.json"))
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["eval"] = headline
    write_json(summary_path, summary)
    return report
