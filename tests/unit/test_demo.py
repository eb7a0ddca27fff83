"""dflash_train/demo.py: its stages resume the run and may replace their own outputs in OUT."""

from pathlib import Path

from dflash_train.demo import demo_stages


def test_stages_resume_and_overwrite_only_their_own_outputs(tmp_path):
    stages = {s.name: s.argv for s in demo_stages(tmp_path, Path("recipe.yaml"), ["optim.epochs=1"], 4, 8)}
    assert stages["train"][-2:] == ["--resume", "auto"]  # a run killed before its first checkpoint restarts
    for name in ("convert", "eval", "to-zlab"):
        assert stages[name][-1] == "--overwrite" and str(tmp_path) in " ".join(stages[name])
    assert "--overwrite" not in stages["train"] + stages["validate"] + stages["serve"]
    assert "--no-speedup" in stages["eval"]  # the demo checks losslessness without plain decoding
