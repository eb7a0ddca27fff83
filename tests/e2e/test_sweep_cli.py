"""`dflash-train sweep`: settings x data fractions, each trained and evaluated on the same held-out
prompts, with tau per source; a rerun resumes (every finished run is skipped, unless its settings changed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _labelled_rows(folder, target):
    from transformers import AutoTokenizer

    from dflash_train.data.prepare import write_prepared

    tok = AutoTokenizer.from_pretrained(str(target))
    convs, labels = [], []
    for i in range(16):
        convs.append([{"role": "user", "content": f"What is {i} plus {i + 3}?"},
                      {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."}])
        labels.append("math")
        convs.append([{"role": "user", "content": f"Say hello to friend number {i}."},
                      {"role": "assistant", "content": f"Hello, friend number {i}! Nice to see you."}])
        labels.append("chat")
    write_prepared(convs, tok, folder, {"command": "test"}, max_length=128, labels=labels)
    return folder


@pytest.mark.e2e
@pytest.mark.slow
def test_sweep_trains_every_setting_and_fraction_and_reports_tau_per_source(tmp_path, train_tiny_target):
    rows = _labelled_rows(tmp_path / "rows", train_tiny_target)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"""target: {train_tiny_target}
data: {{prepared: {rows}, holdout_fraction: 0.25, cache_dir: {tmp_path / 'cache'}}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, target_layer_ids: [1, 2, 3, 4, 5]}}
objective: {{anchors_per_document: 16, logits_chunk: 256}}
optim: {{lr: 1.0e-3, epochs: 1}}
batch: {{tokens_per_microbatch: 256}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
""")
    out = tmp_path / "sweep"
    argv = [str(BIN / "dflash-train"), "sweep", "--config", str(recipe), "--output", str(out),
            "--fractions", "0.5,1",
            "--num-prompts", "4", "--max-new-tokens", "6"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=env)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    sweep = json.loads((out / "sweep.json").read_text())
    runs = {(r["variant"], r["fraction"]): r for r in sweep["runs"]}
    assert sorted(runs) == [("baseline", 0.5), ("baseline", 1.0)]
    # 32 rows, 8 held out: 24 training rows, 12 per source; half of each source at 0.5
    assert runs["baseline", 1.0]["train_rows"] == 24 and runs["baseline", 0.5]["train_rows"] == 12
    held = json.loads((out / "baseline-f1" / "holdout_rows.json").read_text())["rows"]
    for r in runs.values():
        assert json.loads((Path(r["run"]) / "holdout_rows.json").read_text())["rows"] == held  # the same prompts
        report = json.loads(Path(r["eval"]).read_text())
        assert [p["source"] for p in report["prompts"]] == ["chat", "math", "chat", "math"]
        assert set(r["tau_by_source"]) == {"chat", "math"} and 1.0 <= r["tau"] <= 4.0
        assert r["tau_by_source"] == {k: v["tau"] for k, v in report["per_source"].items()}
    for r in runs.values():  # every held-out row replayed (8 rows here, more than the eval's 4 prompts)
        replay = json.loads(Path(r["replay"]["report"]).read_text())
        assert r["replay"]["rows"] == replay["rows"] == len(held) and r["replay"]["tau"] == replay["tau"]
        assert {row["row"] for row in replay["per_row"]} == set(held) and 1.0 <= replay["tau"] <= 4.0
        assert "vs_baseline" not in r["replay"]  # both runs are baselines (of two fractions)
    assert runs["baseline", 0.5]["steps"] < runs["baseline", 1.0]["steps"]
    assert "train_fraction: 0.5" in (out / "baseline-f0.5" / "resolved_config.yaml").read_text()
    table = (out / "sweep.md").read_text().splitlines()
    assert len(table) == 2 + 2 and "tau chat" in table[0] and "tau math" in table[0]
    assert table[2].startswith("| baseline (0.5 of the rows) | - | 12 |") and res.stdout.count("| baseline") == 2
    assert (out / "sweep.png").stat().st_size > 10_000
    # each run records where and when it was timed
    assert all(r["trained"] == "now" and r["machine"]["cores"] == os.cpu_count() and r["finished_at"]
               for r in runs.values()) and "†" not in "".join(table)

    # a rerun trains nothing: every stage is cached, and the table is the same but for its times, now marked as
    # measured before this sweep ran
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("cached") == 6 and " ok in " not in again.stdout
    rerun = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["trained"] for r in rerun] == ["earlier", "earlier"]
    assert [{**r, "trained": "now"} for r in rerun] == sweep["runs"]
    marked = (out / "sweep.md").read_text().splitlines()
    assert all(line.count(" †") == 2 for line in marked[2:4]) and marked[5].startswith("† trained before this sweep")
    assert "other hardware" not in marked[5]  # the same machine

    # --no-decode: a new setting is trained and replayed, never decoded; its tau comes from the replay alone
    fast = subprocess.run([*argv[:argv.index("--fractions")], "--no-decode", "--variant", "lr: optim.lr=2.0e-3"],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert fast.returncode == 0, fast.stderr[-3000:]
    swept = {r["variant"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert not (out / "lr-f1.eval.json").exists() and swept["lr"]["tau"] is None and swept["lr"]["eval"] is None
    assert swept["baseline"]["tau"] == runs["baseline", 1.0]["tau"]  # decoded in the first sweep: kept
    assert swept["lr"]["replay"]["rows"] == len(held) and "vs_baseline" in swept["lr"]["replay"]
    assert "replayed chat" in fast.stdout and " eval " not in fast.stdout.replace("cached", "")

    # the variant redefined under its old name: its run was trained otherwise, so it trains again (the baseline
    # and its replay stay cached)
    lr_run = out / "lr-f1"
    redone = subprocess.run([*argv[:argv.index("--fractions")], "--no-decode", "--variant", "lr: optim.lr=5.0e-3"],
                            capture_output=True, text=True, timeout=1200, env=env)
    assert redone.returncode == 0, redone.stderr[-3000:]
    assert "[lr x1] train     out of date (its `optim.lr` is 0.002, this recipe's 0.005)" in redone.stdout
    assert "[lr x1] replay    $" in redone.stdout and "[baseline x1] train     cached" in redone.stdout
    assert "lr: 0.005" in (lr_run / "resolved_config.yaml").read_text()
    assert json.loads((out / "lr-f1.replay.json").read_text())["tau"] == \
        {r["variant"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}["lr"]["replay"]["tau"]


def test_bad_variants_and_fractions_are_named():
    from dflash_train.errors import ConfigError
    from dflash_train.sweep import parse_fractions, parse_variant

    assert parse_variant("kl: objective.loss=kl optim.lr=1e-3").overrides == ("objective.loss=kl", "optim.lr=1e-3")
    assert parse_fractions("1,0.25, 0.5") == [0.25, 0.5, 1.0]
    for text, match in (("objective.loss=kl", "NAME: key=value"), ("kl:", "needs `key=value`"),
                        ("kl: objective.loss", "'objective.loss' has no `=`"), ("a b: x=1", "NAME: key=value")):
        with pytest.raises(ConfigError, match=match):
            parse_variant(text)
    for text in ("0", "1.5", "a,b", ""):
        with pytest.raises(ConfigError, match="--fractions"):
            parse_fractions(text)


def test_a_variant_trains_with_its_overrides_after_the_shared_ones(tmp_path):
    from dflash_train.sweep import Variant, eval_path, sweep_stages

    train, ev, replay = sweep_stages(tmp_path, Path("r.yaml"), ["optim.epochs=2"],
                                     Variant("kl", ("objective.loss=kl",)), 0.25, 24, 64, target="/t")
    run = tmp_path / "kl-f0.25"
    assert train.argv[1:] == ["train", "--config", "r.yaml", "--output", str(run), "--set", "data.features=offline",
                              "--set", "eval.enabled=false", "--set", "optim.epochs=2", "--set", "objective.loss=kl",
                              "--set", "data.train_fraction=0.25", "--resume", "auto"]
    assert train.done == run / "summary.json" and ev.done == eval_path(run) == tmp_path / "kl-f0.25.eval.json"
    assert ev.argv[1:] == ["eval", "--draft", str(run), "--prompts", str(run), "--target", "/t", "--num-prompts", "24",
                           "--max-new-tokens", "64", "--no-speedup", "--json", str(ev.done), "--overwrite"]
    assert replay.done == tmp_path / "kl-f0.25.replay.json"
    assert replay.argv[1:] == ["replay", "--draft", str(run), "--rows", str(run), "--target", "/t", "--json",
                               str(replay.done), "--overwrite"]


def test_the_table_has_a_column_per_source(tmp_path):
    from dflash_train.sweep import markdown_table, write_outputs

    run = {"variant": "baseline", "overrides": [], "train_rows": 100, "steps": 40, "train_seconds": 90.0,
           "val_accept_len": 2.0, "fit_accept_len": 2.25, "tau": 1.5, "tau_by_source": {"chat": 1.75, "code": 1.25}}
    sweep = {"runs": [{**run, "fraction": 0.5}, {**run, "fraction": 1.0, "train_rows": 200, "tau": 1.9,
                                                 "tau_by_source": {"chat": 2.0}, "steps_seconds": 61.4}]}
    lines = markdown_table(sweep).splitlines()
    assert lines[0] == ("| setting | overrides | train rows | steps | train min | steps s | val accept len "
                        "| the same on training rows | tau (all) | tau chat | tau code | replayed tau ± se | vs baseline (paired) |")
    # a run recorded before the steps' seconds were: its cell is empty
    assert lines[2] == ("| baseline (0.5 of the rows) | - | 100 | 40 | 1.5 | - | 2.00 | 2.25 | 1.50 | 1.75 | 1.25 "
                        "| - | - |")
    assert lines[3].startswith("| baseline | - | 200 | 40 | 1.5 | 61 | 2.00 |")
    assert lines[3].endswith("| 1.90 | 2.00 | - | - | - |")
    write_outputs(tmp_path, sweep)
    assert json.loads((tmp_path / "sweep.json").read_text()) == sweep
    assert (tmp_path / "sweep.md").read_text() == markdown_table(sweep) and (tmp_path / "sweep.png").is_file()


def test_times_of_runs_trained_before_the_sweep_are_marked_with_their_machine():
    from dflash_train.sweep import markdown_table

    here = {"cpu": "AMD EPYC", "cores": 2, "bf16_instructions": ["avx512_bf16"]}
    there = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "bf16_instructions": []}
    run = {"variant": "baseline", "overrides": [], "fraction": 1.0, "train_rows": 100, "steps": 40,
           "train_seconds": 90.0, "steps_seconds": 61.4, "val_accept_len": 2.0, "fit_accept_len": 2.25, "tau": None,
           "tau_by_source": {}, "trained": "earlier", "machine": there}
    sweep = {"machine": here, "runs": [run, {**run, "variant": "lr", "trained": "now", "machine": here,
                                             "steps_seconds": 50.2}]}
    lines = markdown_table(sweep).splitlines()
    assert "| 1.5 † | 61 † |" in lines[2] and "| 1.5 | 50 |" in lines[3] and "†" not in lines[3]
    assert lines[5] == ("† trained before this sweep ran (a resumed sweep, or a run copied in from another): its "
                        "minutes and seconds were measured then, under that moment's load; compare times between "
                        "unmarked rows; measured on other hardware: Intel(R) Xeon(R) Processor, 2 cores, bf16 "
                        "instructions: none.")
    # a run from before runs recorded their machine
    old = markdown_table({"machine": here, "runs": [{**run, "machine": None}]}).splitlines()
    assert old[-1].endswith("runs trained before 2026-12-04 do not record their machine.")
    assert "other hardware" not in old[-1]
    # every run trained by this sweep: no mark, no note
    assert "†" not in markdown_table({"machine": here, "runs": [{**run, "trained": "now", "machine": here}]})


def test_seeds_are_parsed_and_named():
    from dflash_train.errors import ConfigError
    from dflash_train.sweep import parse_seeds

    assert parse_seeds(None) is None and parse_seeds("2, 0,1") == [2, 0, 1]
    for text in ("", "a", "-1", "0,0", "1.5"):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(text)


def test_without_decoding_a_run_is_trained_then_replayed(tmp_path):
    from dflash_train.sweep import Variant, sweep_stages

    stages = sweep_stages(tmp_path, Path("r.yaml"), [], Variant("g", ("objective.gamma=2",)), 1.0, 24, 64,
                          decode=False)
    assert [st.name for st in stages] == ["train", "replay"]
    assert stages[1].argv[1:4] == ["replay", "--draft", str(tmp_path / "g-f1")]


def test_a_seeded_run_sets_its_seed_last_and_has_its_own_folder(tmp_path):
    from dflash_train.sweep import Variant, eval_path, sweep_stages

    train, ev, _ = sweep_stages(tmp_path, Path("r.yaml"), [], Variant("g", ("objective.gamma=2",)), 1.0, 24, 64,
                                seed=3)
    run = tmp_path / "g-f1-s3"
    assert train.argv[train.argv.index("--output") + 1] == str(run)
    assert train.argv[-4:] == ["--set", "seed=3", "--resume", "auto"]
    assert ev.done == eval_path(run) and ev.argv[ev.argv.index("--draft") + 1] == str(run)


def test_a_variant_that_sets_the_seed_is_refused_with_seeds(tmp_path):
    from dflash_train.errors import ConfigError
    from dflash_train.sweep import Variant, run_sweep

    with pytest.raises(ConfigError, match="--seeds sets every run's seed; drop `seed=` from --set / --variant s1"):
        run_sweep(tmp_path / "out", None, [], [Variant("s1", ("seed=1",))], [1.0], seeds=[0, 1])
    with pytest.raises(ConfigError, match="drop `seed=`"):
        run_sweep(tmp_path / "out", None, ["seed=4"], [], [1.0], seeds=[0, 1])
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_the_table_reports_each_settings_mean_and_spread_over_seeds(tmp_path):
    from dflash_train.sweep import across_seeds, markdown_table, write_outputs

    def run(variant, seed, tau, chat, code, minutes):
        return {"variant": variant, "overrides": [], "fraction": 1.0, "seed": seed, "train_rows": 100, "steps": 40,
                "train_seconds": 60.0 * minutes, "val_accept_len": 2.0, "fit_accept_len": 2.1, "tau": tau,
                "tau_by_source": {"chat": chat, "code": code}}

    runs = [run("baseline", 0, 1.5, 1.75, 1.25, 10), run("baseline", 1, 1.6, 1.85, 1.35, 12),
            run("g2", 0, 1.7, 2.0, 1.4, 11), run("g2", 1, 1.4, 1.6, 1.2, 11)]
    groups = across_seeds(runs)
    assert [g["variant"] for g in groups] == ["baseline", "g2"] and groups[0]["seeds"] == [0, 1]
    assert groups[0]["tau"]["mean"] == pytest.approx(1.55) and groups[1]["tau"]["lo"] == 1.4
    assert groups[1]["tau_by_source"]["chat"]["hi"] == 2.0 and groups[0]["train_seconds"] == pytest.approx(660)
    lines = markdown_table({"runs": runs}).splitlines()
    assert lines[2].startswith("| baseline, seed 0 | - | 100 |")
    assert "| baseline | 0, 1 | 11.0 | - | 1.550 (1.500-1.600) | 1.800 (1.750-1.850) | 1.300 (1.250-1.350) | - | - |" \
        in lines
    assert "| g2 | 0, 1 | 11.0 | - | 1.550 (1.400-1.700) | 1.800 (1.600-2.000) | 1.300 (1.200-1.400) | - | - |" in lines
    # one run per setting, no seeds: the table has no second part
    assert "Across seeds" not in markdown_table({"runs": [{**runs[0], "seed": None}]})
    write_outputs(tmp_path, {"runs": [*runs, *[{**r, "fraction": 0.5} for r in runs]]})
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_each_run_is_compared_with_the_baseline_of_its_seed_on_the_same_rows(tmp_path):
    from dflash_train.eval.replay import paired_difference, tau_with_error
    from dflash_train.sweep import across_seeds, markdown_table, replay_result

    def report(name, steps):
        per_row = [{"row": i, "source": "chat", "tokens": 40, "steps": s} for i, s in enumerate(steps)]
        body = {**tau_with_error(per_row), "per_row": per_row, "every_position": 1.8,
                "per_source": {"chat": tau_with_error(per_row)}}
        path = tmp_path / f"{name}.replay.json"
        path.write_text(json.dumps(body))
        return path, body

    def run(variant, seed, steps):
        path, body = report(f"{variant}-{seed}", steps)
        return {"variant": variant, "overrides": [], "fraction": 1.0, "seed": seed, "train_rows": 100, "steps": 40,
                "train_seconds": 60.0, "val_accept_len": 2.0, "fit_accept_len": 2.1, "tau": 1.5,
                "tau_by_source": {"chat": 1.5}, "replay": replay_result(path)}, body

    (b0, rb0), (b1, rb1) = run("baseline", 0, [30, 20, 25, 35]), run("baseline", 1, [28, 22, 25, 33])
    (g0, rg0), (g1, rg1) = run("g2", 0, [29, 19, 25, 33]), run("g2", 1, [28, 21, 24, 30])
    from dflash_train.sweep import against_baseline

    results = [b0, b1, g0, g1]
    against_baseline(results)
    assert g0["replay"]["vs_baseline"] == paired_difference(rg0, rb0)  # seed 0 against seed 0
    assert g1["replay"]["vs_baseline"] == paired_difference(rg1, rb1)
    assert g0["replay"]["vs_baseline"]["diff"] == pytest.approx(160 / 106 - 160 / 110)
    assert "vs_baseline" not in b0["replay"] and "vs_baseline" not in b1["replay"]
    lines = markdown_table({"runs": results}).splitlines()
    vs = g0["replay"]["vs_baseline"]
    assert lines[0].endswith("| replayed tau ± se | vs baseline (paired) | replayed chat |")
    assert lines[4].endswith(f"| {rg0['tau']:.3f} ± {rg0['tau_se']:.3f} | {vs['diff']:+.3f} ± {vs['se']:.3f} "
                             f"| {rg0['tau']:.3f} |")
    assert lines[2].endswith(f"| {rb0['tau']:.3f} ± {rb0['tau_se']:.3f} | - | {rb0['tau']:.3f} |")
    mean = (rg0["tau"] + rg1["tau"]) / 2
    assert across_seeds(results)[1]["replay_tau"]["mean"] == pytest.approx(mean)
    assert across_seeds(results)[1]["replay_by_source"]["chat"]["mean"] == pytest.approx(mean)
    # runs swept without decoding (no eval report): their tau cells are empty, the replay's are not
    bare = [{**r, "tau": None, "tau_by_source": {}} for r in results]
    text = markdown_table({"runs": bare})
    assert f"| 1.50 | - | {rg0['tau']:.3f} ± {rg0['tau_se']:.3f} | {vs['diff']:+.3f}" not in text
    assert f"| - | {rg0['tau']:.3f} ± {rg0['tau_se']:.3f} | {vs['diff']:+.3f} ± {vs['se']:.3f} |" in text
    assert across_seeds(bare)[0]["tau"] is None and "| g2 | 0, 1 | 1.0 | - | " in text
    assert replay_result(tmp_path / "missing.replay.json") is None


def test_the_table_gives_each_sources_paired_difference_and_their_mean_over_seeds(tmp_path):
    from dflash_train.eval.replay import paired_difference, tau_with_error
    from dflash_train.sweep import across_seeds, against_baseline, markdown_table, replay_result

    def run(variant, seed, steps, steps_seconds):
        per_row = [{"row": i, "source": "chat" if i % 2 else "code", "tokens": 40, "steps": s}
                   for i, s in enumerate(steps)]
        body = {**tau_with_error(per_row), "per_row": per_row, "every_position": 1.8,
                "per_source": {src: tau_with_error([r for r in per_row if r["source"] == src])
                               for src in ("chat", "code")}}
        path = tmp_path / f"{variant}-{seed}.replay.json"
        path.write_text(json.dumps(body))
        return {"variant": variant, "overrides": [], "fraction": 1.0, "seed": seed, "train_rows": 100, "steps": 40,
                "train_seconds": 600.0, "steps_seconds": steps_seconds, "val_accept_len": 2.0, "fit_accept_len": 2.1,
                "tau": None, "tau_by_source": {}, "replay": replay_result(path)}, body

    (b0, rb0) = run("baseline", 0, [30, 20, 25, 35, 28, 24], 500)
    (b1, rb1) = run("baseline", 1, [28, 22, 25, 33, 27, 26], 520)
    (g0, rg0), (g1, rg1) = run("g2", 0, [26, 19, 25, 31, 27, 20], 610), run("g2", 1, [27, 21, 22, 30, 27, 25], 630)
    results = [b0, b1, g0, g1]
    against_baseline(results)
    d0, d1 = paired_difference(rg0, rb0), paired_difference(rg1, rb1)
    assert set(d0["per_source"]) == {"chat", "code"}
    mean = across_seeds(results)[1]["vs_baseline"]
    assert mean["diff"] == pytest.approx((d0["diff"] + d1["diff"]) / 2)
    assert mean["se"] == pytest.approx((d0["se"] ** 2 + d1["se"] ** 2) ** 0.5 / 2)
    chat = mean["per_source"]["chat"]
    assert chat["diff"] == pytest.approx((d0["per_source"]["chat"]["diff"] + d1["per_source"]["chat"]["diff"]) / 2)
    assert across_seeds(results)[0]["vs_baseline"] is None  # the baseline has no difference to itself
    lines = markdown_table({"runs": results}).splitlines()
    c0 = d0["per_source"]["chat"]
    assert lines[4].startswith("| g2, seed 0 | - | 100 | 40 | 10.0 | 610 |")
    assert lines[4].endswith(f"| {d0['diff']:+.3f} ± {d0['se']:.3f} | {rg0['per_source']['chat']['tau']:.3f} "
                             f"({c0['diff']:+.3f} ± {c0['se']:.3f}) | {rg0['per_source']['code']['tau']:.3f} "
                             f"({d0['per_source']['code']['diff']:+.3f} ± {d0['per_source']['code']['se']:.3f}) |")
    g2 = next(line for line in lines if line.startswith("| g2 | 0, 1 |"))
    assert g2.startswith("| g2 | 0, 1 | 10.0 | 620 | - |")
    assert f"| {mean['diff']:+.3f} ± {mean['se']:.3f} |" in g2 and f", {chat['diff']:+.3f} ± {chat['se']:.3f} |" in g2


def test_a_variant_that_regenerates_other_answers_is_not_paired_and_the_table_is_still_written(tmp_path):
    from dflash_train.eval.replay import tau_with_error
    from dflash_train.sweep import across_seeds, against_baseline, markdown_table, replay_result, write_outputs

    def run(variant, tokens):
        per_row = [{"row": i, "source": "chat", "tokens": t, "steps": t // 2} for i, t in enumerate(tokens)]
        body = {**tau_with_error(per_row), "per_row": per_row, "every_position": 1.8,
                "per_source": {"chat": tau_with_error(per_row)}}
        path = tmp_path / f"{variant}.replay.json"
        path.write_text(json.dumps(body))
        return {"variant": variant, "overrides": [], "fraction": 1.0, "seed": 0, "train_rows": 100, "steps": 40,
                "train_seconds": 60.0, "val_accept_len": 2.0, "fit_accept_len": 2.1, "tau": None,
                "tau_by_source": {}, "replay": replay_result(path)}

    # the same held-out rows, but the fp32 variant regenerated them: other answer lengths
    results = [run("baseline", [40, 30, 50]), run("fp32", [40, 36, 50]), run("lr", [40, 30, 50])]
    against_baseline(results)  # before: DataError from paired_difference, and no table at all
    assert "vs_baseline" not in results[1]["replay"] and "not the baseline's" in results[1]["replay"]["unpaired"]
    assert results[2]["replay"]["vs_baseline"]["diff"] == pytest.approx(0.0)
    assert across_seeds(results)[1]["vs_baseline"] is None
    text = markdown_table({"runs": results})
    assert "| 2.000 ± 0.000 | other rows | 2.000 |" in text and "other rows: the variant changes" in text
    write_outputs(tmp_path, {"runs": results})
    assert json.loads((tmp_path / "sweep.json").read_text())["runs"][1]["replay"]["unpaired"]
