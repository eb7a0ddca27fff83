import json
import os
import subprocess
import sys

from dflash_train.target import DEFAULT_TARGET_NAME, cache_arg, cache_kwarg, default_target_path, resolve_target


def test_default_target_is_a_real_smollm2_folder(smollm2_path):
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    assert (smollm2_path / "model.safetensors").stat().st_size > 200e6
    assert resolve_target(None) == str(smollm2_path) == resolve_target(DEFAULT_TARGET_NAME)


def test_second_call_reuses_the_cache(smollm2_path):
    before = (smollm2_path / "model.safetensors").stat().st_mtime_ns
    assert default_target_path() == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == before
    # no temp folders are left behind by conversions
    assert not [p for p in smollm2_path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_target_info_cli_reports_layer_ids(smollm2_path):
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "target-info", "--json"],
                         capture_output=True, text=True, check=True, env=os.environ.copy())
    info = json.loads(out.stdout)
    assert info["path"] == str(smollm2_path)
    assert info["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert info["aux_hidden_state_layer_ids"] == [2, 9, 15, 21, 28]


def test_missing_target_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "target-info", "--target", str(tmp_path / "empty")],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "has no config.json" in out.stderr and "Traceback" not in out.stderr


def test_unreadable_targets_are_one_line_naming_the_flag(tmp_path):
    import json

    import pytest

    from dflash_train.errors import DFlashError
    from dflash_train.target import load_target_config, load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))  # no model_type
    with pytest.raises(DFlashError, match=f"--target {tmp_path}: cannot load its config .*model_type"):
        load_target_config(str(tmp_path))
    with pytest.raises(DFlashError, match=f"--target {tmp_path}: cannot load its tokenizer"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(DFlashError, match="--target org/bad name!!: not a local folder, and its config could not be "
                                          "read from the hub or the HF cache"):
        load_target_config("org/bad name!!")


def test_the_cache_goes_in_under_the_name_the_forward_takes(smollm2):
    """`cache` where the forward has it (transformers 5.24 on), `past_key_values` on an older forward."""
    import inspect

    class Older:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return past_key_values

    target = smollm2[0]
    want = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    assert cache_kwarg(target) == want
    assert cache_kwarg(Older()) == "past_key_values"
    marker = object()
    assert Older().forward(**cache_arg(Older(), marker)) is marker


def test_the_embedded_gguf_is_read_once_while_converting_and_converts_to_its_own_tensors(smollm2_path):
    """`_gguf_read_once`: one reader per file and one tensor-name map per (arch, layers) inside, gguf's own
    functions again outside (after an error too); and the converted folder holds the GGUF's tensors (the
    embedding dequantized by gguf itself, to bf16 rounding)."""
    import gguf
    import numpy as np
    import pytest
    import torch
    from safetensors import safe_open

    from dflash_train.target import _gguf_read_once, embedded_gguf_path

    path = embedded_gguf_path()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    with pytest.raises(RuntimeError, match="inside"), _gguf_read_once():
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    tensor = next(t for t in real_reader(path).tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(np.ascontiguousarray(gguf.dequantize(tensor.data, tensor.tensor_type)))
    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.embed_tokens.weight")
    assert got.shape == want.shape == (49152, 576)
    torch.testing.assert_close(got.float(), want.float().to(torch.bfloat16).float(), rtol=0, atol=0)
