"""Converting drafter folders between the registered formats, streaming one tensor at a time.

A source is any folder `dflash_train.model.formats` detects (z-lab / SpecForge, speculators, our own
saves) or a training run folder (its `final/` or newest complete `checkpoints/step-*/`).
The body tensors are copied byte for byte; only the config is rewritten, so A -> B -> A is
bit-exact. Frozen copies other writers add (embed_tokens, verifier_*, a full-vocab lm_head)
are dropped, because vLLM's loader fails on names it does not know.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.errors import CheckpointError, ConfigError
from dflash_train.model import formats
from dflash_train.model.checks import check_drafter, find_local_target, refusal
from dflash_train.model.config import DFlashConfig
from dflash_train.model.locate import require_drafter_folder
from dflash_train.model.stream import CODES, DTYPES, OutTensor, TensorRef, folder_refs, write_streaming
from dflash_train.model.weights import DEFAULT_MAX_SHARD_BYTES, MASK_EMBEDDING_FILE, SGLANG_MASK_NOTE, write_json
from dflash_train.outputs import folder_output, plan_output

# names other writers store beside the drafter; accepted on read and never written
DROPPABLE = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "mask_hidden")


@dataclass
class Source:
    folder: Path
    format: str
    raw: dict[str, Any]
    config: DFlashConfig
    refs: list[TensorRef]


@dataclass
class ConvertResult:
    out: Path
    format: str
    source: Path
    source_format: str
    files: list[str]
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# finding and reading the source
def resolve_source(src: str | Path) -> Path:
    """The checkpoint folder for `src`: itself, or a run folder's final/ or newest complete step."""
    return require_drafter_folder(src)


def _patch_zlab_layer_ids(raw: dict[str, Any], refs: list[TensorRef], layer_ids: list[int] | None, where: str) -> None:
    """Fill `dflash_config.target_layer_ids` from --layer-ids or z-lab's default choice."""
    inner = raw.setdefault("dflash_config", {})
    if layer_ids is not None:
        inner["target_layer_ids"] = list(layer_ids)
        return
    if "target_layer_ids" in inner or "target_layer_ids" in raw:
        return
    from dflash_train.features.layer_ids import zlab_layer_ids

    fc = next((r for r in refs if r.name in ("fc.weight", "model.fc.weight")), None)
    hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    if fc is None or not hidden or not raw.get("num_target_layers") or fc.shape[1] % hidden:
        raise ConfigError(f"{where}: no `dflash_config.target_layer_ids` and no num_target_layers to derive "
                          "them from; pass --layer-ids (z-lab ids: decoder-layer outputs)")
    inner["target_layer_ids"] = zlab_layer_ids(raw["num_target_layers"], fc.shape[1] // hidden)


def read_source(src: str | Path, *, mask_token_id: int | None = None, layer_ids: list[int] | None = None,
                target: str | None = None) -> Source:
    """The source drafter, after `validate`'s structural checks (and against `target` when its config
    is found locally): a broken source is refused before anything is written."""
    folder = resolve_source(src)
    module = formats.detect_format(folder)
    raw = formats.read_config_json(folder)
    where = str(folder / "config.json")
    try:
        refs = folder_refs(folder)
    except CheckpointError as exc:  # a truncated or unreadable weights file
        raise refusal(folder, "SRC", str(exc)) from None
    if module is formats.zlab:
        _patch_zlab_layer_ids(raw, refs, layer_ids, where)
        cfg = module.from_config_dict(raw, where, mask_token_id=mask_token_id)
    else:
        cfg = module.from_config_dict(raw, where)
    check_drafter(folder, cfg, what="SRC", target=target)
    return Source(folder, module.NAME, raw, cfg, refs)


# ------------------------------------------------------------------------------------------
# config overrides
def verifier_architectures(name_or_path: str | None) -> list[str] | None:
    """`architectures` from the verifier's config.json when it is a local folder or cached."""
    folder = find_local_target(name_or_path)
    if folder is None:
        return None
    try:
        return list(json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []) or None
    except (OSError, ValueError, AttributeError, TypeError):  # an unreadable or odd target config: not known
        return None


def apply_overrides(cfg: DFlashConfig, *, verifier: str | None = None, block_size: int | None = None,
                    mask_token_id: int | None = None, layer_ids: list[int] | None = None) -> DFlashConfig:
    from dflash_train.features.layer_ids import target_to_aux

    update: dict[str, Any] = {}
    if verifier:
        update["verifier_name_or_path"] = verifier
    if block_size is not None:
        update["block_size"] = block_size
    if mask_token_id is not None:
        update["mask_token_id"] = mask_token_id
    if layer_ids is not None:
        update["aux_hidden_state_layer_ids"] = target_to_aux(layer_ids)
    try:
        cfg = DFlashConfig.model_validate({**cfg.model_dump(), **update})
    except ValueError as exc:
        raise ConfigError(f"--verifier/--block-size/--mask-token-id/--layer-ids: {exc}") from exc
    if not cfg.verifier_architectures:
        archs = verifier_architectures(cfg.verifier_name_or_path)
        if archs:
            cfg = cfg.model_copy(update={"verifier_architectures": archs})
    return cfg


# ------------------------------------------------------------------------------------------
# tensors
def plan_tensors(refs: list[TensorRef], cfg: DFlashConfig, where: str,
                 extra: list[OutTensor] | None = None) -> tuple[list[OutTensor], list[str]]:
    """Output tensors for `cfg` from the source refs (plus `extra`, which replace same-named
    source tensors): (planned, dropped names). Checks names and shapes against the config."""
    from dflash_train.model.checkpoint import expected_shapes

    expected = expected_shapes(cfg)
    planned: dict[str, OutTensor] = {t.name: t for t in extra or []}
    dropped: list[str] = []
    for ref in refs:
        name = ref.name
        if name.startswith("model.") and name[len("model."):] in expected:
            name = name[len("model."):]
        if name in planned:
            dropped.append(ref.name)
        elif name in expected:
            if tuple(ref.shape) != tuple(expected[name]):
                raise CheckpointError(f"{where}: tensor `{ref.name}` has shape {list(ref.shape)} but the config "
                                      f"implies {list(expected[name])}")
            planned[name] = OutTensor.copy_of(ref, name)
        elif name in DROPPABLE or name.startswith("verifier_"):
            dropped.append(ref.name)
        else:
            raise CheckpointError(f"{where}: unknown tensor `{ref.name}`; a DFlash drafter holds only fc, "
                                  "hidden_norm, layers.*, norm (and lm_head/d2t/t2d when the vocab is reduced)")
    for name, t in planned.items():
        if name not in expected or tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(f"{where}: tensor `{name}` {list(t.shape)} does not fit the config "
                                  f"(expects {list(expected.get(name, ()))})")
    missing = sorted(set(expected) - set(planned))
    if missing:
        raise CheckpointError(f"{where}: missing tensor `{missing[0]}`" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    order = sorted(planned, key=_tensor_order)
    return [planned[n] for n in order], dropped


def _tensor_order(name: str) -> tuple:
    """fc, hidden_norm, layers in numeric order, norm, vocab tensors: the order readers expect."""
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    rank = {"fc.weight": 0, "hidden_norm.weight": 0, "norm.weight": 2}.get(name, 3)
    return (rank, 0, name)


def weights_dtype(refs: list[TensorRef], fallback: str) -> str:
    """The weights' float dtype name (fc.weight decides), so the config tells the truth."""
    names = {v: k for k, v in {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.items()}
    for ref in refs:
        if ref.name.endswith("fc.weight") and ref.dtype in names:
            return names[ref.dtype]
    return fallback


# ------------------------------------------------------------------------------------------
# the conversion
def write_checkpoint(out: str | Path, to: str, cfg: DFlashConfig, tensors: list[OutTensor],
                     source_folder: Path | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *,
                     overwrite: bool = False, sources=(), flag: str = "OUT") -> list[str]:
    """Write config + tensors in format `to`, atomically; copies mask_embedding.pt along.

    `out` follows the output policy (dflash_train.outputs): never a source, never a folder the
    toolkit did not write; an earlier toolkit output only with `overwrite`."""
    if to not in formats.FORMATS:
        raise ConfigError(f"unknown format {to!r}; choose one of {sorted(formats.FORMATS)}")
    config = formats.FORMATS[to].to_config_dict(cfg)
    total = sum(t.nbytes for t in tensors)
    from tqdm import tqdm

    target = folder_output(out, flag, f"to-{to}", sources=[*sources, source_folder], overwrite=overwrite,
                           need_bytes=total)
    with target as tmp, tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {to}", disable=None,
                             leave=False) as bar:
        files = write_streaming(tmp, tensors, max_shard_bytes, on_bytes=bar.update)
        write_json(tmp / "config.json", config)
        files.append("config.json")
        if source_folder is not None and (source_folder / MASK_EMBEDDING_FILE).is_file():
            shutil.copy2(source_folder / MASK_EMBEDDING_FILE, tmp / MASK_EMBEDDING_FILE)
            files.append(MASK_EMBEDDING_FILE)
    return files


def convert_checkpoint(src: str | Path, out: str | Path, to: str, *, verifier: str | None = None,
                       block_size: int | None = None, mask_token_id: int | None = None,
                       layer_ids: list[int] | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       source: Source | None = None, config: DFlashConfig | None = None,
                       extra: list[OutTensor] | None = None, overwrite: bool = False,
                       sources=()) -> ConvertResult:
    """Convert `src` (any registered format or a run folder) into format `to` at `out`.

    `out` is checked first (dflash_train.outputs), before anything is read: it may not hold `src`
    or any of `sources`, and an existing output is replaced only with `overwrite`."""
    sources = [src, *sources]
    plan_output(out, "OUT", sources=sources, overwrite=overwrite)
    source = source or read_source(src, mask_token_id=mask_token_id, layer_ids=layer_ids, target=verifier)
    cfg = config or apply_overrides(source.config, verifier=verifier, block_size=block_size,
                                    mask_token_id=mask_token_id, layer_ids=layer_ids)
    notes: list[str] = []
    cfg = cfg.model_copy(update={"dtype": weights_dtype(source.refs, cfg.dtype)})
    if cfg.all_full_attention and not cfg.sliding_window_non_causal:
        notes.append("sliding_window_non_causal was false on an all-full-attention draft; wrote true "
                     "(false makes vLLM run every layer causal and costs acceptance)")
        cfg = cfg.model_copy(update={"sliding_window_non_causal": True})
    if cfg.sample_from_anchor:
        notes.append("sample_from_anchor was true; wrote false (vLLM requires false)")
        cfg = cfg.model_copy(update={"sample_from_anchor": False})
    tensors, dropped = plan_tensors(source.refs, cfg, str(source.folder), extra)
    for t in tensors:
        if t.dtype not in DTYPES:
            raise CheckpointError(f"{source.folder}: tensor `{t.name}` has unsupported dtype {t.dtype}")
    files = write_checkpoint(out, to, cfg, tensors, source.folder, max_shard_bytes, overwrite=overwrite,
                             sources=sources)
    if to == formats.zlab.NAME and MASK_EMBEDDING_FILE in files:
        notes.append(SGLANG_MASK_NOTE)
    return ConvertResult(Path(out), to, source.folder, source.format, files, dropped, notes)


__all__ = ["CODES", "ConvertResult", "Source", "apply_overrides", "convert_checkpoint", "plan_tensors",
           "read_source", "resolve_source", "verifier_architectures", "write_checkpoint"]
