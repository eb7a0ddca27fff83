"""The training run on a tiny random target: layout, exact resume after SIGKILL, 2 ranks == 1 rank,
and bad input refused before anything is overwritten. Real subprocesses of the installed command."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BIN = Path(sys.executable).parent


def _recipe(tmp_path, target, rows, **extra):
    text = f"""target: {target}
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.2}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, num_features: 2, dtype: float32}}
objective: {{anchors_per_document: 16, logits_chunk: 64}}
optim: {{lr: 1.0e-3, epochs: 2}}
batch: {{tokens_per_microbatch: 256, grad_accum: 2}}
checkpoint: {{save_every: 2, keep_last: 2}}
logging: {{log_every: 1, eval_every: 2, progress: false}}
"""
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path


def _train(args, **kw):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(BIN / "dflash-train"), "train", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300, **kw)


def _weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, train_tiny_target, train_prepared):
    tmp = tmp_path_factory.mktemp("ref")
    recipe = _recipe(tmp, train_tiny_target, train_prepared)
    out = tmp / "run"
    res = _train(["--config", recipe, "--output", out])
    assert res.returncode == 0, res.stderr[-3000:]
    return recipe, out


@pytest.mark.slow
def test_run_folder_layout(reference_run):
    _, out = reference_run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000006"]  # keep_last 2
    step = out / "checkpoints" / "step-000006"
    assert (step / "config.json").is_file() and (step / "trainer_state" / "state.json").is_file()
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert "speculators_config" in cfg and cfg["block_size"] == 4 and cfg["mask_token_id"] == 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and len(summary["val_acc_per_position"]) == 3
    assert 1.0 <= summary["val_accept_len"] <= 4.0 and summary["tokens"] > 0
    # the curve's acceptance is per position; the per-sampled-block one is kept under its own name
    assert 1.0 <= summary["train_accept_len"] <= 4.0 and 1.0 <= summary["train_accept_len_per_block"] <= 4.0
    held = json.loads((out / "holdout_rows.json").read_text())["rows"]
    assert len(held) == summary["holdout_rows"] == 5
    assert (out / "curves.png").stat().st_size > 1000 and any((out / "tensorboard").iterdir())
    # the gradient norm the clip read, over each logging window
    state = json.loads((step / "trainer_state" / "state.json").read_text())
    logged = [e for e in state["history"] if e["split"] == "train"]
    assert logged and all(0 < e["grad_norm"] <= e["grad_norm_max"] and 0 <= e["clipped"] <= 1 for e in logged)
    assert "block_size: 4  # recipe" in (out / "resolved_config.yaml").read_text()
    # the final drafter equals the last checkpoint's drafter
    a, b = _weights(out / "final"), _weights(step)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_held_out_rows_follow_the_data_seed_not_the_run_seed(reference_run, tmp_path):
    """Runs that differ in `seed` alone are measured on the same held-out rows (a spread across seeds is the
    seed's own); data.seed picks another split. The rows trained on follow the split too."""
    recipe, ref = reference_run
    held = json.loads((ref / "holdout_rows.json").read_text())["rows"]
    runs = {}
    for name, sets in (("seed1", ["seed=1"]), ("split1", ["data.seed=1"])):
        out = tmp_path / name
        res = _train(["--config", recipe, "--output", out, "--max-steps", "1", *[a for s in sets for a in ("--set", s)]])
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = json.loads((out / "holdout_rows.json").read_text())["rows"]
        assert len(runs[name]) == len(held)
    assert runs["seed1"] == held
    assert runs["split1"] != held


@pytest.mark.slow
def test_the_recipes_dropout_reaches_the_training_step_and_not_the_check(reference_run, tmp_path):
    """One step from the same initial weights: objective.dropout changes the step's loss (the forward it trains
    on); the same weights checked on held-out rows (eval mode) give the same check with or without it."""
    recipe, _ = reference_run
    summaries = {}
    for name, sets in (("plain", []), ("dropout", ["objective.dropout=0.5"])):
        out = tmp_path / name
        sets = [*sets, "optim.lr=1e-12"]  # the step leaves the weights as they were: the checks read the same drafter
        res = _train(["--config", recipe, "--output", out, "--max-steps", "1", *[a for s in sets for a in ("--set", s)]])
        assert res.returncode == 0, res.stderr[-3000:]
        summaries[name] = json.loads((out / "summary.json").read_text())
    plain, dropped = summaries["plain"], summaries["dropout"]
    # near the start the drafter barely uses its layers: the masks move the loss by ~1.5e-4 of itself (1e-7: noise)
    assert abs(dropped["train_loss"] - plain["train_loss"]) > 2e-5 * abs(plain["train_loss"])
    assert dropped["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
    assert dropped["val_accept_len"] == pytest.approx(plain["val_accept_len"], rel=1e-6)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(reference_run, tmp_path):
    recipe, ref = reference_run
    out = tmp_path / "killed"
    _killed_after_first_checkpoint(recipe, out)
    assert not (out / "final").exists()
    # without --resume the folder is refused and left alone
    again = _train(["--config", recipe, "--output", out])
    assert again.returncode == 2 and "--resume" in again.stderr
    res = _train(["--config", recipe, "--output", out, "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _weights(ref / "final"), _weights(out / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((p / "summary.json").read_text()) for p in (ref, out))
    assert ra["val_loss"] == rb["val_loss"] and ra["tokens"] == rb["tokens"]


def _killed_after_first_checkpoint(recipe, out, sets=()):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output", str(out),
                             *[a for s in sets for a in ("--set", s)]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step-000002").is_dir():
        assert proc.poll() is None and time.time() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_muon_run_trains_otherwise_and_resumes_bit_identical(reference_run, tmp_path):
    """optim.algorithm: muon reaches the optimizer (other weights than AdamW's run) and its momentum travels with
    the checkpoint: killed after step 2 and resumed, the run ends where the uninterrupted one does."""
    recipe, ref = reference_run
    whole, _ = _whole_and_resumed(recipe, tmp_path, ["optim.algorithm=muon"])
    a, adamw = _weights(whole / "final"), _weights(ref / "final")
    assert not torch.equal(a["layers.0.mlp.down_proj.weight"], adamw["layers.0.mlp.down_proj.weight"])


def _whole_and_resumed(recipe, tmp_path, sets):
    """(whole, killed): the run with `sets` uninterrupted, and killed after its first checkpoint and resumed;
    both end on the same weights."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    res = _train(["--config", recipe, "--output", whole, *[a for s in sets for a in ("--set", s)]])
    assert res.returncode == 0, res.stderr[-3000:]
    _killed_after_first_checkpoint(recipe, killed, sets)
    res = _train(["--config", recipe, "--output", killed, "--resume", *[a for s in sets for a in ("--set", s)]])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _weights(whole / "final"), _weights(killed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    return whole, killed


@pytest.mark.slow
def test_a_trained_mask_embedding_starts_at_the_targets_row_and_resumes_bit_identical(reference_run, tmp_path,
                                                                                      train_tiny_target):
    """drafter.train_mask_embedding: every checkpoint carries the trained vector as mask_embedding.pt (vLLM's form),
    it moved from the target's row of the mask id, the run's other weights differ from a run without it, a run
    killed after step 2 and resumed ends on the same vector and weights, and the saved drafter loads with it."""
    from transformers import AutoModelForCausalLM

    from dflash_train.model.checkpoint import load_drafter

    recipe, ref = reference_run
    whole, killed = _whole_and_resumed(recipe, tmp_path, ["drafter.train_mask_embedding=true"])
    assert not (ref / "final" / "mask_embedding.pt").exists()
    saved = torch.load(whole / "final" / "mask_embedding.pt", weights_only=True)
    assert saved["mask_token_id"] == 16
    row = AutoModelForCausalLM.from_pretrained(str(train_tiny_target)).get_input_embeddings().weight[16].detach()
    assert saved["embedding"].shape == row.shape and (saved["embedding"] - row).abs().max() > 1e-4
    for step in sorted((whole / "checkpoints").glob("step-*")):
        assert (step / "mask_embedding.pt").is_file(), step
    a, plain = _weights(whole / "final"), _weights(ref / "final")
    assert set(a) == set(plain) and not torch.equal(a["layers.0.self_attn.q_proj.weight"],
                                                    plain["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(torch.load(killed / "final" / "mask_embedding.pt", weights_only=True)["embedding"],
                       saved["embedding"])
    assert torch.equal(load_drafter(whole / "final").mask_embedding.detach(), saved["embedding"])
    # a run started from it keeps its vector, frozen unless it trains it; ZeRO-3, which would partition it, is refused
    frozen = tmp_path / "from-it"
    res = _train(["--config", recipe, "--output", frozen, "--max-steps", "2", "--set",
                  f"drafter.init_from={whole / 'final'}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert torch.equal(torch.load(frozen / "final" / "mask_embedding.pt", weights_only=True)["embedding"],
                       saved["embedding"])
    refused = _train(["--config", recipe, "--output", tmp_path / "z3", "--max-steps", "2", "--set",
                      f"drafter.init_from={whole / 'final'}", "--set", "engine.zero_stage=3"])
    assert refused.returncode == 2 and "mask_embedding.pt" in refused.stderr and "zero_stage 2" in refused.stderr


@pytest.mark.slow
def test_two_ranks_match_one_rank(reference_run, tmp_path):
    recipe, ref = reference_run
    out = tmp_path / "two"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29637", str(BIN / "dflash-train"),
           "train", "--config", str(recipe), "--output", str(out), "--set", "batch.grad_accum=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _weights(ref / "final"), _weights(out / "final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    ha = [h["loss"] for h in json.loads((ref / "checkpoints/step-000006/trainer_state/state.json").read_text())["history"]
          if h["split"] == "train"]
    hb = [h["loss"] for h in json.loads((out / "checkpoints/step-000006/trainer_state/state.json").read_text())["history"]
          if h["split"] == "train"]
    assert len(ha) == len(hb) == 6 and max(abs(x - y) for x, y in zip(ha, hb, strict=False)) < 1e-4
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("override, needle", [
    ("drafter.target_layer_ids=[1,9]", "drafter.target_layer_ids: layer id 9"),
    ("drafter.mask_token_id=300", "drafter.mask_token_id: 300"),
    ("drafter.block_size=1", "drafter.block_size"),
    ("objective.attention=flex", "objective.attention: flex needs a CUDA GPU"),  # this machine has none
    # refused before a byte is allocated, not killed by the kernel's out-of-memory killer
    ("drafter.intermediate_size=1000000000", "drafter.num_layers 1, drafter.intermediate_size 1000000000: the "
                                             "drafter has 192.00B parameters"),
    ("drafter.num_layers=100000000", "drafter.num_layers 100000000: the drafter has"),
])
def test_bad_input_is_refused(tmp_path, train_tiny_target, train_prepared, override, needle):
    recipe = _recipe(tmp_path, train_tiny_target, train_prepared)
    res = _train(["--config", recipe, "--output", tmp_path / "out", "--set", override])
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_other_run_in_output_is_not_overwritten(reference_run, tmp_path):
    recipe, ref = reference_run
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    before = (out / "final" / "model.safetensors").read_bytes()
    res = _train(["--config", recipe, "--output", out, "--resume", "--set", "drafter.num_layers=2"])
    assert res.returncode == 2 and "holds a different run" in res.stderr and "drafter" in res.stderr
    assert (out / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_reduced_vocab_run_keeps_the_most_frequent_supervised_ids(tmp_path, train_tiny_target, train_prepared):
    from dflash_train.data.vocab import read_token_freq, reduced_vocab_maps
    from dflash_train.model.checkpoint import load_drafter

    recipe = _recipe(tmp_path, train_tiny_target, train_prepared)
    out = tmp_path / "run"
    # a quarter of the training rows and 12 of their 22 ids: the rows counted decide which ids are kept
    res = _train(["--config", recipe, "--output", out, "--max-steps", "2", "--set", "drafter.draft_vocab_size=12",
                  "--set", "data.train_fraction=0.25"])
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 12 and cfg["transformer_layer_config"]["vocab_size"] == 49152
    draft = load_drafter(out / "final")
    # the vocabulary comes from the trained rows' answers alone: not the held-out ones, not the rows left out
    from dflash_train.data.prepare import load_prepared
    from dflash_train.data.vocab import count_token_frequencies
    from dflash_train.train.documents import fraction_of_rows

    rows = load_prepared(train_prepared)
    held = set(json.loads((out / "holdout_rows.json").read_text())["rows"])
    trained = fraction_of_rows([i for i in range(len(rows)) if i not in held], 0.25, 0)
    assert held and 0 < len(trained) < len(rows) - len(held)
    counts = count_token_frequencies([(rows[i]["input_ids"], rows[i]["loss_mask"]) for i in trained], 49152)
    d2t, t2d = reduced_vocab_maps(counts, 12)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    assert not torch.equal(t2d, reduced_vocab_maps(read_token_freq(train_prepared), 12)[1])
    assert draft.lm_head.weight.shape == (12, 64)
    # every kept id maps back onto itself through d2t
    kept = torch.nonzero(t2d).squeeze(1)
    assert torch.equal(draft.draft_to_target(torch.arange(12)), kept)
    # the reduced head is the target's rows, frozen by default; drafter.train_lm_head trains it
    from transformers import AutoModelForCausalLM

    target_head = AutoModelForCausalLM.from_pretrained(str(train_tiny_target)).get_output_embeddings().weight.detach()
    assert torch.equal(draft.lm_head.weight, target_head[kept])
    out2 = tmp_path / "run-trained-head"
    res = _train(["--config", recipe, "--output", out2, "--max-steps", "2", "--set", "drafter.draft_vocab_size=12",
                  "--set", "data.train_fraction=0.25", "--set", "drafter.train_lm_head=true"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (load_drafter(out2 / "final").lm_head.weight - target_head[kept]).abs().max() > 1e-5


@pytest.mark.slow
def test_the_periodic_check_of_a_mixture_reads_and_reports_every_source(tmp_path, train_tiny_target, train_prepared):
    from dflash_train.data.prepare import load_prepared
    from dflash_train.train.anchors import anchor_candidates, labelled_slots
    from dflash_train.train.documents import holdout_split

    # a mixture stored source by source whose first two held-out rows are both "chat": the first two
    # held-out ids alone would check one source only
    ds = load_prepared(train_prepared)
    _, held = holdout_split(len(ds), 0.2, seed=0)
    labels = ["chat" if i <= held[1] else "math" for i in range(len(ds))]
    mixed = tmp_path / "mixed"
    ds.add_column("source", labels).save_to_disk(str(mixed))
    recipe = _recipe(tmp_path, train_tiny_target, mixed)
    out = tmp_path / "run"
    # 2 anchors per training document; the check still places a block at every position
    res = _train(["--config", recipe, "--output", out, "--max-steps", "2", "--set", "logging.eval_documents=2",
                  "--set", "objective.anchors_per_document=2"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    by_source = summary["val_accept_len_by_source"]
    assert sorted(by_source) == ["chat", "math"]
    # the mixture's acceptance is the block-weighted mean of its sources'
    assert min(by_source.values()) - 1e-9 <= summary["val_accept_len"] <= max(by_source.values()) + 1e-9
    assert all(1.0 <= v <= 4.0 for v in by_source.values())
    # the check read held-out rows 0 and 2 (one per source), every labelled slot of every candidate block
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state" / "state.json").read_text())
    val = [e for e in state["history"] if e["split"] == "val"][-1]

    def every_slot(row):  # (candidate blocks, labelled slots of all of them) of one row
        mask = torch.tensor(ds[row]["loss_mask"]).bool()
        anchors = anchor_candidates(mask)
        return len(anchors), int(labelled_slots(anchors, mask, torch.full_like(anchors, len(mask)), 4)[0].sum())

    assert all(every_slot(row)[0] > 2 for row in (held[0], held[2]))
    assert val["positions"] == sum(every_slot(row)[1] for row in (held[0], held[2]))
    # the same check on as many training rows, one of each source: a seeded draw, the same on every run
    from dflash_train.train.documents import fit_rows

    train_rows = [i for i in range(len(ds)) if i not in held]
    fit = [e for e in state["history"] if e["split"] == "fit"][-1]
    chosen = fit_rows(train_rows, labels, 2, 0)
    assert sorted(labels[i] for i in chosen) == ["chat", "math"] and chosen == fit_rows(train_rows, labels, 2, 0)
    assert fit["positions"] == sum(every_slot(row)[1] for row in chosen)
    assert sorted(summary["fit_accept_len_by_source"]) == ["chat", "math"] and summary["fit_accept_len"] >= 1.0


@pytest.mark.slow
def test_bf16_mixed_stays_closer_to_fp32_than_bf16_weights(reference_run, tmp_path):
    """engine.precision bf16-mixed (fp32 weights, autocast forward) trains through DeepSpeed to weights
    that differ from the fp32 run's by rounding only, less than DeepSpeed's bf16 (bf16 weights) does."""
    recipe, ref = reference_run
    fp32 = _weights(ref / "final")
    ref_val = json.loads((ref / "summary.json").read_text())["val_loss"]
    gaps = {}
    for precision in ("bf16-mixed", "bf16"):
        out = tmp_path / precision
        res = _train(["--config", recipe, "--output", out, "--set", f"engine.precision={precision}"])
        assert res.returncode == 0, res.stderr[-3000:]
        w = _weights(out / "final")
        assert all(w[k].dtype == torch.float32 for k in w)  # drafter.dtype float32, whatever the engine held
        gaps[precision] = max(float((w[k] - fp32[k]).abs().max()) for k in fp32)
        val = json.loads((out / "summary.json").read_text())["val_loss"]
        assert abs(val - ref_val) <= 0.02 * ref_val, (precision, val, ref_val)
    # 6 Adam steps at lr 1e-3 move a weight by at most ~6e-3: rounding may flip a few updates, not more
    assert 0 < gaps["bf16-mixed"] < 1.2e-2 and gaps["bf16-mixed"] < gaps["bf16"], gaps


@pytest.mark.slow
def test_a_run_with_compiled_kernels_trains_the_eager_runs_weights(reference_run, tmp_path):
    """objective.head and objective.layer_kernels compiled (the CUDA defaults) through the real command on
    CPU (Inductor's C++ kernels): the same losses, held-out check and weights as the eager run, to fp32
    rounding, and nothing fell back to eager."""
    recipe, ref = reference_run
    out = tmp_path / "compiled"
    res = _train(["--config", recipe, "--output", out, "--set", "objective.head=compiled",
                  "--set", "objective.layer_kernels=compiled"])
    assert res.returncode == 0, res.stderr[-3000:]
    eager, fused = _weights(ref / "final"), _weights(out / "final")
    assert max(float((fused[k] - eager[k]).abs().max()) for k in eager) < 1e-4
    a, b = (json.loads((r / "summary.json").read_text()) for r in (ref, out))
    assert abs(a["val_loss"] - b["val_loss"]) < 1e-4 * a["val_loss"] and a["val_accept_len"] == b["val_accept_len"]
    assert a["kernels"] == {"attention": "split", "head": "eager", "layers": "eager", "forward": "eager",
                            "logits_chunk": 64, "fallbacks": {}}  # auto on CPU, a short run
    assert b["kernels"]["head"] == b["kernels"]["layers"] == "compiled" and b["kernels"]["fallbacks"] == {}


def test_a_run_with_the_compiled_training_forward_trains_the_eager_runs_weights(reference_run, tmp_path):
    """objective.training_forward compiled (auto's pick for long CPU runs) through the real command: one graph
    for the forward and backward of micro-batches of changing sizes (train/compiled_step.py), the same losses,
    held-out check and weights as the eager run, and nothing fell back to eager."""
    recipe, ref = reference_run
    out = tmp_path / "graph"
    res = _train(["--config", recipe, "--output", out, "--set", "objective.training_forward=compiled"])
    assert res.returncode == 0, res.stderr[-3000:]
    eager, graph = _weights(ref / "final"), _weights(out / "final")
    assert max(float((graph[k] - eager[k]).abs().max()) for k in eager) < 1e-4
    a, b = (json.loads((r / "summary.json").read_text()) for r in (ref, out))
    assert abs(a["train_loss"] - b["train_loss"]) < 1e-4 * a["train_loss"]
    assert abs(a["val_loss"] - b["val_loss"]) < 1e-4 * a["val_loss"] and a["val_accept_len"] == b["val_accept_len"]
    assert b["kernels"]["forward"] == "compiled" and b["kernels"]["fallbacks"] == {}


class _EngineOnMeta:
    """DeepSpeed cannot run on the meta device: the same calls (backward, step) on the bare module, with
    the optimizer step DeepSpeed runs without ZeRO (DeviceAdamW) at the accumulation boundary."""

    def __init__(self, module, optimizer, grad_accum):
        self.module, self.optimizer, self.grad_accum, self.steps = module, optimizer, grad_accum, 0

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self.steps += 1
        if self.steps % self.grad_accum == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()


@pytest.mark.parametrize("attention, loss", [("split", "ce"), ("dense", "ce"), ("split", "kl")])
def test_a_step_never_reads_the_device(train_tiny_target, train_prepared, attention, loss):
    """The whole step with the drafter on the meta device, where every read of a device value (item,
    float, .cpu(), a boolean-mask index, a data-dependent shape) raises: the statistics, token count
    and loss scale stay on the device until the loop logs them; kl's top-k teacher too; and the optimizer
    step after the last micro-batch (fp32 masters, the clip norm, AdamW) reads nothing either."""
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.target import load_target
    from dflash_train.train.device import StepKernels
    from dflash_train.train.documents import DocumentSource, load_rows
    from dflash_train.train.engine import World
    from dflash_train.train.finite import FiniteGuard
    from dflash_train.train.loop import StepPlan, train_step
    from dflash_train.train.optimizer import DeviceAdamW
    from dflash_train.train.recipe import load_recipe

    recipe = load_recipe(None, base={"data": {"prepared": str(train_prepared), "features": "memory"},
                                     "drafter": {"num_layers": 2, "block_size": 4, "mask_token_id": 16},
                                     "batch": {"tokens_per_microbatch": 256, "grad_accum": 2},
                                     "objective": {"loss": loss, "kl_topk": 4}}).recipe
    target, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    source = DocumentSource(rows, "memory", target, [1, 3], target_hidden=64, topk=4 if loss == "kl" else None)
    plan = StepPlan(list(range(len(source))), source.lengths, recipe, 1)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=49152, draft_vocab_size=49152,
                       target_hidden_size=64, num_target_layers=6, aux_hidden_state_layer_ids=[2, 4], block_size=4,
                       mask_token_id=16, dtype="float32")
    meta = torch.device("meta")
    model = DFlashDraftModel(cfg).to(meta)
    model.activation_checkpointing = True
    head = target.get_output_embeddings().weight
    model.attach_target_weights(torch.empty(head.shape, device=meta), torch.empty(head.shape, device=meta))
    model.to(torch.bfloat16)  # engine.precision bf16 without ZeRO: bf16 weights, fp32 masters in the optimizer
    optimizer = DeviceAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                            fp32_masters=True)
    engine = _EngineOnMeta(model, optimizer, recipe.batch.grad_accum)
    stats, tokens = train_step(engine, recipe, source, plan, World(0, 1, 0, meta), 0,
                               FiniteGuard(meta, 1e-3, 1.0), StepKernels(attention, 64))
    assert engine.steps == 2 and tokens.device == meta and stats.loss_sum.device == meta
    # the optimizer stepped (clip norm, AdamW state, masters copied back) and cleared the gradients
    assert optimizer._global_grad_norm.device == meta and all(p.grad is None for p in model.parameters())
    assert all(optimizer.state[m]["exp_avg"].device == meta for m in optimizer.masters)
    with pytest.raises((RuntimeError, NotImplementedError)):
        stats.summary()  # the negative control: the loop's log-time read would raise here


def test_a_whole_run_with_its_checks_needs_few_flex_compiles(train_tiny_target, train_prepared):
    """Compiled flex builds one kernel per (query length, key length) x layer kind x grad mode. Every
    micro-batch of a whole short run (all steps of both epochs) and of its held-out and fit checks, as
    the loop builds them: the block masks' padded lengths give at most 10 compiles (one layer kind;
    training with grads, the checks without), every one with the same context length. (CPU has no flex
    backward, so the shapes are counted, not compiled; one compile per shape is test_flex.py's.)"""
    from dflash_train.model.flex import bucket
    from dflash_train.target import load_target
    from dflash_train.train.documents import DocumentSource, fit_rows, holdout_split, load_rows, validation_rows
    from dflash_train.train.engine import World
    from dflash_train.train.loop import StepPlan, _microbatch, check_plan, step_batches
    from dflash_train.train.recipe import load_recipe

    recipe = load_recipe(_recipe(Path(train_prepared).parent.parent, train_tiny_target, train_prepared)).recipe
    target, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    labels = list(rows["source"]) if "source" in rows.column_names else None
    train_rows, held = holdout_split(len(rows), recipe.data.holdout_fraction, recipe.data.seed)
    source = DocumentSource(rows, "memory", target, [1, 3], target_hidden=64)
    world = World(0, 1, 0, torch.device("cpu"))
    plan = StepPlan(train_rows, [source.lengths[i] for i in train_rows], recipe, 1)
    train_mbs = [mb for step in range(plan.total) for mb in step_batches(recipe, source, plan, world, step)]
    check = [validation_rows(held, labels, recipe.logging.eval_documents),
             fit_rows(train_rows, labels, recipe.logging.eval_documents, recipe.seed)]
    check_mbs = [_microbatch(recipe, source, b, 0, world.device, every_anchor=True)
                 for rs in check for bins in check_plan(recipe, source, rs, labels, world).values() for b in bins]
    compiles = ({("grad", *mb.layout.flex_mask(None).seq_lengths) for mb in train_mbs}
                | {("no_grad", *mb.layout.flex_mask(None).seq_lengths) for mb in check_mbs})

    assert len(train_mbs) == 2 * plan.total and len(check_mbs) >= 2
    assert {kv - q for _, q, kv in compiles} == {bucket(recipe.batch.tokens_per_microbatch)}  # one context length
    assert len(compiles) <= 10, sorted(compiles)


def gpu_step_syncs(target: str, prepared: str) -> dict:
    """A whole training step on a GPU through the real DeepSpeed engine (ZeRO-0, bf16, DeviceAdamW, split
    attention, memory features), its second step under torch's sync debug mode set to raise on any
    host-device synchronisation. Run in its own process (a process group, a global debug mode)."""
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.target import load_target
    from dflash_train.train.device import StepKernels
    from dflash_train.train.documents import DocumentSource, load_rows
    from dflash_train.train.engine import build_engine, init_distributed
    from dflash_train.train.finite import FiniteGuard
    from dflash_train.train.loop import StepPlan, step_batches, train_step
    from dflash_train.train.recipe import load_recipe

    world = init_distributed()
    recipe = load_recipe(None, base={"data": {"prepared": prepared, "features": "memory"},
                                     "drafter": {"num_layers": 2, "block_size": 4, "mask_token_id": 16},
                                     "batch": {"tokens_per_microbatch": 256, "grad_accum": 2},
                                     "engine": {"precision": "bf16"}}).recipe
    target, _ = load_target(target, dtype=torch.bfloat16, device=str(world.device))
    source = DocumentSource(load_rows(prepared), "memory", target, [1, 3], target_hidden=64)
    plan = StepPlan(list(range(len(source))), source.lengths, recipe, 1)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=49152, draft_vocab_size=49152,
                       target_hidden_size=64, num_target_layers=6, aux_hidden_state_layer_ids=[2, 4], block_size=4,
                       mask_token_id=16, dtype="float32")
    model = DFlashDraftModel(cfg)
    model.init_weights(seed=0)
    engine, _ = build_engine(model.to(world.device), recipe, plan.total)
    engine.module.attach_target(target)
    guard, kernels = FiniteGuard(world.device, 1e-3, 1.0), StepKernels("split", 1024)
    train_step(engine, recipe, source, plan, world, 0, guard, kernels)  # warm-up: optimizer state, allocator
    batches = step_batches(recipe, source, plan, world, 1)  # host work, as the prefetch thread does it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, tokens = train_step(engine, recipe, source, plan, world, 1, guard, kernels, batches=batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"optimizer": type(engine.optimizer).__name__, "loss": stats.summary()["loss"], "tokens": int(tokens)}


@pytest.mark.gpu
def test_a_whole_gpu_step_never_synchronises(train_tiny_target, train_prepared):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    here = Path(__file__).resolve().parent
    code = (f"import sys, json; sys.path.insert(0, {str(here)!r}); from test_loop import gpu_step_syncs; "
            f"print(json.dumps(gpu_step_syncs({str(train_tiny_target)!r}, {str(train_prepared)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["optimizer"] == "DeviceAdamW" and r["tokens"] > 0 and r["loss"] > 0


@pytest.mark.slow
def test_runs_of_another_seed_reuse_the_regenerated_rows(tmp_path, train_tiny_target):
    """The data stage is seeded by data.seed: a run of another `seed` finds the regenerated rows in the cache
    (greedy answers cannot depend on a seed), and sampled answers of another data.seed get a cache entry of
    their own instead of replacing the first one."""
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"question {i}?", "response": f"answer {i}"}) + "\n"
                            for i in range(10)))
    recipe = tmp_path / "regen.yaml"
    recipe.write_text(f"""target: {train_tiny_target}
data: {{source: {rows}, features: memory, holdout_fraction: 0.2, max_length: 64, cache_dir: {tmp_path / 'cache'},
        regenerate: {{enabled: true, max_new_tokens: 4, engine: hf, dtype: float32}}}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, num_features: 2, dtype: float32}}
objective: {{anchors_per_document: 4, logits_chunk: 64}}
optim: {{lr: 1.0e-3, max_steps: 1}}
batch: {{tokens_per_microbatch: 256}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
""")

    def regenerated():
        return {str(p.parent.parent): p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("regenerated/prepare_summary.json")}

    runs = {}
    for name, sets in (("seed0", []), ("seed1", ["seed=1"]), ("sampled", ["data.regenerate.temperature=0.7"]),
                       ("sampled-data1", ["data.regenerate.temperature=0.7", "data.seed=1"])):
        res = _train(["--config", recipe, "--output", tmp_path / name, *[a for s in sets for a in ("--set", s)]])
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = regenerated()
    assert len(runs["seed0"]) == 1 and runs["seed1"] == runs["seed0"]  # the same rows, not rewritten
    assert len(runs["sampled"]) == 2 and len(runs["sampled-data1"]) == 3  # a new entry each, none replaced
    assert all(runs["sampled-data1"][k] == v for k, v in runs["sampled"].items())


@pytest.mark.slow
@pytest.mark.parametrize("features", ["offline", "online"])
def test_the_target_is_freed_before_the_steps_that_do_not_run_it(tmp_path, train_tiny_target, train_prepared,
                                                                 monkeypatch, features):
    """Offline features: the target's layers are gone before the first step (an 8B target's ~15 GB of GPU
    memory back for the steps), its cache written with the target already loaded (one load in all); online
    features run it every step, so it stays. Either way the drafter borrows its embedding and head."""
    import gc
    import weakref

    import dflash_train.target as target_module
    from dflash_train.train import loop
    from dflash_train.train.recipe import load_recipe

    loaded, alive = [], []
    real_load, real_step = target_module.load_target, loop.train_step

    def load(*args, **kw):
        model, tok = real_load(*args, **kw)
        loaded.append(weakref.ref(model))
        return model, tok

    def step(engine, *args, **kw):
        gc.collect()
        alive.append([ref() is not None for ref in loaded])
        assert engine.module._target_lm_head is not None
        return real_step(engine, *args, **kw)

    monkeypatch.setattr(target_module, "load_target", load)
    monkeypatch.setattr(loop, "train_step", step)
    recipe = load_recipe(_recipe(tmp_path, train_tiny_target, train_prepared),
                         [f"data.features={features}", f"data.cache_dir={tmp_path / 'cache'}", "optim.max_steps=2",
                          "logging.eval_every=2"])
    summary = loop.train(recipe, tmp_path / "run")
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["train_loss"]))
    assert alive == [[features == "online"]] * 2
