"""Benchmark: convert a Qwen3-8B-shaped DFlash drafter (~1B params, bf16, several shards).

Writes a synthetic z-lab drafter (5 layers, hidden 4096, 5 target features) as shards, then
runs, each in its own subprocess: an import-only baseline, `to-speculators` conversion and a
plain file copy of the same bytes. Reports wall time and peak RSS (ru_maxrss from wait4) and
checks the converter's peak above the baseline stays under 1.5x the largest shard.
Needs ~4.5 GB of free disk in --workdir (default: the system temp dir); cleans up after itself.

    python bench/bench_convert.py [--layers 5] [--shard-mb 512] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# every child prints its resident memory after imports, so the work's own peak can be told apart
# (resident KiB now), then reset the kernel's peak-RSS mark (clear_refs 5) so the ru_maxrss that
# wait4 reports is the peak of the work alone, not of the imports before it.
AFTER_IMPORTS = (
    "import re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1), flush=True)\n"
    "open('/proc/self/clear_refs', 'w').write('5')\n")
CHILD_CONVERT = """
import sys
from convert.convert import convert_checkpoint
""" + AFTER_IMPORTS + """
convert_checkpoint(sys.argv[1], sys.argv[2], "speculators", max_shard_bytes=int(sys.argv[3]))
"""
CHILD_COPY = """
import shutil, sys
from pathlib import Path
import convert.convert  # same imports as the converter, so the baselines match
""" + AFTER_IMPORTS + """
out = Path(sys.argv[2]); out.mkdir()
for f in sorted(Path(sys.argv[1]).iterdir()):
    shutil.copyfile(f, out / f.name)
"""


def qwen3_8b_drafter_config(layers: int):
    from dflash_train.model.config import DFlashConfig

    return DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
                        rope_theta=1_000_000.0, vocab_size=151936, draft_vocab_size=151936, target_hidden_size=4096,
                        num_target_layers=36, aux_hidden_state_layer_ids=[2, 10, 18, 26, 34], block_size=16,
                        mask_token_id=151669, verifier_name_or_path="Qwen/Qwen3-8B", dtype="bfloat16")


def write_source(folder: Path, layers: int, shard_bytes: int) -> tuple[int, int]:
    """A z-lab folder of synthetic weights, streamed tensor by tensor. Returns (bytes, largest shard)."""
    import torch

    from convert.convert import write_checkpoint
    from dflash_train.model.checkpoint import expected_shapes
    from dflash_train.model.stream import OutTensor

    cfg = qwen3_8b_drafter_config(layers)
    gen = torch.Generator().manual_seed(0)
    block = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)

    def filler(shape):
        def make():
            n = 1
            for s in shape:
                n *= s
            reps = -(-n // block.numel())
            return block.repeat(reps)[:n].reshape(shape)
        return make

    tensors = [OutTensor(name, "BF16", tuple(shape), filler(tuple(shape)))
               for name, shape in sorted(expected_shapes(cfg).items())]
    write_checkpoint(folder, "zlab", cfg, tensors, max_shard_bytes=shard_bytes)
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return sum(sizes), max(sizes)


# A fresh exec inherits the peak RSS of the process that forked it (the kernel folds the old
# address space's high-water mark into the child's ru_maxrss), and this bench process holds
# tensors. So each measured child is started by this tiny launcher, whose RSS is negligible,
# and the launcher reports the child's ru_maxrss from wait4.
LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)
first = proc.stdout.readline().strip()
proc.stdout.read()
_, status, usage = os.wait4(proc.pid, 0)
print(first, os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def run_child(code: str, *args: str) -> tuple[float, int, int]:
    """(wall seconds, RSS after imports, peak RSS of the work) of `python -c code args`, in bytes.
    The peak is ru_maxrss from wait4 on the child, whose peak mark was reset after imports."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-c", code, *args],
                         capture_output=True, text=True, check=True).stdout.split()
    seconds = time.perf_counter() - start
    import_kib, rc, peak_kib = (int(x) for x in out[-3:])
    if rc != 0:
        raise SystemExit(f"child failed with exit code {rc}: {code.splitlines()[1]}")
    return seconds, import_kib * 1024, peak_kib * 1024  # Linux reports KiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--shard-mb", type=int, default=512)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    shard_bytes = args.shard_mb * 1024**2
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        total, largest = write_source(work / "src", args.layers, shard_bytes)
        setup_s = time.perf_counter() - t0
        n_shards = len(list((work / "src").glob("*.safetensors")))
        conv_s, conv_base, conv_rss = run_child(CHILD_CONVERT, str(work / "src"), str(work / "out"), str(shard_bytes))
        from convert.validate import validate_folder

        report = validate_folder(work / "out")
        shutil.rmtree(work / "out")
        copy_s, copy_base, copy_rss = run_child(CHILD_COPY, str(work / "src"), str(work / "copy"))
        shutil.rmtree(work / "copy")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = 1024**3
    result = {
        "params_b": round(total / 2 / 1e9, 3), "bytes_gib": round(total / gib, 3), "shards": n_shards,
        "largest_shard_gib": round(largest / gib, 3), "setup_s": round(setup_s, 1),
        "convert_s": round(conv_s, 2), "copy_s": round(copy_s, 2),
        "convert_gib_per_s": round(total / gib / conv_s, 2), "copy_gib_per_s": round(total / gib / copy_s, 2),
        "import_rss_gib": round(conv_base / gib, 3), "convert_rss_gib": round(conv_rss / gib, 3),
        "copy_rss_gib": round(copy_rss / gib, 3),
        "convert_extra_rss_over_largest_shard": round((conv_rss - conv_base) / largest, 3),
        "copy_extra_rss_over_largest_shard": round((copy_rss - copy_base) / largest, 3),
        "output_valid": report.ok,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"drafter: {result['params_b']}B params, {result['bytes_gib']} GiB in {n_shards} shards "
              f"(largest {result['largest_shard_gib']} GiB); synthetic setup {result['setup_s']} s")
        print(f"{'':14}{'time s':>9}{'GiB/s':>8}{'peak RSS GiB':>14}{'(RSS-import)/shard':>20}")
        print(f"{'to-speculators':14}{conv_s:9.2f}{result['convert_gib_per_s']:8.2f}{result['convert_rss_gib']:14.3f}"
              f"{result['convert_extra_rss_over_largest_shard']:20.3f}")
        print(f"{'file copy':14}{copy_s:9.2f}{result['copy_gib_per_s']:8.2f}{result['copy_rss_gib']:14.3f}"
              f"{result['copy_extra_rss_over_largest_shard']:20.3f}")
        print(f"RSS after imports {result['import_rss_gib']} GiB; output validates: {report.ok}")
    ok = report.ok and result["convert_extra_rss_over_largest_shard"] <= 1.5
    if not ok:
        print("FAIL: converter peak memory above 1.5x the largest shard, or invalid output", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
