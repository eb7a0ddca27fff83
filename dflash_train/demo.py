"""`dflash-train demo`: the whole pipeline on the embedded SmolLM2 target, stage by stage.

prepare -> regenerate -> train (one `dflash-train train` run of the demo recipe) -> convert the run
into `OUT/drafter/` (speculators format), then lanes at once (`lanes`):
  - spec-decode eval on held-out prompts (on the CPU; every prompt's block verified in one target forward)
    -> replay of greedy serving on every held-out row (tau with its standard error);
  - validate -> z-lab conversion -> serve dry run (CPU work: it hides behind the eval);
  - on a GPU, the replay in a lane of its own (one target forward per row on the GPU, beside the CPU's eval);
-> a summary table. Every stage runs the installed command in a subprocess, exactly as a user would,
and prints one status line; a stage whose output is already complete and up to date is skipped, so an
interrupted demo resumes where it stopped, and a recipe changed since trains and evaluates again. OUT is
the demo's own folder (it carries the toolkit's marker), so its stages may replace their own earlier
outputs in it.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

from dflash_train.peak_memory import TreePeak, gib
from dflash_train.stages import Stage, allow_stages, command_path, run_stage, stop_stages
from dflash_train.train.run_folder import trained_otherwise

DEMO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m-demo.yaml"


SIDE_LANE = ("validate", "to-zlab", "serve")  # CPU work, run beside the eval and the replay


def beside_the_eval(stages: list[Stage], side: list[tuple[str, ...]], cores: int | None = None) -> None:
    """Threads for the stages that run at once: one each for the stages of the side lanes (start-up bound:
    imports, loading; or a GPU's), and for the eval, which starts with them, every other core where that leaves
    it at least 3/4 of them; else every core.

    Oversubscribed, torch's OpenMP threads wait at every op for the one that lost its core: on 2 cores, 4
    prompts decoded in 7.2 s alone with 2 threads, 19.7 s with 2 threads beside one busy process, 7.1 s with 1
    thread beside it. On the H200 machine's 16 cores, 16 threads beside the replay and the side lane (~47 s of
    the eval's ~58) decoded 4 prompts in 35.5 s (304cfdf; at 8275a25 the first prompt took 33 s while they ran,
    ~5 s a prompt after). But a core given up is given up for the whole eval: on 2 cores the demo's 24 batched
    prompts decoded in 70.6 s with 1 thread against 40.1 s with 2 beside the side lane's ~11 s (2026-12-04;
    `bench/bench_eval_threads.py` measures the four cases on any machine).
    The replay, on a CPU, runs after the eval, once the side lane has long finished, and keeps every core."""
    from dflash_train.machine import usable_cores

    names = {name for lane in side for name in lane}
    cores = cores or usable_cores()
    for stage in stages:
        if stage.name in names:
            stage.threads = 1
        elif stage.name == "eval" and 4 * (cores - len(side)) >= 3 * cores:
            stage.threads = cores - len(side)


def lanes(device: str) -> list[tuple[str, ...]]:
    """The stages that run beside the main lane, one tuple per lane (in order within it). On a GPU the replay
    gets a lane of its own: it uses the GPU while the eval decodes on the CPU (the H200 run of 2026-11-27: the
    eval ~70 s, the side lane's three start-up-bound stages 43 s, the replay after the eval). On a CPU the
    replay waits for the eval: both would share the same cores."""
    return [("replay",), SIDE_LANE] if device == "cuda" else [SIDE_LANE]


def replay_device() -> str:
    """The replay's device: one target forward per row is GPU-shaped work (the eval's step-by-step loop is less so)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def demo_stages(out: Path, recipe: Path, overrides: list[str], max_prompts: int, max_new_tokens: int,
                device: str = "cpu") -> list[Stage]:
    run, drafter = out / "run", out / "drafter"
    settings = ["eval.enabled=false", *overrides]
    sets = [a for o in settings for a in ("--set", o)]
    return [
        # a run trained from other settings (the recipe changed since) is trained again
        Stage("train", [command_path("dflash-train"), "train", "--config", str(recipe), "--output", str(run),
                        *sets, "--resume", "auto"],
              done=run / "summary.json", replaces=run, stale=lambda: trained_otherwise(run, recipe, settings)),
        Stage("convert", [command_path("dflash-convert"), "to-speculators", str(run), str(drafter), "--overwrite"],
              done=drafter / "config.json", after=(run / "summary.json",)),
        Stage("eval", [command_path("dflash-train"), "eval", "--draft", str(drafter), "--prompts", str(run),
                       "--num-prompts", str(max_prompts), "--max-new-tokens", str(max_new_tokens),
                       "--json", str(out / "eval.json"), "--plot", str(out / "eval.png"),
                       # no plain decoding: losslessness is checked against the teacher-forced argmax,
                       # one target forward per prompt instead of one per token (~1.4 of the eval's ~3.3 min)
                       "--no-speedup", "--overwrite"],
              done=out / "eval.json", after=(drafter / "config.json",)),
        Stage("replay", [command_path("dflash-train"), "replay", "--draft", str(drafter), "--rows", str(run),
                         "--device", device, "--json", str(out / "replay.json"), "--overwrite"],
              done=out / "replay.json", after=(drafter / "config.json",)),
        Stage("validate", [command_path("dflash-convert"), "validate", str(drafter), "--target", "default",
                           "--json"]),
        # a reduced-vocab drafter is refused by SGLang's format unless rebuilt with the full head
        Stage("to-zlab", [command_path("dflash-convert"), "to-zlab", str(drafter), str(out / "drafter-zlab"),
                          "--expand-vocab", "--overwrite"], done=out / "drafter-zlab" / "config.json",
              after=(drafter / "config.json",)),
        Stage("serve", [command_path("dflash-serve"), str(drafter), "--dry-run"]),
    ]


def run_demo(out: str | Path = "runs/demo", recipe: str | Path | None = None, overrides: list[str] | None = None,
             max_prompts: int = 24, max_new_tokens: int = 64) -> dict:
    """Run every stage; returns the summary (also written to OUT/demo_summary.json)."""
    from dflash_train.outputs import ensure_folder, folder_stamp, plan_output

    out = Path(out)
    recipe = Path(recipe) if recipe else DEMO_RECIPE
    own = (folder_stamp(out) or {}).get("command") == "demo"  # an earlier demo: resumed stage by stage
    ensure_folder(plan_output(out, "--output", sources=[recipe], own=own, overwrite=None), "demo")
    stages = demo_stages(out, recipe, overrides or [], max_prompts, max_new_tokens, replay_device())
    earlier = out / "demo_summary.json"
    before = json.loads(earlier.read_text()) if earlier.is_file() else {}
    t0 = time.time()
    side = lanes(replay_device())
    beside_the_eval(stages, side)
    with open(out / "demo.log", "a") as log, TreePeak(os.getpid()) as peak:
        run_lanes(stages, log, side, journal=out / "stages.jsonl")
    from dflash_train.eval.teacher_forced import headline as teacher_forced_headline
    from dflash_train.machine import machine_facts

    train_summary = json.loads((out / "run" / "summary.json").read_text())
    report = json.loads((out / "eval.json").read_text())
    replayed = json.loads((out / "replay.json").read_text())
    validate = json.loads("\n".join(next(s for s in stages if s.name == "validate").output))
    serve_cmd = next(s for s in stages if s.name == "serve").output
    peaks = stage_peak_gib(stages, before.get("stage_peak_gib") or {})
    summary = {
        "tau": report["tau"], "per_position": report["per_position"], "histogram": report["histogram"],
        "speedup": report["speedup"], "lossless": report["lossless"], "prompts": len(report["prompts"]),
        "lossless_check": report["settings"].get("lossless_check"),
        "per_source": report.get("per_source"),
        "teacher_forced": teacher_forced_headline(report.get("teacher_forced")),
        "replay": {"tau": replayed["tau"], "tau_se": replayed["tau_se"], "rows": replayed["rows"],
                   "per_source": {k: {"tau": v["tau"], "tau_se": v["tau_se"], "rows": v["rows"]}
                                  for k, v in replayed.get("per_source", {}).items()}},
        "max_new_tokens": max_new_tokens, "block_size": report["settings"].get("block_size"),
        "train_steps": train_summary.get("steps"), "train_rows": train_summary.get("train_rows"),
        "val_accept_len": train_summary.get("val_accept_len"),
        "val_accept_len_by_source": train_summary.get("val_accept_len_by_source") or {},
        "fit_accept_len": train_summary.get("fit_accept_len"), "validate_ok": bool(validate.get("ok")),
        "dtypes": train_summary.get("dtypes"),  # what `auto` picked on this machine, and why
        "train_stage_seconds": train_summary.get("stage_seconds"),  # where the train stage's time went
        "serve_command": serve_cmd[-1] if serve_cmd else None,
        "paths": {"drafter": str(out / "drafter"), "drafter_zlab": str(out / "drafter-zlab"),
                  "eval_json": str(out / "eval.json"), "eval_plot": str(out / "eval.png"),
                  "replay_json": str(out / "replay.json"),
                  "curves": str(out / "run" / "curves.png"), "run": str(out / "run")},
        "stage_seconds": stage_seconds(stages, before.get("stage_seconds") or {}),
        # RAM at each stage's peak (its processes' anonymous resident memory summed: peak_memory.TreePeak), and this
        # run's over every stage at once (the lanes' stages overlap): what a machine needs free for it
        "stage_peak_gib": peaks,
        # a stage skipped as cached took its RAM in an earlier run: its peak still bounds this demo's
        "peak_gib": max([gib(peak.bytes), *(v for v in peaks.values() if v is not None)]),
        "train_memory_high_water_gib": train_summary.get("memory_high_water_gib"),
        "wall_seconds": round(time.time() - t0, 1),
        "machine": machine_facts(),
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stage_seconds(stages: list[Stage], earlier: dict) -> dict:
    """Each stage's seconds; one skipped as cached keeps the time it took when it ran (`earlier`: the earlier
    summary's), so a rerun over a finished demo does not erase what it cost."""
    return {s.name: earlier.get(s.name) if s.status == "cached" else round(s.seconds, 1) for s in stages}


def stage_peak_gib(stages: list[Stage], earlier: dict) -> dict:
    """Each stage's peak RAM in GiB, a cached stage's from when it ran (as `stage_seconds`)."""
    return {s.name: earlier.get(s.name) if s.status == "cached" else gib(s.peak_bytes) for s in stages}


def run_lanes(stages: list[Stage], log, side: list[tuple[str, ...]] | None = None, journal: Path | None = None) -> None:
    """The stages in order, except those of the `side` lanes (default: the CPU side lane), which start once the
    drafter is converted and run each in a thread beside the rest; their log lines are kept apart and appended,
    lane by lane, when every lane is done. A failure in any lane is raised after all have stopped. `journal`
    gets one line per stage as it ends, whichever lane it ran in (`stages.write_journal`)."""
    side = [SIDE_LANE] if side is None else side
    beside = {name for lane in side for name in lane}
    main = [s for s in stages if s.name not in beside]
    split = next(i for i, s in enumerate(main) if s.name == "convert") + 1
    for stage in main[:split]:
        run_stage(stage, log, journal=journal)
    allow_stages()
    errors, threads = [], []
    logs = [io.StringIO() for _ in side]

    def run_lane(lane: list[Stage], lane_log) -> None:
        try:
            for stage in lane:
                run_stage(stage, lane_log, journal=journal)
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread once every lane stops
            errors.append(exc)

    for i, (names, lane_log) in enumerate(zip(side, logs, strict=True)):
        lane = [s for s in stages if s.name in names]
        threads.append(threading.Thread(target=run_lane, args=(lane, lane_log), name=f"demo-lane-{i}", daemon=True))
        threads[-1].start()
    try:
        for stage in main[split:]:
            run_stage(stage, log, journal=journal)
        for thread in threads:
            thread.join()
    except BaseException as exc:  # stopped while the lanes run: theirs stop too (`stages.stop_stages`)
        stop_stages(getattr(exc, "signum", signal.SIGTERM))
        raise
    finally:
        for thread in threads:
            thread.join()
        for lane_log in logs:
            log.write(lane_log.getvalue())
    if errors:
        raise errors[0]
