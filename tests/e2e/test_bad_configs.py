"""Malformed drafter configs and flags that used to pass silently (issue 26): exit code 2, one
`error:` line naming the file, field or flag, no traceback, the file tree unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import refused, tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "convert"))
from convert_fixtures import read_config, smollm2_cfg, tiny_cfg, write_config, write_drafter  # noqa: E402

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
FAKE_ENGINE_PY = "/opt/engine/bin/python"  # never started: every case ends before the engine would


def run(command: str, *args, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / command), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "DFLASH_VLLM_PYTHON": FAKE_ENGINE_PY,
                               "COLUMNS": "200", **extra})


def _block_size_eight(c):
    c["block_size"] = "eight"


def _block_size_huge(c):
    c["block_size"] = 10**9  # would allocate its block rows before anything else failed


def _spec_config_list(c):
    c["speculators_config"] = []


def _dtype_float8(c):
    c["dtype"] = "float8"


def _layer_ids_strings(c):
    c["aux_hidden_state_layer_ids"] = ["2", "15", "28"]


SHAPES = {  # what config.json holds -> the words the error must have
    "array": ([], "holds a JSON array ([]), not an object"),
    "string": ("drafter", "holds a JSON string ('drafter'), not an object"),
    "block-size": (_block_size_eight, "field `block_size`: input should be a valid integer (got 'eight')"),
    "block-size-huge": (_block_size_huge, "field `block_size`: input should be less than or equal to 64"),
    "section-list": (_spec_config_list, "field `speculators_config`: input should be a valid dictionary (got [])"),
    "dtype": (_dtype_float8, "field `dtype`: input should be 'float32', 'bfloat16' or 'float16' (got 'float8')"),
    "id-strings": (_layer_ids_strings, "field `aux_hidden_state_layer_ids.0`: input should be a valid integer"),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("config-shapes")
    out = {}
    for name, (change, _) in SHAPES.items():
        folder = write_drafter(root / name, smollm2_cfg())
        if callable(change):
            data = read_config(folder)
            change(data)
            write_config(folder, data)
        else:
            (folder / "config.json").write_text(json.dumps(change))
        out[name] = folder
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    return root, out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("command", ["eval", "serve --dry-run", "to-zlab", "validate"])
def test_a_config_of_the_wrong_shape_is_named_by_every_reader(shapes, tmp_path, shape, command):
    root, folders = shapes
    folder = folders[shape]
    before, shared = tree(tmp_path), tree(root)
    words = SHAPES[shape][1]
    if command == "validate":  # a report, not a refusal: exit 1, the check named, no traceback
        done = run("dflash-convert", "validate", folder, "--json")
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        failed = [c for c in json.loads(done.stdout)["checks"] if c["status"] == "fail"]
        assert len(failed) == 1 and words in failed[0]["reason"], failed
    else:
        proc = {"eval": lambda: run("dflash-train", "eval", "--draft", folder, "--prompts", root / "prompts.jsonl",
                                    "--no-speedup", "--json", tmp_path / "eval.json"),
                "serve --dry-run": lambda: run("dflash-serve", folder, "--dry-run"),
                "to-zlab": lambda: run("dflash-convert", "to-zlab", folder, tmp_path / "zlab")}[command]()
        refused(proc, f"{folder}/config.json:", words)
    assert tree(tmp_path) == before and tree(root) == shared


# ---- dflash-serve: what used to pass --dry-run ---------------------------------------------

@pytest.mark.parametrize("port", ["-1", "0", "99999"])
def test_serve_refuses_a_port_outside_tcp(tmp_path, port):
    drafter = write_drafter(tmp_path / "d", smollm2_cfg())
    refused(run("dflash-serve", drafter, "--dry-run", f"--port={port}"), f"--port {port}: not a TCP port",
            "1 to 65535")


def test_serve_refuses_a_drafter_made_for_another_hidden_size(tmp_path, smollm2_path):
    # it names SmolLM2 as its verifier (found here, converted once) but reads 64-wide states
    drafter = write_drafter(tmp_path / "d", tiny_cfg(verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct"))
    before = tree(tmp_path)
    proc = run("dflash-serve", drafter, "--dry-run")
    refused(proc, f"CHECKPOINT {drafter}:", "target_hidden_size 64 differs from the target's hidden_size 576")
    assert proc.stdout == "" and tree(tmp_path) == before


def test_serve_applies_the_engines_loader_rules(tmp_path):
    drafter = write_drafter(tmp_path / "d", smollm2_cfg())
    data = read_config(drafter)
    data["speculators_config"]["proposal_methods"] = []  # vLLM reads num_speculative_tokens from it
    write_config(drafter, data)
    proc = run("dflash-serve", drafter, "--dry-run")
    refused(proc, f"CHECKPOINT {drafter}: config.json: `speculators_config.proposal_methods` is missing or empty",
            f"dflash-convert validate {drafter}")
    assert proc.stdout == ""


def test_sglang_refuses_a_reduced_vocabulary(tmp_path):
    drafter = write_drafter(tmp_path / "d", smollm2_cfg(draft_vocab_size=1024))
    before = tree(tmp_path)
    proc = run("dflash-serve", drafter, "--engine", "sglang", "--dry-run")
    refused(proc, "--engine sglang:", "reduced draft vocabulary (draft_vocab_size 1024 < 49152)", "--engine vllm",
            "--expand-vocab")
    assert proc.stdout == "" and tree(tmp_path) == before


def test_serve_dry_run_says_when_its_engine_python_cannot_run(tmp_path):
    drafter = write_drafter(tmp_path / "d", smollm2_cfg())
    proc = run("dflash-serve", drafter, "--dry-run")  # DFLASH_VLLM_PYTHON: a path that does not exist
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(FAKE_ENGINE_PY)  # the command is still printed, as asked
    assert (f"note: {FAKE_ENGINE_PY} (--python / $DFLASH_VLLM_PYTHON) is not an executable Python, so the command "
            "below will not start as printed" in proc.stderr), proc.stderr
    assert "make vllm-venv" in proc.stderr
    # a folder is no interpreter either; a real one gets no note
    assert "is not an executable Python" in run("dflash-serve", drafter, "--dry-run", "--python", tmp_path).stderr
    real = run("dflash-serve", drafter, "--dry-run", DFLASH_VLLM_PYTHON=sys.executable)
    assert real.returncode == 0 and "note:" not in real.stderr and real.stdout.startswith(sys.executable)


# ---- prepare and push-to-hub ------------------------------------------------------------------

def test_prepare_warns_when_max_length_passes_the_target_context(tmp_path, smollm2_path):
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(smollm2_path).max_position_embeddings
    done = run("dflash-train", "prepare", "--data", "chitchat", "--max-samples", "4", "--max-length",
               str(context * 4), "--output", tmp_path / "rows")
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: --max-length {context * 4} is above the target's context of {context} tokens "
                        f"(max_position_embeddings of {smollm2_path}); rows longer than {context} tokens would go past "
                        f"it. Pass --max-length {context} or less"]
    quiet = run("dflash-train", "prepare", "--data", "chitchat", "--max-samples", "4", "--max-turns", "1",
                "--max-length", "1024", "--output", tmp_path / "rows2")  # within the context, no row cut
    assert quiet.returncode == 0 and "warning:" not in quiet.stderr
    assert json.loads((tmp_path / "rows2" / "prepare_summary.json").read_text())["rows_truncated"] == 0


def test_a_short_token_given_as_the_variable_name_is_never_printed(tmp_path):
    drafter = write_drafter(tmp_path / "d", smollm2_cfg())
    token = "hf_Zq81xK"
    proc = run("dflash-convert", "push-to-hub", drafter, "org/tiny", "--token-env", token)
    refused(proc, "--token-env takes the NAME")
    assert token not in proc.stdout + proc.stderr
