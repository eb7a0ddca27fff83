"""dflash_train/demo.py and dflash_train/stages.py: the demo's stages resume the run, may replace their own
outputs in OUT, and make again an output that is out of date."""

import json
from pathlib import Path

from dflash_train.demo import demo_stages


def test_stages_resume_and_overwrite_only_their_own_outputs(tmp_path):
    stages = {s.name: s.argv for s in demo_stages(tmp_path, Path("recipe.yaml"), ["optim.epochs=1"], 4, 8, "cuda")}
    assert stages["train"][-2:] == ["--resume", "auto"]  # a run killed before its first checkpoint restarts
    for name in ("convert", "eval", "replay", "to-zlab"):
        assert stages[name][-1] == "--overwrite" and str(tmp_path) in " ".join(stages[name])
    assert "--overwrite" not in stages["train"] + stages["validate"] + stages["serve"]
    assert "--no-speedup" in stages["eval"]  # the demo checks losslessness without plain decoding
    assert stages["replay"][stages["replay"].index("--device") + 1] == "cuda"  # the replay goes where the GPU is


def _py(code: str) -> list[str]:
    import sys

    return [sys.executable, "-c", code]


def _timed_stages(tmp_path, side_code: str = "import time; time.sleep(1.5); print('side done')"):
    from dflash_train.stages import Stage

    stamp = "import time, sys; print(sys.argv[1], time.time()); time.sleep(1.5)"
    return [Stage("train", _py("print('trained')")), Stage("convert", _py("print('converted')")),
            Stage("eval", _py(stamp) + ["eval"]), Stage("replay", _py("print('replayed')")),
            Stage("validate", _py(side_code)), Stage("to-zlab", _py("print('zlab')")),
            Stage("serve", _py("print('serve')"))]


def test_the_side_lane_runs_beside_the_eval_and_logs_after_it(tmp_path):
    import io
    import time

    from dflash_train.demo import run_lanes

    stages, log = _timed_stages(tmp_path), io.StringIO()
    t0 = time.time()
    run_lanes(stages, log, journal=tmp_path / "stages.jsonl")
    wall = time.time() - t0
    assert all(s.status == "ok" for s in stages)
    by_name = {s.name: s for s in stages}
    # one journal line per stage as it ended, from both lanes, with the stage's own seconds
    ended = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert sorted(e["stage"] for e in ended) == sorted(by_name) and {e["status"] for e in ended} == {"ok"}
    assert all(abs(e["seconds"] - by_name[e["stage"]].seconds) < 0.5 for e in ended), ended
    # eval and validate each sleep 1.5 s: one after the other they would take 3 s
    assert wall < by_name["eval"].seconds + by_name["validate"].seconds - 0.5, wall
    text = log.getvalue()
    assert text.index("replayed") < text.index("side done") < text.index("zlab")  # the side lane's lines kept apart


def test_on_a_gpu_the_replay_runs_in_a_lane_of_its_own_beside_the_eval(tmp_path):
    import io
    import time

    from dflash_train.demo import SIDE_LANE, lanes, run_lanes
    from dflash_train.stages import Stage

    assert lanes("cpu") == [SIDE_LANE]  # on a CPU the replay waits for the eval: they would share the cores
    assert lanes("cuda") == [("replay",), SIDE_LANE]
    stamp = "import time, sys; time.sleep(1.5); print(sys.argv[1], 'done', time.time())"
    stages = _timed_stages(tmp_path, side_code="print('side done')")
    stages[3] = Stage("replay", _py(stamp) + ["replay"])
    log = io.StringIO()
    t0 = time.time()
    run_lanes(stages, log, lanes("cuda"))
    wall = time.time() - t0
    by_name = {s.name: s for s in stages}
    assert all(s.status == "ok" for s in stages)
    # eval and replay each sleep 1.5 s: in one lane they would take 3 s
    assert wall < by_name["eval"].seconds + by_name["replay"].seconds - 0.5, wall
    text = log.getvalue()
    # the main lane's lines first, then each side lane's, in the order the lanes are named
    assert text.index("eval") < text.index("replay done") < text.index("side done") < text.index("zlab")


def test_a_failing_side_stage_is_raised_after_the_main_lane_ends(tmp_path):
    import io

    import pytest

    from dflash_train.demo import run_lanes
    from dflash_train.errors import DFlashError

    stages = _timed_stages(tmp_path, side_code="import sys; print('bad config'); sys.exit(3)")
    with pytest.raises(DFlashError, match=r"stage `validate` failed \(exit 3\)(.|\n)*bad config"):
        run_lanes(stages, io.StringIO(), journal=tmp_path / "stages.jsonl")
    by_name = {s.name: s for s in stages}
    assert by_name["replay"].status == "ok" and by_name["to-zlab"].status == "pending"
    ended = {e["stage"]: e["status"] for e in map(json.loads, (tmp_path / "stages.jsonl").read_text().splitlines())}
    assert ended == {"train": "ok", "convert": "ok", "eval": "ok", "replay": "ok", "validate": "failed"}, ended


def test_an_output_older_than_its_input_or_made_otherwise_is_made_again(tmp_path):
    import io
    import os

    from dflash_train.stages import Stage, run_stage

    run, report = tmp_path / "run", tmp_path / "report.json"
    why = []
    make_run = _py(f"import pathlib; p = pathlib.Path({str(run)!r}); p.mkdir(); (p / 'summary.json').write_text('1')")
    train = Stage("train", make_run, done=run / "summary.json", replaces=run, stale=lambda: why[0] if why else None)
    evaluate = Stage("eval", _py(f"open({str(report)!r}, 'w').write('r')"), done=report, after=(run / "summary.json",))
    for stage in (train, evaluate):
        run_stage(stage, io.StringIO())
    assert (train.status, evaluate.status) == ("ok", "ok")
    for stage in (train, evaluate):  # up to date: skipped
        run_stage(stage, io.StringIO())
    assert (train.status, evaluate.status) == ("cached", "cached")

    os.utime(report, ns=(1, 1))  # the report is older than the run it was made from
    run_stage(evaluate, io.StringIO())
    assert evaluate.status == "ok" and report.stat().st_mtime_ns > 1

    (run / "old-checkpoint").mkdir()
    why.append("its `objective.loss` is 'ce', this recipe's 'kl'")
    log = io.StringIO()
    run_stage(train, log)  # the run's own folder is removed, then the stage makes it again
    assert train.status == "ok" and not (run / "old-checkpoint").exists() and (run / "summary.json").is_file()
    assert "out of date (its `objective.loss` is 'ce', this recipe's 'kl')" in log.getvalue()
    why.clear()
    run_stage(evaluate, io.StringIO())
    assert evaluate.status == "ok"  # the run was made again after the report


def test_a_cached_stage_keeps_the_seconds_it_took_when_it_ran():
    from dflash_train.demo import stage_seconds
    from dflash_train.stages import Stage

    ran, cached = Stage("eval", [], status="ok", seconds=12.34), Stage("train", [], status="cached", seconds=0.01)
    new = Stage("serve", [], status="cached")
    assert stage_seconds([ran, cached, new], {"train": 2495.1, "eval": 300.0}) == \
        {"eval": 12.3, "train": 2495.1, "serve": None}


def test_a_cached_stage_keeps_the_ram_it_took_when_it_ran():
    from dflash_train.demo import stage_peak_gib
    from dflash_train.stages import Stage

    ran = Stage("eval", [], status="ok", peak_bytes=int(1.8 * 1024**3))
    cached = Stage("train", [], status="cached", peak_bytes=10 * 1024**2)  # what the skip cost, not the stage
    assert stage_peak_gib([ran, cached, Stage("serve", [], status="cached")], {"train": 5.11, "eval": 9.0}) == \
        {"eval": 1.8, "train": 5.11, "serve": None}


def test_the_stages_beside_the_eval_get_one_thread_and_the_eval_the_other_cores(tmp_path):
    import io

    from dflash_train.demo import beside_the_eval, lanes
    from dflash_train.machine import usable_cores
    from dflash_train.stages import Stage, run_stage

    # the eval's: every core but the other lanes', where that keeps 3/4 of them; else every core (the default)
    for device, cores, eval_threads in (("cpu", 2, None), ("cpu", 4, 3), ("cpu", 16, 15), ("cuda", 16, 14),
                                        ("cuda", 4, None), ("cuda", 8, 6)):
        stages = demo_stages(tmp_path, Path("recipe.yaml"), [], 4, 8, device)
        beside_the_eval(stages, lanes(device), cores=cores)
        threads = {s.name: s.threads for s in stages}
        assert threads["validate"] == threads["to-zlab"] == threads["serve"] == 1
        assert threads["eval"] == eval_threads
        assert threads["train"] is threads["convert"] is None
        assert threads["replay"] == (1 if device == "cuda" else None)  # on a CPU it runs after the eval, alone
    stages = demo_stages(tmp_path, Path("recipe.yaml"), [], 4, 8, "cpu")
    beside_the_eval(stages, lanes("cpu"))  # this machine's cores
    cores = usable_cores()
    assert next(s.threads for s in stages if s.name == "eval") == (cores - 1 if cores >= 4 else None)
    # what the subprocess sees: torch's intra-op threads
    one = Stage("validate", _py("import torch; print(torch.get_num_threads())"), threads=1)
    run_stage(one, io.StringIO())
    assert one.output == ["1"]
