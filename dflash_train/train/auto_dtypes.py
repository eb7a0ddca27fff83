"""What a recipe's `auto` dtypes and precision become on the machine a run starts on.

`machine.auto_dtype` decides (bfloat16 on CUDA and on CPUs with bf16 instructions, float32 on the
others); each resolved field's provenance layer says why, so the run folder, the caches' keys, a
resume and summary.json name the dtype that ran, not `auto`.
"""

from __future__ import annotations

from dflash_train.train.recipe import ResolvedRecipe, TrainRecipe

# the fields whose `auto` is resolved by the machine a run starts on (machine.auto_dtype)
AUTO_DTYPE_FIELDS = ("data.regenerate.dtype", "data.target_dtype", "engine.precision")
AUTO_PRECISION = {"CUDA": "bf16", "bfloat16": "bf16-mixed", "float32": "fp32"}


def resolve_auto_dtypes(resolved: ResolvedRecipe, device=None) -> ResolvedRecipe:
    """The recipe with each `auto` of AUTO_DTYPE_FIELDS replaced by what `device` (default: CUDA when
    there is one) computes fastest in, its layer saying why ("auto: this CPU has avx512_bf16"): the run
    folder, the caches' keys and a resume then name the dtype that ran, not `auto`."""
    from dflash_train.machine import auto_dtype

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = auto_dtype(device)
    data = resolved.recipe.model_dump()
    sources = dict(resolved.sources)
    for path in AUTO_DTYPE_FIELDS:
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        if node[leaf] == "auto" and (path != "data.regenerate.dtype" or node["enabled"]):
            cuda = str(device).startswith("cuda")
            node[leaf] = AUTO_PRECISION["CUDA" if cuda else dtype] if leaf == "precision" else dtype
            sources[path] = f"auto: {why}"
    return ResolvedRecipe(TrainRecipe.model_validate(data), sources)


def dtype_fields(resolved: ResolvedRecipe) -> dict:
    """{field: {"value", "set_by"}} for the fields `auto` may set: what ran, and why (summary.json)."""
    out = {}
    for path in AUTO_DTYPE_FIELDS:
        node = resolved.recipe
        for key in path.split("."):
            node = getattr(node, key)
        out[path] = {"value": node, "set_by": resolved.sources.get(path, "default")}
    return out
