"""SGLang gets z-lab folders: a speculators drafter is converted once into the cache."""

import json

from dflash_train.model.weights import read_tensors
from serve_shim.detect import detect_drafter
from serve_shim.zlab_cache import minimal_to_zlab, zlab_cache_path, zlab_location


def _same_drafter(a, b):
    da, db = detect_drafter(str(a)), detect_drafter(str(b))
    assert db.format == "zlab"
    assert da.config.aux_hidden_state_layer_ids == db.config.aux_hidden_state_layer_ids
    assert (da.block_size, da.config.mask_token_id) == (db.block_size, db.config.mask_token_id)
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb) and all((ta[k] == tb[k]).all() for k in ta)


def test_zlab_folder_is_used_as_is(make_tiny_drafter):
    folder = make_tiny_drafter("zl", fmt="zlab")
    assert zlab_location(detect_drafter(str(folder))) == str(folder.resolve())


def test_speculators_converted_once(make_tiny_drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_drafter("spec", block_size=6)
    drafter = detect_drafter(str(folder))
    assert not (zlab_cache_path(folder)).exists()
    dry = zlab_location(drafter, convert=False)
    assert dry.startswith(str(tmp_path / "cache" / "serve-zlab")) and not (tmp_path / "cache").exists()
    out = zlab_location(drafter)
    assert out == dry
    _same_drafter(folder, out)
    assert json.loads((folder / "config.json").read_text())["speculators_config"]  # source untouched
    stamp = (tmp_path / "cache" / "serve-zlab").stat().st_mtime_ns
    assert zlab_location(drafter) == out  # cached: not rewritten
    assert (tmp_path / "cache" / "serve-zlab").stat().st_mtime_ns == stamp


def test_minimal_conversion_hardlinks(make_tiny_drafter, tmp_path):
    folder = make_tiny_drafter("spec")
    out = tmp_path / "zl-min"
    minimal_to_zlab(detect_drafter(str(folder)), folder, out)
    _same_drafter(folder, out)
    assert (out / "model.safetensors").stat().st_ino == (folder / "model.safetensors").stat().st_ino
