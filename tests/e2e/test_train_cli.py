"""`dflash-train train` on the real SmolLM2 target: a few steps, a servable drafter in OUTPUT/final."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# the rest of a recipe for a short run on a dozen rows: a constant rate, a step per log, a check every 4 steps
SHORT_RUN = """optim: {lr: 3.0e-3, epochs: 50, warmup_ratio: 0.0, schedule: constant}
batch: {tokens_per_microbatch: 512}
checkpoint: {save_every: 100}
logging: {log_every: 1, eval_every: 4, progress: false}
eval: {enabled: false}
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_train_cli_on_smollm2(tmp_path, smollm2_path, smollm2):
    from conftest import make_train_prepared

    from dflash_train.model.checkpoint import load_drafter

    rows = make_train_prepared(tmp_path / "rows", smollm2_path, n=12)
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(f"""# target: SmolLM2 (embedded)
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.25}}
drafter: {{num_layers: 1, block_size: 8, mask_token_id: 16}}
objective: {{anchors_per_document: 32, logits_chunk: 256}}
optim: {{lr: 1.0e-3, epochs: 1}}
batch: {{tokens_per_microbatch: 512}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
eval: {{enabled: true, max_prompts: 2, max_new_tokens: 8}}
""")
    out = tmp_path / "run"
    # where torch would JIT-build DeepSpeed's CPU shared-memory op: one process starts its engine without it (a C++
    # compile of ~50 s on a fresh machine, for an all-reduce between ranks)
    extensions = tmp_path / "torch_extensions"
    res = subprocess.run([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output", str(out),
                          "--max-steps", "3", "--save-every", "2"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "drafter:" in res.stdout
    assert not extensions.exists() and "shm_comm" not in res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val_loss"] is not None and len(summary["val_acc_per_position"]) == 7
    assert 0 < summary["train_loss"] < 100 and 1.0 <= summary["val_accept_len"] <= 8.0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    model, _ = smollm2
    draft = load_drafter(out / "final", target_config=model.config)
    assert draft.config.block_size == 8 and draft.config.aux_hidden_state_layer_ids == [2, 9, 15, 21, 28]
    assert (out / "curves.png").is_file() and (out / "resolved_config.yaml").is_file()

    # the end-of-training spec-decode check ran on held-out rows only, and its numbers are in the summary
    held = json.loads((out / "holdout_rows.json").read_text())["rows"]
    report = json.loads((out / "eval.json").read_text())
    assert len(report["prompts"]) == 2 and len(held) >= 2
    assert summary["eval"]["tau"] == report["tau"] and 1.0 <= report["tau"] <= 8.0
    assert summary["eval"]["lossless"] is True and report["draft"] == str(out / "final")
    assert (out / "eval.png").is_file()
    # the recipe leaves eval.measure_speedup off: one batched decode, checked against the target's argmax, no timing
    assert report["settings"]["batched"] is True and report["speedup"] is None
    assert report["settings"]["lossless_check"] == "teacher-forced argmax" and "speedup" not in res.stdout


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("teacher", ["target_vocab", "draft_vocab"])
def test_kl_to_the_targets_topk_trains_a_reduced_vocab_drafter(tmp_path, smollm2_path, smollm2, teacher):
    """`--set objective.loss=kl` on SmolLM2 with memory features and a 512-id draft vocab: the target's
    top-32 (over its whole head, or over the draft vocab's 512 ids) are computed with the features, mapped
    into the draft vocab, and the KL falls."""
    from conftest import make_train_prepared

    from dflash_train.model.checkpoint import load_drafter

    rows = make_train_prepared(tmp_path / "rows", smollm2_path, n=12)
    recipe = tmp_path / "kl.yaml"
    recipe.write_text(f"""# target: SmolLM2 (embedded)
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.25}}
drafter: {{num_layers: 1, block_size: 8, mask_token_id: 16, draft_vocab_size: 512}}
objective: {{anchors_per_document: 32, logits_chunk: 256}}
{SHORT_RUN}""")
    out = tmp_path / "run"
    res = subprocess.run([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output", str(out),
                          "--max-steps", "12", "--set", "objective.loss=kl", "--set", "objective.kl_topk=32",
                          "--set", f"objective.kl_teacher={teacher}"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loss: kl  # --set" in (out / "resolved_config.yaml").read_text()
    state = json.loads((out / "checkpoints" / "step-000012" / "trainer_state" / "state.json").read_text())
    train = [h["loss"] for h in state["history"] if h["split"] == "train"]
    val = [h["loss"] for h in state["history"] if h["split"] == "val"]
    assert len(train) == 12 and len(val) == 3 and all(x >= 0 for x in train + val)  # a KL
    assert sum(train[-3:]) / 3 < 0.8 * sum(train[:3]) / 3, train
    assert val[-1] < val[0], val  # the same held-out rows and anchors each time
    draft = load_drafter(out / "final", target_config=smollm2[0].config)
    assert draft.config.draft_vocab_size == 512 and draft.lm_head.weight.shape[0] == 512


def _prompts_recipe(tmp_path, rows):
    """Offline features over a 512-id draft vocabulary's teacher, dataset labels with the prompts' positions."""
    recipe = tmp_path / "prompts.yaml"
    recipe.write_text(f"""# target: SmolLM2 (embedded)
data: {{prepared: {rows}, features: offline, holdout_fraction: 0.25, cache_dir: {tmp_path / "cache"}}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, draft_vocab_size: 512, train_lm_head: true}}
objective: {{loss: kl, kl_teacher: draft_vocab, labels: dataset, positions: all, anchors_per_document: 32}}
{SHORT_RUN}""")
    return recipe


@pytest.mark.e2e
@pytest.mark.slow
def test_dataset_labels_with_the_prompts_positions_train_from_a_cache_with_the_prompts_argmax(tmp_path, smollm2_path):
    """`objective.labels: dataset` with `objective.positions: all` over a draft-vocabulary teacher and offline
    features: the data cache's feature folder holds the target's argmax at the prompts' positions only, and the run
    trains on it (the KL falls) and writes a drafter."""
    from conftest import make_train_prepared

    from dflash_train.features.cache import FeatureCache

    recipe = _prompts_recipe(tmp_path, make_train_prepared(tmp_path / "rows", smollm2_path, n=12))
    out = tmp_path / "run"
    res = subprocess.run([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output", str(out),
                          "--max-steps", "8"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    [folder] = [p.parent for p in (tmp_path / "cache").rglob("manifest.json")]
    cache = FeatureCache(folder)
    assert cache.manifest["greedy_next"] == "prompts" and not folder.name.endswith(("-greedy", "-prompts"))
    doc = cache.document(0)
    answer_next = doc.loss_mask[1:].bool()
    assert bool((doc.greedy_next[:-1][answer_next] == -1).all()) and bool((doc.greedy_next[:-1][~answer_next] >= 0).all())
    state = json.loads((out / "checkpoints" / "step-000008" / "trainer_state" / "state.json").read_text())
    train = [h["loss"] for h in state["history"] if h["split"] == "train"]
    assert len(train) == 8 and sum(train[-2:]) < sum(train[:2]), train
    assert (out / "final" / "config.json").is_file()


@pytest.mark.e2e
@pytest.mark.slow
def test_features_for_a_recipe_writes_the_cache_its_training_then_reads(tmp_path, smollm2_path):
    """`dflash-train features --config`: the recipe's data stage alone writes the feature folder its `train` reads
    (the teacher over the drafter's own 512 ids, the argmax at the prompts' positions only); the training that
    follows writes no feature folder and leaves the shards as they were."""
    from conftest import make_train_prepared

    from dflash_train.features.cache import FeatureCache

    recipe = _prompts_recipe(tmp_path, make_train_prepared(tmp_path / "rows", smollm2_path, n=12))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([str(BIN / "dflash-train"), "features", "--config", str(recipe)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    [folder] = [p.parent for p in (tmp_path / "cache").rglob("manifest.json")]
    assert f"wrote {folder}" in res.stdout and "greedy tokens at the prompts' positions" in res.stdout
    assert "over the drafter's 512 ids" in res.stdout, res.stdout
    m = FeatureCache(folder).manifest
    assert m["greedy_next"] == "prompts" and m["topk_vocab"].startswith("512-") and m["num_rows"] == 12
    shards = {p: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")}
    res = subprocess.run([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output",
                          str(tmp_path / "run"), "--max-steps", "2"], capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [p.parent for p in (tmp_path / "cache").rglob("manifest.json")] == [folder]
    assert shards and {p: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")} == shards


@pytest.mark.e2e
@pytest.mark.parametrize(("args", "needle"), [
    (["--config", "recipes/smollm2-135m-demo.yaml", "--data", "rows"], "--data: not with --config"),
    (["--config", "recipes/smollm2-135m-demo.yaml", "--topk", "8"], "--topk: not with --config"),
    (["--config", "recipes/smollm2-135m-demo.yaml", "--target-dtype", "bfloat16", "--no-greedy"],
     "--target-dtype, --no-greedy: not with --config"),
    (["--data", "rows"], "give --data (prepared rows) and --output (the cache folder), or --config"),
    (["--data", "rows", "--output", "cache", "--set", "seed=1"], "--set: only with --config"),
    (["--config", "recipes/smollm2-135m-gpu.yaml"], "data.features is memory; only an offline cache is written ahead"),
])
def test_features_names_the_flags_that_do_not_go_together(args, needle):
    res = subprocess.run([str(BIN / "dflash-train"), "features", *args], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
