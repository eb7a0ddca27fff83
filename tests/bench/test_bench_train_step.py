"""bench/bench_train_step.py --layers on CPU: each depth and width builds the drafter it names, and the table
reports every variant against the one-layer recipe."""

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def test_each_layers_variant_builds_the_drafter_it_names():
    from bench_train_step import DEMO_B4, LAYERS, build_step

    for layers, width in LAYERS.values():
        model, mb = build_step(replace(DEMO_B4, layers=layers, intermediate=width, tokens=256, anchors=16))
        assert len(model.layers) == layers
        assert all(layer.mlp.gate_proj.out_features == width for layer in model.layers)
        assert mb.labels.shape[1] == DEMO_B4.block


@pytest.mark.slow
def test_the_layers_table_gives_every_variant_a_ratio_to_one_layer():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_step.py"), "--layers", "--steps", "1",
                          "--rounds", "1"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"(\d) layer\(s\), MLP\s+(\d+): step ([\d.]+) s .*?, ([\d.]+)x layers-1x1536", out.stdout)
    assert [(int(a), int(b)) for a, b, _, _ in rows] == [(1, 1536), (2, 512), (2, 1536)], out.stdout
    assert float(rows[0][3]) == 1.0 and all(float(step) > 0 for _, _, step, _ in rows)


def _variant_rows(*names):
    """Each named variant's JSON row, one step, each in a process of its own as the bench runs it."""
    import json

    rows = []
    for name in names:
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_step.py"), "--variant", name,
                              "--steps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
        assert out.returncode == 0, out.stderr[-3000:]
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def test_the_anchor_slot_variants_give_the_same_loss_and_gradient():
    """--anchor-slot's baseline computes slot 0 through the last layer and drops it, as the step did before: the
    same loss and feature-projection gradient as the step that skips it, or its ratio would compare other maths."""
    a, b = _variant_rows("anchor-slot-computed", "anchor-slot-skipped")
    # bf16-mixed: matmuls of other shapes round differently (bf16 keeps ~3 significant digits)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert max(abs(x - y) for x, y in zip(a["fc_grad"], b["fc_grad"], strict=True)) < 2e-2 * max(
        abs(x) for x in a["fc_grad"])


def test_the_optimizer_variants_step_the_rule_they_name():
    """--optimizer: each variant times the recipe's step with the optimizer it names; Muon's variants differ from
    AdamW's only in the matrices' rule (the same loss before the first update)."""
    a, m = _variant_rows("optimizer-adamw", "optimizer-muon-ns3")
    assert (a["optimizer"], m["optimizer"]) == ("DeviceAdamW", "DeviceMuon")
    assert a["loss"] == pytest.approx(m["loss"], rel=1e-6)  # the first step's loss, before any update
    assert a["last_loss"] != m["last_loss"]  # after one update by each rule
    assert a["step_s"] > 0 and m["step_s"] > 0


def test_the_split_grid_variants_compute_the_same_step():
    """--split-grid: attention run by run and in one padded grid over the same eight documents give one loss and
    gradient (bf16-mixed rounding apart), or the ratio would compare other maths; the micro-batch holds the
    documents and blocks it names."""
    from bench_train_step import DEMO_DOCS, build_step

    _, mb = build_step(replace(DEMO_DOCS, tokens=256, anchors=32))
    assert len(mb.layout.segments()) == DEMO_DOCS.documents and mb.anchors.numel() == 32
    a, b = _variant_rows("split-runs", "split-grid")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert max(abs(x - y) for x, y in zip(a["fc_grad"], b["fc_grad"], strict=True)) < 2e-2 * max(
        abs(x) for x in a["fc_grad"])


def test_the_recipe_step_runs_the_precision_auto_picks_here():
    """The recipe-step modes time what the trainer runs on this CPU: bf16-mixed where `auto` picks bfloat16, fp32
    where it does not (an AVX2 cap on oneDNN, a float32 pin), not bf16-mixed everywhere (under a cap that was
    emulated bf16, 3.1 s a step against the demo's 0.25 s). The pin stands in for the CPU's flags."""
    import json

    rows = {}
    for pin in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_step.py"), "--variant",
                              "prefix-weighting", "--steps", "1"], capture_output=True, text=True, timeout=600,
                             cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
                                            "DFLASH_AUTO_DTYPE": pin})
        assert out.returncode == 0, out.stderr[-3000:]
        rows[pin] = json.loads(out.stdout.strip().splitlines()[-1])
    assert (rows["float32"]["autocast"], rows["bfloat16"]["autocast"]) == (None, "bf16")
    # the same step in two precisions: close (bf16 keeps ~3 digits), not equal
    assert rows["float32"]["loss"] == pytest.approx(rows["bfloat16"]["loss"], rel=2e-2)
    assert rows["float32"]["loss"] != rows["bfloat16"]["loss"]


def test_the_row_bucket_variants_compute_the_same_step():
    """--row-buckets: matmuls at their own row counts and at row_buckets' sizes give one loss and gradient (bf16
    rounding apart) on the same micro-batches, or the ratio would compare other maths."""
    a, b = _variant_rows("row-buckets-off", "row-buckets-on")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert max(abs(x - y) for x, y in zip(a["fc_grad"], b["fc_grad"], strict=True)) < 2e-2 * max(
        abs(x) for x in a["fc_grad"])


@pytest.mark.slow  # ~1-2 min: Inductor compiles the step's graphs on the CPU
def test_the_compiled_step_variant_computes_the_eager_step():
    """--compiled-step: the step as one compiled graph (objective.training_forward: compiled) gives the eager step's
    loss and gradient (bf16-mixed rounding apart) on the same micro-batch, with at most two graphs over micro-batches
    of three sizes where the eager variant has none, and the first pass (the compiles) is reported apart from the
    timed steps."""
    eager, fused = _variant_rows("step-eager", "step-compiled")
    assert eager["loss"] == pytest.approx(fused["loss"], rel=1e-3)
    assert max(abs(x - y) for x, y in zip(eager["fc_grad"], fused["fc_grad"], strict=True)) < 2e-2 * max(
        abs(x) for x in eager["fc_grad"])
    assert eager["graphs"] == 0 < fused["graphs"] <= 2
    assert fused["first_pass_s"] > fused["step_s"] > 0 and eager["first_pass_s"] > 0


@pytest.mark.slow  # ~1 min: Inductor compiles the two-layer step's graphs on the CPU
def test_the_compiled_layers_variant_compiles_the_two_layer_drafter():
    """--compiled-layers: its second variant is the compiled step of two layers of MLP 512 (not the recipe's one of
    1,536), in a few graphs, its first pass (the compiles) reported apart from the timed steps."""
    (row,) = _variant_rows("compiled-2x512")
    assert (row["layers"], row["mlp"]) == (2, 512)
    assert 0 < row["graphs"] <= 3
    assert row["first_pass_s"] > row["step_s"] > 0 and row["loss"] > 0
