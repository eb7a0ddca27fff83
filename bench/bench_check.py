"""Benchmark: the structural check every drafter loader runs (convert.validate.check_drafter).

Writes a Qwen3-8B-shaped 1-layer bf16 drafter (hidden 4096, 5 target features, ~277M params,
~554 MB), then times, interleaved: the finiteness scan as `torch.isfinite(t).all()` (before)
and as `all_finite` (aminmax, now), each with the tensor reads it needs, and the whole
`check_drafter`. The check is bound by reading the file; the scan itself should be a small part.

    python bench/bench_check.py [--layers 1] [--reps 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.model.checkpoint import save_drafter
from dflash_train.model.checks import all_finite, check_drafter
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.stream import folder_refs


def write(folder: Path, layers: int) -> DFlashConfig:
    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, draft_vocab_size=151936,
                       target_hidden_size=4096, num_target_layers=36, aux_hidden_state_layer_ids=[2, 10, 18, 26, 34],
                       block_size=16, mask_token_id=151669, dtype="bfloat16")
    model = DFlashDraftModel(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(model.fc.weight, std=0.02)
    save_drafter(model, folder)
    return cfg


def scan(refs, finite) -> tuple[float, float]:
    start, reading = time.perf_counter(), 0.0
    for ref in refs:
        t0 = time.perf_counter()
        t = ref.read()
        reading += time.perf_counter() - t0
        assert finite(t)
    return time.perf_counter() - start, reading


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-check-", dir=args.workdir))
    try:
        cfg = write(root / "drafter", args.layers)
        size = sum(p.stat().st_size for p in (root / "drafter").iterdir())
        refs = [r for r in folder_refs(root / "drafter") if r.dtype == "BF16"]
        print(f"drafter: {size / 1e6:.0f} MB, {sum(r.nbytes for r in refs) // 2 / 1e6:.0f}M bf16 values")
        for rep in range(args.reps):
            old, old_read = scan(refs, lambda t: bool(torch.isfinite(t).all()))
            new, new_read = scan(refs, all_finite)
            t0 = time.perf_counter()
            check_drafter(root / "drafter", cfg)
            whole = time.perf_counter() - t0
            print(f"rep {rep}: isfinite().all() {old:.2f} s (reads {old_read:.2f} s) | aminmax {new:.2f} s "
                  f"(reads {new_read:.2f} s) | check_drafter {whole:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
