"""SGLang reads z-lab folders only: a speculators drafter is converted once into a cache folder.

The conversion is convert's own (`convert.convert.convert_checkpoint(..., "zlab")`, which drops
tensors SGLang does not know). If that module is absent, a minimal conversion writes the z-lab
config.json with `dflash_train.model.formats.zlab.to_config_dict` and hardlinks (else copies) the weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from dflash_train.model.formats import zlab
from dflash_train.model.weights import INDEX_FILE, weight_files, write_json
from dflash_train.outputs import folder_output

from .detect import Drafter


def cache_dir() -> Path:
    """The toolkit's cache root ($DFLASH_CACHE, else ~/.cache/dflash-toolkit), as the trainer uses."""
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-toolkit")


def local_folder(drafter: Drafter) -> Path:
    """The drafter's files on disk (a hub id is fetched into the HF cache)."""
    if not drafter.is_hub_id:
        return Path(drafter.location)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(drafter.location))


def cache_key(folder: Path) -> str:
    """Changes whenever the config or any weight file changes."""
    digest = hashlib.sha256(str(folder.resolve()).encode())
    for path in [folder / "config.json", *weight_files(folder)]:
        st = path.stat()
        digest.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def zlab_cache_path(folder: Path) -> Path:
    return cache_dir() / "serve-zlab" / f"{folder.name}-{cache_key(folder)}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def minimal_to_zlab(drafter: Drafter, folder: Path, out: Path) -> None:
    """z-lab config.json + the same weight files (hardlinked), written atomically."""
    with folder_output(out, "z-lab cache folder", "serve", sources=[folder]) as tmp:
        write_json(tmp / "config.json", zlab.to_config_dict(drafter.config))
        for path in weight_files(folder):
            _link_or_copy(path, tmp / path.name)
        if (folder / INDEX_FILE).is_file():
            _link_or_copy(folder / INDEX_FILE, tmp / INDEX_FILE)


def zlab_location(drafter: Drafter, convert: bool = True) -> str:
    """What SGLang's --speculative-draft-model-path gets: the drafter itself if z-lab, else the cache."""
    if drafter.format == zlab.NAME:
        return drafter.location
    folder = local_folder(drafter)
    out = zlab_cache_path(folder)
    if convert and not (out / "config.json").is_file():
        try:
            from convert.convert import convert_checkpoint
        except ImportError:
            minimal_to_zlab(drafter, folder, out)
        else:
            convert_checkpoint(folder, out, zlab.NAME)
    return str(out)
