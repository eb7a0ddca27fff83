"""Statistics of a speculative-decoding run, its JSON file and its plot.

- tau: committed tokens per target forward, prefill excluded (sum of committed / steps)
- per_position[k-1]: fraction of steps whose draft slot k was accepted, k = 1..B-1
- histogram[n-1]: number of steps that committed n tokens, n = 1..B
- speedup: plain decoding wall time / speculative wall time, same prompts, same run
- lossless: greedy only; every prompt's output equals plain greedy decoding (None when sampling).
  Without the speedup run there is no plain decoding: the check is then that every generated token is
  the target's argmax after its prefix in one full forward (`settings.lossless_check`)
- teacher_forced: greedy only; the training forward on the decoded sequences (teacher_forced.py)
- per_source: tau, per-position acceptance and counts for each prompt source label (when any)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_train.eval.results import PromptResult, Step
from dflash_train.outputs import STAMP_KEY, png_software, stamp


def step_stats(steps: list[Step], block_size: int) -> dict:
    """tau, per-position acceptance and the committed-length histogram of a list of steps."""
    n = len(steps)
    hist = [0] * block_size
    accepted_at = [0] * (block_size - 1)
    for s in steps:
        hist[s.committed - 1] += 1
        for k in range(s.accepted):
            accepted_at[k] += 1
    committed = sum(s.committed for s in steps)
    return {"tau": committed / n if n else None,
            "per_position": [a / n if n else None for a in accepted_at],
            "histogram": hist, "steps": n, "committed_tokens": committed}


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_report(results: list[PromptResult], block_size: int, greedy: bool, measure_speedup: bool,
                 settings: dict) -> dict:
    all_steps = [s for r in results for s in r.spec.steps]
    stats = step_stats(all_steps, block_size)
    per_prompt = []
    for r in results:
        one = step_stats(r.spec.steps, block_size)
        row = {"index": r.index, "prompt_tokens": r.prompt_tokens, "new_tokens": len(r.spec.tokens),
               "target_forwards": one["steps"], "tau": one["tau"], "histogram": one["histogram"],
               "spec_seconds": r.spec.seconds, "output_tokens": r.spec.tokens, "output_text": r.text,
               "source": r.source}
        if r.plain is not None:
            row["plain_seconds"] = r.plain.seconds
            row["plain_new_tokens"] = len(r.plain.tokens)
        if greedy and r.plain is not None:
            mismatch = _first_mismatch(r.spec.tokens, r.plain.tokens)
            row["lossless"] = mismatch is None
            row["first_mismatch"] = mismatch
        per_prompt.append(row)

    spec_s = sum(r.spec.seconds for r in results)
    spec_tokens = sum(len(r.spec.tokens) for r in results)
    timing = {"spec_seconds": spec_s, "spec_tokens_per_s": spec_tokens / spec_s if spec_s > 0 else None}
    speedup = None
    if measure_speedup and all(r.plain is not None for r in results):
        plain_s = sum(r.plain.seconds for r in results)
        plain_tokens = sum(len(r.plain.tokens) for r in results)
        timing.update(plain_seconds=plain_s, plain_tokens_per_s=plain_tokens / plain_s if plain_s > 0 else None)
        speedup = plain_s / spec_s if spec_s > 0 else None
    checked = greedy and all("lossless" in row for row in per_prompt)
    lossless = all(row["lossless"] for row in per_prompt) if checked else None
    return {
        "tau": stats["tau"],
        "per_position": stats["per_position"],
        "per_position_slots": list(range(1, block_size)),
        "histogram": stats["histogram"],
        "histogram_lengths": list(range(1, block_size + 1)),
        "speedup": speedup,
        "lossless": lossless,
        "target_forwards": stats["steps"],
        "committed_tokens": stats["committed_tokens"],
        "new_tokens": spec_tokens,
        "timing": timing,
        "settings": settings,
        "per_source": per_source_stats(results, block_size),
        "prompts": per_prompt,
    }


def lossless_from_teacher_forced(report: dict) -> dict:
    """Greedy runs without plain decoding: per prompt, lossless when every generated token is the target's
    argmax after its prefix in the teacher-forced full forward (`teacher_forced.greedy_mismatch`)."""
    for row, mismatch in zip(report["prompts"], report["teacher_forced"]["greedy_mismatch"], strict=True):
        row["lossless"], row["first_mismatch"] = mismatch is None, mismatch
    report["lossless"] = all(row["lossless"] for row in report["prompts"])
    report["settings"]["lossless_check"] = "teacher-forced argmax"
    return report


def per_source_stats(results: list[PromptResult], block_size: int) -> dict | None:
    """{label: tau, per-position acceptance, steps, prompts} by prompt source; None when no prompt
    has a label (unlabelled prompts then count as `unlabelled`)."""
    if not any(r.source for r in results):
        return None
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.source or "unlabelled", []).append(r)
    out = {}
    for label, rs in sorted(groups.items()):
        stats = step_stats([s for r in rs for s in r.spec.steps], block_size)
        out[label] = {"tau": stats["tau"], "per_position": stats["per_position"], "steps": stats["steps"],
                      "prompts": len(rs)}
    return out


def write_report_json(report: dict, path: str | Path) -> Path:
    """Write the report atomically (temp file + rename), stamped as the toolkit's (dflash_train.outputs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**report, STAMP_KEY: stamp("eval")}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def plot_report(report: dict, path: str | Path) -> Path:
    """PNG: committed-length histogram (left) and per-position acceptance rates (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(report["histogram_lengths"], report["histogram"], color="tab:blue")
    left.set_xlabel("tokens committed per target forward")
    left.set_ylabel("steps")
    tau = report["tau"]
    left.set_title(f"committed lengths (tau = {tau:.2f})" if tau is not None else "committed lengths")
    rates = [r if r is not None else 0.0 for r in report["per_position"]]
    right.bar(report["per_position_slots"], rates, color="tab:green", label="served")
    tf = report.get("teacher_forced")
    if tf:  # the training forward on the same sequences: every position, and where steps began
        for name, marker in (("all", "o"), ("at_decode_steps", "x")):
            right.plot(report["per_position_slots"], [r or 0.0 for r in tf["per_position"][name]], marker,
                       color="black", label=f"teacher-forced, {name.replace('_', ' ')}")
        right.legend(fontsize=8)
    right.set_ylim(0, 1)
    right.set_xlabel("draft slot k")
    right.set_ylabel("acceptance rate")
    s = report["settings"]
    right.set_title(f"per-position acceptance (B={s['block_size']}, T={s['temperature']})")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, format="png", dpi=100, metadata={"Software": png_software("eval")})
    plt.close(fig)
    os.replace(tmp, path)
    return path


def summary_lines(report: dict) -> list[str]:
    """A short human summary for the CLI."""
    def fmt(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    hist = zip(report["histogram_lengths"], report["histogram"], strict=True)
    lines = [f"tau (tokens per target forward): {fmt(report['tau'])}",
             "per-position acceptance: " + " ".join(fmt(r, ".2f") for r in report["per_position"]),
             "committed-length histogram: " + " ".join(f"{n}:{c}" for n, c in hist),
             f"speedup over plain decoding: {fmt(report['speedup'], '.2f')}x"]
    if report["lossless"] is not None:
        bad = [p["index"] for p in report["prompts"] if not p.get("lossless", True)]
        ref = ("the target's argmax in one full forward" if report["settings"].get("lossless_check")
               == "teacher-forced argmax" else "plain greedy")
        lines.append(f"lossless: yes (all prompts identical to {ref})" if report["lossless"]
                     else f"lossless: NO (prompts {bad} differ from {ref})")
    if report.get("per_source"):
        lines.append("tau by prompt source: " + ", ".join(
            f"{label} {fmt(v['tau'])} ({v['prompts']} prompt{'' if v['prompts'] == 1 else 's'})"
            for label, v in report["per_source"].items()))
    if report.get("teacher_forced"):
        lines.extend(teacher_forced_lines(report["teacher_forced"]))
    return lines


def teacher_forced_lines(tf: dict) -> list[str]:
    """The teacher-forced diagnosis (teacher_forced.py) in a few lines, with its verdict."""
    def fmt(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    def rates(name):
        return " ".join(fmt(r, ".2f") for r in tf["per_position"][name])

    agreement = tf["step_agreement"]
    lines = [f"teacher-forced block acceptance on these sequences: every position {fmt(tf['all'])}, "
             f"at decode steps {fmt(tf['at_decode_steps'])}, served {fmt(tf['served'])} (1 + accepted drafts); "
             f"{fmt(None if agreement is None else 100 * agreement, '.1f')}% of {tf['steps']} steps agree",
             f"  per-position, every position: {rates('all')}",
             f"  per-position, at decode steps: {rates('at_decode_steps')}",
             f"  per-position, served: {rates('served')}",
             f"  at decode steps with bf16-rounded features (as training stores them): "
             f"{fmt(tf['at_decode_steps_bf16_features'])}"]
    if tf["verdict"] == "selection":
        lines.append(f"gap: selection. The training forward reproduces the served steps; decode steps begin at "
                     f"harder positions than the average one ({fmt(tf['all'])} -> {fmt(tf['at_decode_steps'])})")
    else:
        first = tf["disagreements"][0] if tf["disagreements"] else None
        where = (f"; first: prompt {first['prompt']} position {first['position']}, served accepted "
                 f"{first['served_accepted']}, teacher-forced {first['teacher_forced_accepted']}") if first else ""
        lines.append(f"gap: MISMATCH. The training forward differs from served drafting at "
                     f"{tf['steps'] - round((agreement or 0) * tf['steps'])} of {tf['steps']} steps{where}")
    return lines
