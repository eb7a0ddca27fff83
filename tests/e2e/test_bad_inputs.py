"""Bad input to the installed commands, one case per class (issue 15): exit code 2, exactly one
`error:` line naming the file, flag or field, no traceback, and the file tree byte-identical
before and after (nothing lost, no partial output)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_checks import refused, tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "convert"))
from convert_fixtures import edit_tensors, smollm2_cfg, write_drafter  # noqa: E402

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
FAKE_ENGINE_PY = "/opt/engine/bin/python"  # never started: every case ends before the engine would
TOKEN = "hf_bad_inputs_secret_5d1e77aa9c0b3f"


def run(command: str, *args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / command), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "DFLASH_VLLM_PYTHON": FAKE_ENGINE_PY,
                               **(env or {})})




@pytest.fixture(scope="module")
def ws(tmp_path_factory, smollm2_path):
    """Inputs shared by the cases: a sound SmolLM2-shaped drafter (B=4) and its broken variants."""
    root = tmp_path_factory.mktemp("bad-inputs")
    good = write_drafter(root / "good", smollm2_cfg())
    write_drafter(root / "nan", smollm2_cfg())
    edit_tensors(root / "nan", lambda t: {**t, "norm.weight": torch.full_like(t["norm.weight"], float("nan"))})
    write_drafter(root / "truncated", smollm2_cfg())
    data = (root / "truncated" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    write_drafter(root / "wrong-shape", smollm2_cfg())
    edit_tensors(root / "wrong-shape", lambda t: {**t, "hidden_norm.weight": torch.ones(7)})
    write_drafter(root / "wrong-hidden", smollm2_cfg(hidden_size=64, target_hidden_size=64, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=16))
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    return {"root": root, "good": good, "target": smollm2_path}


BROKEN = {
    "nan": "tensor `norm.weight` holds NaN or inf",
    "truncated": "the file is truncated",
    "wrong-shape": "tensor `hidden_norm.weight` has shape [7] but the config implies [576]",
    "wrong-hidden": "target_hidden_size 64 differs from the target's hidden_size 576",
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
@pytest.mark.parametrize("command", ["eval", "to-speculators", "serve --dry-run"])
def test_broken_drafters_are_refused_by_every_loader(ws, tmp_path, variant, command):
    folder, target = ws["root"] / variant, ws["target"]
    (tmp_path / "keep.txt").write_text("the user's file")
    before, shared = tree(tmp_path), tree(ws["root"])
    if command == "eval":
        proc = run("dflash-train", "eval", "--draft", folder, "--prompts", ws["root"] / "prompts.jsonl",
                   "--max-new-tokens", "4", "--no-speedup", "--json", tmp_path / "eval.json")
        what = f"--draft {folder}"
    elif command == "to-speculators":
        proc = run("dflash-convert", "to-speculators", folder, tmp_path / "out", "--verifier", target)
        what = f"SRC {folder}"
    else:
        proc = run("dflash-serve", folder, "--target", target, "--dry-run")
        what = f"CHECKPOINT {folder}"
        assert proc.stdout == ""  # no engine command printed
    refused(proc, what, BROKEN[variant], f"dflash-convert validate {folder}")
    assert tree(tmp_path) == before and tree(ws["root"]) == shared


@pytest.mark.parametrize("engine_args", [["--speculative-config", '{"num_speculative_tokens": 4}'],
                                         ["--spec-tokens", "9"]])
def test_more_speculative_tokens_than_the_block_holds(ws, engine_args):
    before = tree(ws["root"])
    proc = run("dflash-serve", ws["good"], "--dry-run", "--", *engine_args)
    line = refused(proc, "num_speculative_tokens", "block size 4", "pass at most 3")
    assert proc.stdout == "" and str(ws["good"]) in line
    ok = run("dflash-serve", ws["good"], "--dry-run", "--", "--spec-tokens", "2")
    assert ok.returncode == 0 and json.loads(ok.stdout.split()[-1].strip("'"))["num_speculative_tokens"] == 2
    assert tree(ws["root"]) == before


@pytest.mark.parametrize("name, content, needle", [
    ("chats.jsonl", bytes(range(128, 256)) * 64, "not UTF-8 text (byte 0x80 at offset 0)"),
    ("chats.parquet", b"PAR1" + bytes(range(256)) * 16, "not a readable Parquet file"),
])
def test_undecodable_data_files(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    before = tree(tmp_path)
    proc = run("dflash-train", "prepare", "--data", tmp_path / name, "--output", tmp_path / "prepared")
    refused(proc, f"--data {tmp_path / name}", needle)
    assert tree(tmp_path) == before


def test_device_without_cuda(ws, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    before = tree(tmp_path)
    proc = run("dflash-train", "eval", "--draft", ws["good"], "--prompts", ws["root"] / "prompts.jsonl",
               "--device", "cuda", "--json", tmp_path / "eval.json")
    refused(proc, "--device cuda", "use --device cpu")
    assert tree(tmp_path) == before


def test_config_that_is_a_folder(tmp_path):
    (tmp_path / "recipes").mkdir()
    before = tree(tmp_path)
    proc = run("dflash-train", "train", "--config", tmp_path / "recipes", "--output", tmp_path / "run")
    refused(proc, f"--config {tmp_path / 'recipes'}", "is a folder")
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_unreachable_hub_endpoint(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2",
           "HF_HOME": str(tmp_path / "hf-home")}
    (tmp_path / "hf-home").mkdir()
    before = tree(tmp_path)
    proc = run("dflash-train", "target-info", "--target", "org/no-such-model", env=env)
    refused(proc, "--target org/no-such-model", "could not be read from the hub", "HF_ENDPOINT")
    assert tree(tmp_path) == before


def test_init_from_with_conflicting_recipe_fields(ws, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {{prepared: {tmp_path / 'rows'}}}\ndrafter: {{init_from: {ws['good']}, num_layers: 3}}\n")
    before = tree(tmp_path)
    proc = run("dflash-train", "train", "--config", recipe, "--output", tmp_path / "run",
               "--set", "drafter.block_size=16", "--set", "drafter.mask_token_id=16")
    line = refused(proc, f"drafter.init_from {ws['good']}", "drafter.num_layers is 3 but the drafter has 1",
                   "drafter.block_size is 16 but the drafter has 4")
    assert "mask_token_id" not in line  # set, and equal to the drafter's
    assert tree(tmp_path) == before
    # without the conflicts the resolved config records the loaded drafter's values, not unused defaults
    recipe.write_text(f"data: {{prepared: {tmp_path / 'rows'}}}\ndrafter: {{init_from: {ws['good']}}}\n")
    dry = run("dflash-train", "train", "--config", recipe, "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    for line in ("  num_layers: 1  # drafter.init_from", "  block_size: 4  # drafter.init_from",
                 "  target_layer_ids: [1, 14, 27]  # drafter.init_from", "  num_features: 3  # drafter.init_from"):
        assert line in dry.stdout, line


def test_token_is_never_echoed(ws, tmp_path):
    before = tree(ws["root"])
    proc = run("dflash-convert", "push-to-hub", ws["good"], "org/tiny", "--token-env", TOKEN)
    refused(proc, "--token-env takes the NAME")
    assert TOKEN not in proc.stdout + proc.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run("dflash-convert", "push-to-hub", ws["good"], "org/tiny", "--token-env", "BAD_INPUTS_TOKEN",
               env={"BAD_INPUTS_TOKEN": TOKEN, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DISABLE_XET": "1"})
    refused(proc, "upload to org/tiny: cannot reach the hub", "HF_ENDPOINT")
    assert TOKEN not in proc.stdout + proc.stderr
    assert tree(ws["root"]) == before


@pytest.mark.slow
def test_infinite_learning_rate_stops_training_without_a_drafter(tmp_path, smollm2_path):
    """Step 1 is finite but its update makes the weights inf; step 2's loss is NaN. The flag is read only
    at the step-2 checkpoint (no logging before step 100): the run stops there, naming step 2, and
    writes no checkpoint, no final/ and no summary. (The weights-only case is in tests/unit/train.)"""
    from conftest import make_train_prepared

    rows = make_train_prepared(tmp_path / "rows", smollm2_path, n=8)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""data: {{prepared: {rows}, features: memory, holdout_fraction: 0.25}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16}}
objective: {{anchors_per_document: 16, logits_chunk: 256}}
batch: {{tokens_per_microbatch: 256}}
logging: {{log_every: 100, eval_every: 100, progress: false}}
""")
    before = tree(tmp_path)
    out = tmp_path / "run"
    proc = run("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "3", "--save-every", "2",
               "--set", "optim.lr=.inf", timeout=900)
    refused(proc, "training stopped: the loss is NaN or inf at step 2", "lower optim.lr (now inf)",
            "optim.grad_clip (now 1)")
    assert not (out / "final").exists() and not (out / "checkpoints").exists() and not (out / "summary.json").exists()
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("run")} == before  # the inputs are untouched
