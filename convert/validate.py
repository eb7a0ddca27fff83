"""Validating a drafter folder against what vLLM 0.33 and SGLang load.

Runs the format's config rules (`convert.rules`), then file, tensor and optional target
checks. Every check is a named function; the result is a list of (check, status, reason)
rows. Nothing here prints: the CLI renders the report.

The structural checks (files whole, tensors present with the config's shapes, finite, vocab maps,
mask embedding, the target where it is known) and `check_drafter`, which every loader runs, live
with the model (dflash_train/model/checks.py); this module adds the engines' rules to them.
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.errors import DFlashError
from dflash_train.model import formats
from dflash_train.model.checks import (
    FATAL_EXTRAS,
    PASS,
    SKIP,
    TOLERATED_EXTRAS,
    Fail,
    Report,
    Warn,
    check_against_target,
    check_finite,
    check_weight_files,
    structure_checks,
)
from dflash_train.model.formats import schema
from dflash_train.model.modeling_dflash import expected_shapes
from dflash_train.model.stream import TensorRef
from dflash_train.model.weights import MASK_EMBEDDING_FILE, SGLANG_MASK_NOTE

from .rules import RULES


def check_tensor_names(refs: list[TensorRef], expected: dict, fmt: str) -> Warn | Fail | None:
    tolerated = []
    for ref in refs:
        if ref.name in expected:
            continue
        if ref.name in TOLERATED_EXTRAS and fmt == formats.speculators.NAME:
            tolerated.append(ref.name)
            continue
        why = "a `model.` prefix" if ref.name.startswith("model.") else (
            "a vocab map in a full-vocab drafter" if ref.name in FATAL_EXTRAS else "a name the drafter does not have")
        return Fail(f"unknown tensor `{ref.name}` ({why}): vLLM's loader fails on it; re-convert with "
                    "`dflash-convert to-speculators`, which drops it")
    if tolerated:
        return Warn(f"frozen copies {tolerated} are stored; vLLM borrows the target's, the toolkit leaves them out")
    return None


def check_dtype(refs: list[TensorRef], cfg) -> Warn | None:
    code = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(cfg.dtype)
    odd = [r.name for r in refs if r.dtype in ("F32", "F16", "BF16") and r.dtype != code]
    if odd:
        return Warn(f"config `dtype` {cfg.dtype} but tensor `{odd[0]}` is stored as another float type")
    return None


def check_sglang_full_vocab(refs: list[TensorRef]) -> Fail | None:
    names = {r.name for r in refs} & {"lm_head.weight", "d2t", "t2d"}
    if names:
        return Fail(f"tensor `{sorted(names)[0]}`: a reduced-vocab head; SGLang always borrows the target's LM head "
                    "and cannot serve it (use the speculators format, or to-zlab --expand-vocab)")
    return None


def check_sglang_mask_embedding(folder: Path) -> Warn | None:
    return Warn(SGLANG_MASK_NOTE.replace(" copied along,", "")) if (folder / MASK_EMBEDDING_FILE).is_file() else None


def target_checks(report: Report, cfg, target: str | None) -> None:
    from dflash_train.target import load_target_config, load_tokenizer, resolve_target

    path = resolve_target(target)
    target_config = load_target_config(path)
    check_against_target(report, cfg, target_config, load_tokenizer(path), target or path)
    serve_checks(report, target_config=target_config)


def serve_checks(report: Report, cfg=None, target_config=None) -> None:
    """Whether vLLM and SGLang serve DFlash for the target (dflash_train/architectures.py):
    named by the target config when checked against one, else by the drafter's verifier architectures."""
    from dflash_train.architectures import ARCHITECTURES, by_class_names, text_model_type

    if target_config is not None:
        arch, named = ARCHITECTURES.get(text_model_type(target_config)), text_model_type(target_config)
    else:
        names = getattr(cfg, "verifier_architectures", None) or []
        arch, named = by_class_names(names), ", ".join(names) or "no verifier architectures in the config"
    if arch is None:
        for engine in ("vllm", "sglang"):
            report.add(f"{engine}_serves_target", (SKIP, f"target architecture {named!r} is not in the toolkit's "
                                                         "registry; check the engine's model support"))
        return
    report.add("vllm_serves_target", (PASS, f"vLLM serves DFlash for {arch.model_type}") if arch.vllm else Warn(
        f"vLLM does not serve DFlash for {arch.model_type}: its model lacks the EAGLE-3 aux hidden-state "
        "interface; serve with SGLang or pick another target"))
    report.add("sglang_serves_target", {True: (PASS, f"SGLang serves DFlash for {arch.model_type}"),
                                        False: Warn(f"SGLang does not serve DFlash for {arch.model_type}"),
                                        None: (SKIP, f"not checked whether SGLang serves DFlash for {arch.model_type}")
                                        }[arch.sglang])


def validate_folder(folder: str | Path, target: str | None = None, use_target: bool = False) -> Report:
    """Every check for `folder`; with `use_target`, also against the target (None = embedded default)."""
    folder = Path(folder)
    report = Report(str(folder), None)
    try:
        raw = formats.read_config_json(folder)
        # a speculators config with a stray model_type is still judged as one (spec_model_type fails)
        module = formats.speculators if "speculators_config" in raw else formats.detect_format(folder)
    except DFlashError as exc:
        report.add("config_json", Fail(str(exc)))
        return report
    report.format = module.NAME
    report.add("config_json", None)
    try:
        schema.check(schema.SpeculatorsFile if module is formats.speculators else schema.ZlabFile, raw, "config.json")
    except DFlashError as exc:  # the rules below read these fields: judged only on a well-typed file
        report.add("config_schema", Fail(str(exc)))
        return report
    report.add("config_schema", None)
    for rule in RULES[module.NAME]:
        report.add(rule.__name__, rule(raw))
    try:
        if module is formats.zlab:
            cfg = module.from_config_dict(raw, "config.json", mask_token_id=0)
        else:
            cfg = module.from_config_dict(raw, "config.json")
        report.add("config_parses", None)
    except DFlashError as exc:
        cfg = None
        report.add("config_parses", Fail(str(exc)))
    refs, problem = check_weight_files(folder)
    report.add("weights_readable", problem)
    if cfg is None or not refs:
        return report
    expected = expected_shapes(cfg)
    report.add("tensor_names", check_tensor_names(refs, expected, module.NAME))
    structure_checks(report, folder, cfg, refs, expected)
    if module is formats.zlab:
        report.add("sglang_full_vocab", check_sglang_full_vocab(refs))
        report.add("sglang_mask_embedding", check_sglang_mask_embedding(folder))
    report.add("weights_dtype", check_dtype(refs, cfg))
    if problem is None:
        report.add("finite_weights", check_finite(refs))
    if use_target:
        try:
            target_checks(report, cfg, target)
        except DFlashError as exc:
            report.add("target", Fail(str(exc)))
    else:
        serve_checks(report, cfg=cfg)
    return report
