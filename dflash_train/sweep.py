"""`dflash-train sweep`: one recipe trained under several settings and data sizes, each run
evaluated on the same held-out prompts, with held-out tau per prompt source in one table.

Runs are variants x fractions (x seeds, with `--seeds`). A variant is a name and `--set` overrides (`baseline`, without
overrides, comes first); a fraction trains on that share of the training rows
(`data.train_fraction`, nested and in each source's proportion). The held-out rows, the prepared
and regenerated rows and the offline feature cache are shared by every run, so a run costs its
training and its eval only. Each run is `dflash-train train` then `dflash-train eval --no-speedup`
in a subprocess, into `OUT/<variant>-f<fraction>/` (its eval report beside it, `.eval.json`); a finished run is
skipped, so an interrupted sweep resumes, unless its settings changed since (a variant redefined, a recipe
edited): that run trains again. Writes `OUT/sweep.json`, `OUT/sweep.md` (the table) and `OUT/sweep.png` (tau
against training rows, per source and variant).

`--seeds 0,1,2` trains every run once per seed (`seed`, which draws the initialisation, the anchors and
the row order; the held-out rows follow `data.seed` and stay the same), into
`OUT/<variant>-f<fraction>-s<seed>/`, and the table adds the mean and the spread (lowest to highest) of
each setting across its seeds: a difference between settings smaller than that spread is not one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import ConfigError, DataError
from dflash_train.stages import Stage, command_path, run_stage
from dflash_train.train.run_folder import trained_otherwise

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """`NAME: key=value key=value` (values as in `--set`, no spaces inside one) -> Variant."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ConfigError(f"--variant {text!r}: write it as `NAME: key=value ...` (NAME of letters, digits, . _ -)")
    overrides = tuple(rest.split())
    bad = [o for o in overrides if "=" not in o]
    if not overrides or bad:
        raise ConfigError(f"--variant {text!r}: needs `key=value` overrides after the colon"
                          + (f"; {bad[0]!r} has no `=`" if bad else ""))
    return Variant(name, overrides)


def parse_fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--fractions {text!r}: give comma-separated numbers in (0, 1], e.g. 0.25,0.5,1") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise ConfigError(f"--fractions {text!r}: every fraction must be in (0, 1], e.g. 0.25,0.5,1")
    return sorted(set(values))


def parse_seeds(text: str | None) -> list[int] | None:
    """`--seeds 0,1,2` -> [0, 1, 2] (None: the recipe's one seed, and run folders without a seed suffix)."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: give comma-separated whole numbers >= 0, e.g. 0,1,2") from None
    if not values or any(v < 0 for v in values) or len(set(values)) < len(values):
        raise ConfigError(f"--seeds {text!r}: give distinct whole numbers >= 0, e.g. 0,1,2")
    return values


def run_folder(out: Path, variant: Variant, fraction: float, seed: int | None = None) -> Path:
    return out / (f"{variant.name}-f{fraction:g}" + ("" if seed is None else f"-s{seed}"))


def eval_path(run: Path) -> Path:
    """A run's eval report, beside the run folder (eval refuses to write inside the drafter it reads)."""
    return run.with_name(f"{run.name}.eval.json")


def replay_path(run: Path) -> Path:
    """A run's replay report (greedy serving on every held-out row), beside the run folder."""
    return run.with_name(f"{run.name}.replay.json")


def sweep_stages(out: Path, recipe: Path, overrides: list[str], variant: Variant, fraction: float,
                 num_prompts: int, max_new_tokens: int, target: str | None = None,
                 seed: int | None = None, decode: bool = True) -> list[Stage]:
    """`target`: the recipe's target (eval's `--target`; None: the embedded default); `seed`: the run's
    `seed` (None: the recipe's); `decode`: run the eval's real decoding on `num_prompts` prompts before
    the replay (False: the replay alone, ~4x faster on a CPU)."""
    run = run_folder(out, variant, fraction, seed)
    on_target = ["--target", target] if target else []
    seeded = () if seed is None else (f"seed={seed}",)
    settings = ["data.features=offline", "eval.enabled=false", *overrides, *variant.overrides,
                f"data.train_fraction={fraction:g}", *seeded]
    sets = [a for o in settings for a in ("--set", o)]
    stages = [
        Stage("train", [command_path("dflash-train"), "train", "--config", str(recipe), "--output", str(run),
                        *sets, "--resume", "auto"], done=run / "summary.json", replaces=run,
              stale=lambda: trained_otherwise(run, recipe, settings)),
        Stage("eval", [command_path("dflash-train"), "eval", "--draft", str(run), "--prompts", str(run),
                       *on_target,
                       "--num-prompts", str(num_prompts), "--max-new-tokens", str(max_new_tokens), "--no-speedup",
                       "--json", str(eval_path(run)), "--overwrite"], done=eval_path(run),
              after=(run / "summary.json",)),
        # every held-out row, every answer token: the measure a difference between runs is read from
        Stage("replay", [command_path("dflash-train"), "replay", "--draft", str(run), "--rows", str(run),
                         *on_target, "--json", str(replay_path(run)),
                         "--overwrite"], done=replay_path(run), after=(run / "summary.json",)),
    ]
    return stages if decode else [st for st in stages if st.name != "eval"]


def run_result(run: Path, variant: Variant, fraction: float, seconds: dict, seed: int | None = None) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    # a run swept with --no-decode has no eval report (one decoded in an earlier sweep keeps its own)
    report = json.loads(eval_path(run).read_text()) if eval_path(run).is_file() else {}
    tf = report.get("teacher_forced") or {}
    return {
        "variant": variant.name, "overrides": list(variant.overrides), "fraction": fraction, "seed": seed,
        "train_rows": summary.get("train_rows"), "steps": summary.get("steps"),
        "val_accept_len": summary.get("val_accept_len"),
        "val_accept_len_by_source": summary.get("val_accept_len_by_source") or {},
        "fit_accept_len": summary.get("fit_accept_len"), "tau": report.get("tau"),
        # the step's own at the last log (per position, and per sampled block), beside the check's fit_accept_len
        "train_accept_len": summary.get("train_accept_len"),
        "train_accept_len_per_block": summary.get("train_accept_len_per_block"),
        "tau_by_source": {k: v["tau"] for k, v in (report.get("per_source") or {}).items()},
        "prompts": len(report.get("prompts", [])),
        "teacher_forced_at_decode_steps": tf.get("at_decode_steps"),
        "train_seconds": summary.get("wall_time_s") or seconds.get("train"),
        # the steps alone: what a setting costs (train_seconds also holds the data stages the first run pays)
        "steps_seconds": (summary.get("stage_seconds") or {}).get("steps"), "run": str(run),
        "machine": summary.get("machine"), "finished_at": summary.get("finished_at"),
        "eval": str(eval_path(run)) if report else None, "replay": replay_result(replay_path(run)),
    }


def replay_result(path: Path) -> dict | None:
    """tau, its error and per source from a run's replay report (None for a run swept before replays)."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return {"report": str(path), "tau": report["tau"], "tau_se": report["tau_se"], "rows": report["rows"],
            "every_position": report["every_position"],
            "by_source": {k: v["tau"] for k, v in report["per_source"].items()}}


def against_baseline(results: list[dict]) -> None:
    """Each run's replayed tau minus the baseline's of the same fraction and seed, paired over the rows
    (`replay.vs_baseline`: diff and its standard error). A variant that changes the rows themselves (another
    regeneration dtype, engine or length) replays other answers: it is not paired (`replay.unpaired` says why)."""
    from dflash_train.eval.replay import paired_difference

    base = {(r["fraction"], r["seed"]): r for r in results if r["variant"] == "baseline" and r.get("replay")}
    for r in results:
        b = base.get((r["fraction"], r["seed"]))
        if r.get("replay") and b is not None and r is not b:
            reports = [json.loads(Path(x["replay"]["report"]).read_text()) for x in (r, b)]
            try:
                r["replay"]["vs_baseline"] = paired_difference(*reports)
            except DataError:
                r["replay"]["unpaired"] = ("its held-out answers are not the baseline's (the variant changes "
                                           "the rows): replay both drafters on one run's rows to pair them")


def run_sweep(out: str | Path, recipe: str | Path | None = None, overrides: list[str] | None = None,
              variants: list[Variant] | None = None, fractions: list[float] | None = None,
              num_prompts: int = 24, max_new_tokens: int = 64, seeds: list[int] | None = None,
              decode: bool = True) -> dict:
    """Every run (skipping finished ones), then the table; returns what `OUT/sweep.json` holds."""
    from dflash_train.demo import DEMO_RECIPE
    from dflash_train.outputs import ensure_folder, folder_stamp, plan_output

    out = Path(out)
    recipe = Path(recipe) if recipe else DEMO_RECIPE
    if not recipe.is_file():
        raise ConfigError(f"--config {recipe}: no such recipe file")
    variants = [Variant("baseline"), *(variants or [])]
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise ConfigError(f"--variant: two variants are named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    fractions = fractions or [1.0]
    def sets_seed(items) -> bool:
        return any(o.split("=", 1)[0].strip() == "seed" for o in items)

    seeded = [v.name for v in variants if sets_seed(v.overrides)]
    if seeds is not None and (seeded or sets_seed(overrides or [])):
        raise ConfigError(f"--seeds sets every run's seed; drop `seed=` from --set / --variant "
                          f"{seeded[0] if seeded else ''}".rstrip())
    from dflash_train.train.recipe import load_recipe

    # every run's recipe is checked before the first one trains (a typo fails now, not an hour in)
    targets = {v.name: load_recipe(recipe, [*(overrides or []), *v.overrides]).recipe.target for v in variants}
    own = (folder_stamp(out) or {}).get("command") == "sweep"
    ensure_folder(plan_output(out, "--output", sources=[recipe], own=own, overwrite=None), "sweep")
    results = []
    with open(out / "sweep.log", "a") as log:
        for variant in variants:
            for fraction in fractions:
                for seed in seeds or [None]:
                    stages = sweep_stages(out, recipe, overrides or [], variant, fraction, num_prompts,
                                          max_new_tokens, targets[variant.name], seed, decode)
                    tag = f"[{variant.name} x{fraction:g}" + ("" if seed is None else f" seed {seed}") + "]"
                    for stage in stages:
                        run_stage(stage, log, prefix=tag)
                    run = run_folder(out, variant, fraction, seed)
                    result = run_result(run, variant, fraction, {s.name: s.seconds for s in stages}, seed)
                    # a run this sweep found finished (resumed, or copied in) was timed then, maybe elsewhere
                    result["trained"] = "earlier" if stages[0].status == "cached" else "now"
                    results.append(result)
    against_baseline(results)
    from dflash_train.machine import machine_facts

    sweep = {"recipe": str(recipe), "overrides": overrides or [], "seeds": seeds, "num_prompts": num_prompts,
             "max_new_tokens": max_new_tokens, "decode": decode, "runs": results, "machine": machine_facts()}
    write_outputs(out, sweep)
    return sweep


def sources_of(results: list[dict]) -> list[str]:
    return sorted({s for r in results for s in r["tau_by_source"]})


def replay_sources_of(results: list[dict]) -> list[str]:
    return sorted({s for r in results for s in (r.get("replay") or {}).get("by_source", {})})


def _mean_and_range(values: list[float | None]) -> dict | None:
    """Mean, lowest and highest; None when a value is missing (a run without that measure)."""
    if not values or any(v is None for v in values):
        return None
    return {"mean": sum(values) / len(values), "lo": min(values), "hi": max(values)}


def _mean_difference(diffs: list[dict | None]) -> dict | None:
    """The mean of independent paired differences (one a seed) and its standard error, sqrt(sum se^2) / n;
    None unless every seed has one."""
    if not diffs or any(d is None or d.get("se") is None for d in diffs):
        return None
    n = len(diffs)
    return {"diff": sum(d["diff"] for d in diffs) / n, "se": sum(d["se"] ** 2 for d in diffs) ** 0.5 / n}


def across_seeds(results: list[dict]) -> list[dict]:
    """One entry per setting (variant and fraction): tau, per source, over its seeds (mean, lowest, highest), and
    the mean of its paired differences to the baseline of each seed (`vs_baseline`, with `per_source`)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in results:
        groups.setdefault((r["variant"], r["fraction"]), []).append(r)
    rows = []
    for (variant, fraction), runs in groups.items():
        sources = sources_of(runs)
        rows.append({"variant": variant, "fraction": fraction, "train_rows": runs[0]["train_rows"],
                     "seeds": [r.get("seed") for r in runs], "tau": _mean_and_range([r["tau"] for r in runs]),
                     "tau_by_source": {s: _mean_and_range([r["tau_by_source"][s] for r in runs
                                                           if s in r["tau_by_source"]]) for s in sources},
                     "replay_tau": _mean_and_range([(r.get("replay") or {}).get("tau") for r in runs]),
                     "replay_by_source": {s: _mean_and_range([(r.get("replay") or {}).get("by_source", {}).get(s)
                                                              for r in runs]) for s in replay_sources_of(runs)},
                     "vs_baseline": _vs_baseline_over(runs),
                     "steps_seconds": (_mean_and_range([r.get("steps_seconds") for r in runs]) or {}).get("mean"),
                     "train_seconds": sum(r["train_seconds"] or 0 for r in runs) / len(runs)})
    return rows


def _vs_baseline_over(runs: list[dict]) -> dict | None:
    vs = [(r.get("replay") or {}).get("vs_baseline") for r in runs]
    mean = _mean_difference(vs)
    if mean is not None:
        sources = set.intersection(*(set(v.get("per_source", {})) for v in vs))
        mean["per_source"] = {s: _mean_difference([v["per_source"][s] for v in vs]) for s in sorted(sources)}
    return mean


def _setting(r: dict) -> str:
    return r["variant"] + ("" if r["fraction"] == 1 else f" ({r['fraction']:g} of the rows)")


def _diff(vs: dict | None) -> str:
    """`+0.032 ± 0.016`: a paired difference and its standard error; `-` without one."""
    return "-" if not vs else f"{vs['diff']:+.3f}" + ("" if vs.get("se") is None else f" ± {vs['se']:.3f}")


def replay_cells(replay: dict | None, sources: list[str] = ()) -> list[str]:
    """`1.583 ± 0.054`, `+0.032 ± 0.016` (the paired difference to the baseline), then each source's replayed tau
    with its own paired difference (`1.914 (+0.054 ± 0.021)`); `-` where missing."""
    if not replay:
        return ["-", "-", *["-" for _ in sources]]
    se = "" if replay["tau_se"] is None else f" ± {replay['tau_se']:.3f}"
    vs = replay.get("vs_baseline")
    per = (vs or {}).get("per_source", {})
    return [f"{replay['tau']:.3f}{se}", "other rows" if replay.get("unpaired") else _diff(vs),
            *["-" if replay["by_source"].get(s) is None else f"{replay['by_source'][s]:.3f}"
              + (f" ({_diff(per[s])})" if s in per else "") for s in sources]]


def timing_notes(sweep: dict) -> list[str]:
    """The table's footnote on times: which runs were timed before this sweep ran, and on which machine when
    it was another (their minutes and seconds are not comparable with this sweep's)."""
    from dflash_train.machine import describe

    earlier = [r for r in sweep["runs"] if r.get("trained") == "earlier"]
    if not earlier:
        return []
    here = sweep.get("machine") or {}
    elsewhere = sorted({describe(r["machine"]) for r in earlier
                        if r.get("machine") and describe(r["machine"]) != describe(here)})
    note = ("† trained before this sweep ran (a resumed sweep, or a run copied in from another): its minutes and "
            "seconds were measured then, under that moment's load; compare times between unmarked rows")
    if elsewhere:
        note += f"; measured on other hardware: {'; '.join(elsewhere)}"
    if any(not r.get("machine") for r in earlier):
        note += "; runs trained before 2026-12-04 do not record their machine"
    return ["", note + "."]


def markdown_table(sweep: dict) -> str:
    """One row per run; with several seeds, a second table of each setting's mean and spread over its seeds."""
    results = sweep["runs"]
    sources, replayed = sources_of(results), replay_sources_of(results)
    head = ["setting", "overrides", "train rows", "steps", "train min", "steps s", "val accept len",
            "the same on training rows", "tau (all)", *[f"tau {s}" for s in sources],
            "replayed tau ± se", "vs baseline (paired)", *[f"replayed {s}" for s in replayed]]

    def num(x, f="{:.2f}"):
        return "-" if x is None else f.format(x)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        name = _setting(r) + ("" if r.get("seed") is None else f", seed {r['seed']}")
        mark = " †" if r.get("trained") == "earlier" else ""
        cells = [name, " ".join(f"`{o}`" for o in r["overrides"]) or "-", str(r["train_rows"]), str(r["steps"]),
                 num(r["train_seconds"] and r["train_seconds"] / 60, "{:.1f}") + mark,
                 num(r.get("steps_seconds"), "{:.0f}") + mark,
                 num(r["val_accept_len"]), num(r.get("fit_accept_len")), num(r["tau"]),
                 *[num(r["tau_by_source"].get(s)) for s in sources], *replay_cells(r.get("replay"), replayed)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += timing_notes(sweep)
    if any((r.get("replay") or {}).get("unpaired") for r in results):
        lines += ["", "other rows: the variant changes the held-out answers themselves (another regeneration), so "
                  "its replay is not paired with the baseline's; replay both drafters on one run's rows "
                  "(`dflash-train replay --draft A --rows B --baseline ...`) to pair them."]
    if not any(r.get("seed") is not None for r in results):
        return "\n".join(lines) + "\n"

    def spread(m: dict | None) -> str:
        return "-" if not m else f"{m['mean']:.3f} ({m['lo']:.3f}-{m['hi']:.3f})"

    def by_source(g: dict, source: str) -> str:
        vs = (g["vs_baseline"] or {}).get("per_source", {}).get(source)
        return f", {_diff(vs)}" if vs else ""

    lines += ["", "Across seeds: mean (lowest-highest).", "",
              "| " + " | ".join(["setting", "seeds", "train min", "steps s", "tau (all)",
                                 *[f"tau {s}" for s in sources],
                                 "replayed tau", "vs baseline (paired, mean)",
                                 *[f"replayed {s}" for s in replayed]]) + " |",
              "|" + "---|" * (7 + len(sources) + len(replayed))]
    for g in across_seeds(results):
        cells = [_setting(g), ", ".join(str(x) for x in g["seeds"]), f"{g['train_seconds'] / 60:.1f}",
                 num(g["steps_seconds"], "{:.0f}"), spread(g["tau"]),
                 *[spread(g["tau_by_source"].get(s)) for s in sources], spread(g["replay_tau"]),
                 _diff(g["vs_baseline"]), *[spread(g["replay_by_source"].get(s)) + by_source(g, s) for s in replayed]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, sweep: dict) -> None:
    from dflash_train.model.weights import write_json

    write_json(out / "sweep.json", sweep)
    tmp = out / ".sweep.md.tmp"
    tmp.write_text(markdown_table(sweep))
    tmp.replace(out / "sweep.md")
    if len({r["fraction"] for r in sweep["runs"]}) > 1:
        plot_curves(sweep, out / "sweep.png")


def plot_curves(sweep: dict, path: Path) -> None:
    """Held-out tau against training rows: one line per variant and source (and all prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = across_seeds(sweep["runs"])  # a setting's mean over its seeds (one run without --seeds)
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in dict.fromkeys(r["variant"] for r in results):
        runs = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["train_rows"])
        xs = [r["train_rows"] for r in runs]
        if all(r["tau"] for r in runs):
            ax.plot(xs, [r["tau"]["mean"] for r in runs], marker="o", label=f"{variant}: all prompts")
        if all(r["replay_tau"] for r in runs):
            ax.plot(xs, [r["replay_tau"]["mean"] for r in runs], marker="s", linestyle=":",
                    label=f"{variant}: replayed, every held-out row")
        for s in sorted({s for r in runs for s in r["tau_by_source"]}):
            ax.plot(xs, [r["tau_by_source"][s]["mean"] if s in r["tau_by_source"] else None for r in runs],
                    marker=".", linestyle="--", label=f"{variant}: {s}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training rows")
    ax.set_ylabel("held-out tau (tokens per target forward)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
