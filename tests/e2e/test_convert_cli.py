"""The installed `dflash-convert` command, run in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "convert"))
from convert_fixtures import smollm2_cfg, tiny_cfg, write_config, write_drafter  # noqa: E402
from hub_server import LocalHub  # noqa: E402

from dflash_train.outputs import MARKER  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXE = str(Path(sys.executable).parent / "dflash-convert")
TOKEN = "hf_e2e_secret_77aa01"


def cli(*args, env=None, check=None):
    proc = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})
    if check is not None:
        assert proc.returncode == check, proc.stdout + proc.stderr
    return proc


def test_convert_and_validate(tmp_path):
    write_drafter(tmp_path / "seed")
    cli("to-zlab", tmp_path / "seed", tmp_path / "z", check=0)
    cli("to-speculators", tmp_path / "z", tmp_path / "s", "--block-size", "6", check=0)
    out = cli("validate", tmp_path / "s", check=0).stdout
    assert "spec_non_causal" in out and "finite_weights" in out and "OK" in out
    d = json.loads((tmp_path / "s" / "config.json").read_text())
    d["sample_from_anchor"] = True
    write_config(tmp_path / "s", d)
    proc = cli("validate", tmp_path / "s", "--json", check=1)
    report = json.loads(proc.stdout)
    failed = {c["check"]: c["reason"] for c in report["checks"] if c["status"] == "fail"}
    assert report["ok"] is False and "sample_from_anchor" in failed["spec_sample_from_anchor"]


def test_reduced_vocab_refused_by_to_zlab_then_expanded(tmp_path, smollm2_path):
    write_drafter(tmp_path / "full", smollm2_cfg())
    import torch

    from dflash_train.data.vocab import write_token_freq

    write_token_freq(tmp_path / "token_freq.json", torch.arange(49152) % 13)
    cli("reduce-vocab", tmp_path / "full", tmp_path / "r", "--token-freq", tmp_path / "token_freq.json",
        "--size", "512", check=0)
    proc = cli("to-zlab", tmp_path / "r", tmp_path / "z", check=2)
    assert "SGLang cannot serve" in proc.stderr and "--expand-vocab" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("to-zlab", tmp_path / "r", tmp_path / "z", "--expand-vocab", check=0)
    assert "unchanged" in proc.stderr
    out = cli("validate", tmp_path / "z", "--target", "default", check=0).stdout
    assert "target_mask_token" in out


def test_push_to_hub_dry_run_and_upload(tmp_path):
    write_drafter(tmp_path / "d", tiny_cfg(), max_shard_bytes=30_000)
    (tmp_path / "d" / "scratch.bin").write_bytes(b"x")
    dry = cli("push-to-hub", tmp_path / "d", "org/tiny-dflash", "--dry-run", check=0).stdout
    # the toolkit's output marker stays local, like any file that is not part of the checkpoint
    files = sorted(p.name for p in (tmp_path / "d").iterdir() if p.name not in ("scratch.bin", MARKER)) + ["README.md"]
    for name in files:
        assert f"  {name}\n" in dry
    assert "scratch.bin" not in dry and MARKER not in dry and "nothing uploaded" in dry and "vllm serve" in dry
    with LocalHub() as hub:
        proc = cli("push-to-hub", tmp_path / "d", "org/tiny-dflash", "--token-env", "E2E_TOKEN",
                   env={"E2E_TOKEN": TOKEN, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}, check=0)
    assert sorted(hub.rec.committed) == sorted(files)
    assert TOKEN not in proc.stdout + proc.stderr
    assert any(TOKEN in (r["headers"].get("authorization") or "") for r in hub.rec.requests)
