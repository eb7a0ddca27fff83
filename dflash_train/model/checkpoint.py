"""Saving and loading drafters.

Saved drafters are always in the speculators format (formats.md §3), so `vllm serve DIR`
takes any of them as is. Loading accepts speculators and z-lab folders; frozen copies of the
target's embedding / LM head that speculators stores are accepted and dropped.

A drafter with a mask embedding of its own keeps it beside the weights in `mask_embedding.pt`,
`{"embedding": [H_target], "mask_token_id": id}`: the file vLLM reads and substitutes at
mask_token_id (its loader refuses any unknown tensor in model.safetensors, so it cannot go there).
SGLang borrows the target's row and never reads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_train.errors import CheckpointError
from dflash_train.model import formats
from dflash_train.model.checks import all_finite, check_drafter
from dflash_train.model.config import DFlashConfig
from dflash_train.model.formats import speculators
from dflash_train.model.modeling_dflash import DFlashDraftModel, expected_shapes
from dflash_train.model.weights import (
    DEFAULT_MAX_SHARD_BYTES,
    MASK_EMBEDDING_FILE,
    read_tensors,
    write_json,
    write_tensors,
)
from dflash_train.outputs import folder_output

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dropped_tensor(name: str) -> bool:
    """Tensors other writers add that we accept and drop (frozen target copies)."""
    return name in ("embed_tokens.weight", "lm_head.weight") or name.startswith("verifier_")


def clean_state_dict(tensors: dict[str, torch.Tensor], cfg: DFlashConfig, where: str) -> dict[str, torch.Tensor]:
    """Check tensors against `cfg`: drop accepted extras, fail on unknown/missing/mis-shaped."""
    expected = expected_shapes(cfg)
    out = {}
    for name, t in tensors.items():
        key = name[len("model."):] if name.startswith("model.") and name[len("model."):] in expected else name
        if key in expected:
            out[key] = t
        elif dropped_tensor(key):
            continue
        else:
            raise CheckpointError(f"{where}: unknown tensor `{name}`; a DFlash drafter holds only "
                                  "fc, hidden_norm, layers.*, norm (and lm_head/d2t/t2d when the vocab is reduced)")
    missing = sorted(set(expected) - set(out))
    if missing:
        raise CheckpointError(f"{where}: missing tensor `{missing[0]}`" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, t in out.items():
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"{where}: tensor `{name}` has shape {list(t.shape)} but the config implies "
                                  f"{list(expected[name])}")
    return out


def save_drafter(model: DFlashDraftModel, out: str | Path, dtype: str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: dict[str, object] | None = None, *,
                 overwrite: bool | None = False, own: bool = False, command: str = "save-drafter",
                 flag: str = "output folder", sources=()) -> Path:
    """Write `model` in the speculators format, atomically. Weights in `dtype` (config's by default).

    `out` follows the output policy (dflash_train.outputs): `overwrite` replaces an earlier toolkit
    output, `own` a folder the caller owns (a run's final/); anything else that exists is refused."""
    cfg = model.config
    if dtype is not None:
        cfg = cfg.model_copy(update={"dtype": dtype})
    torch_dtype = DTYPES[cfg.dtype]
    tensors = {}
    state = model.state_dict()
    mask = state.pop("mask_embedding", None)
    for name, t in state.items():
        if not all_finite(t):  # a NaN drafter is never written
            raise CheckpointError(f"{out}: tensor `{name}` holds NaN or inf; refusing to write a broken drafter")
        tensors[name] = t if not t.is_floating_point() else t.to(torch_dtype)
    if mask is not None and not all_finite(mask):
        raise CheckpointError(f"{out}: the mask embedding holds NaN or inf; refusing to write a broken drafter")
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with folder_output(out, flag, command, sources=sources, own=own, overwrite=overwrite, need_bytes=need) as tmp:
        write_tensors(tmp, tensors, max_shard_bytes=max_shard_bytes)
        if mask is not None:
            torch.save({"embedding": mask.detach().to("cpu", torch_dtype).clone(), "mask_token_id": cfg.mask_token_id},
                       tmp / MASK_EMBEDDING_FILE)
        write_json(tmp / "config.json", speculators.to_config_dict(cfg))
        for name, data in (extra_files or {}).items():
            write_json(tmp / name, data)
    return Path(out)


def read_mask_embedding(folder: str | Path) -> torch.Tensor | None:
    """The drafter's own mask embedding [H_target] from `folder`/mask_embedding.pt (a tensor, or vLLM's
    `{"embedding": ..., "mask_token_id": ...}`), None without the file. `check_drafter` checked it first."""
    path = Path(folder) / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    data = torch.load(path, map_location="cpu", weights_only=True)
    return (data["embedding"] if isinstance(data, dict) else data).reshape(-1)


def read_drafter_config(folder: str | Path, mask_token_id: int | None = None) -> DFlashConfig:
    folder = Path(folder)
    module = formats.detect_format(folder)
    raw = formats.read_config_json(folder)
    if module is formats.zlab:
        return module.from_config_dict(raw, str(folder / "config.json"), mask_token_id=mask_token_id)
    return module.from_config_dict(raw, str(folder / "config.json"))


def load_drafter(folder: str | Path, target_config=None, dtype: torch.dtype = torch.float32,
                 mask_token_id: int | None = None, tokenizer=None, what: str = "drafter") -> DFlashDraftModel:
    """Load a speculators or z-lab drafter folder after `validate`'s structural checks (whole files,
    shapes, finite weights); with `target_config` (and `tokenizer`: the mask id) also against the
    target. `what` names the flag or field the folder came from, for messages."""
    folder = Path(folder)
    cfg = read_drafter_config(folder, mask_token_id=mask_token_id)
    check_drafter(folder, cfg, what=what, target_config=target_config, tokenizer=tokenizer)
    state = clean_state_dict(read_tensors(folder), cfg, str(folder))
    model = DFlashDraftModel(cfg)
    model.load_state_dict(state, strict=True)
    mask = read_mask_embedding(folder)
    if mask is not None:
        model.learn_mask_embedding(mask)
    return model.to(dtype)
