"""A recipe's data stage alone: its rows prepared and regenerated, and the offline feature cache its training reads.

`dflash-train features --config RECIPE` runs it, so the slow target passes can run once, ahead of the training
(on another machine, or before a sweep), into the data cache `dflash-train train` then finds: the same rows, the
same folder, the same teacher over the drafter's own ids (`objective.kl_teacher: draft_vocab`), and the greedy
tokens its labels need (everywhere, at the prompts' positions only, or none).
"""

from __future__ import annotations

from dflash_train.errors import ConfigError
from dflash_train.train.recipe import ResolvedRecipe


def recipe_feature_cache(resolved: ResolvedRecipe, where: str = "--config"):
    """The FeatureCache `dflash-train train` would read for `resolved`, written if missing (resumable). The target
    runs where training would (CUDA when there is one); `where` names the recipe in errors."""
    import torch

    from dflash_train.target import load_target, resolve_target, target_torch_dtype
    from dflash_train.train.auto_dtypes import resolve_auto_dtypes
    from dflash_train.train.build_drafter import build_drafter
    from dflash_train.train.documents import prepared_rows, training_rows
    from dflash_train.train.engine import init_distributed
    from dflash_train.train.feature_source import recipe_source
    from dflash_train.train.init_from import resolve_init_from

    if resolved.recipe.data.features != "offline":
        raise ConfigError(f"{where}: data.features is {resolved.recipe.data.features}; only an offline cache is "
                          "written ahead of training: --set data.features=offline")
    world = init_distributed()
    recipe = resolve_auto_dtypes(resolve_init_from(resolved), world.device).recipe
    target_path = resolve_target(recipe.target)
    target, tokenizer = load_target(target_path, dtype=target_torch_dtype(recipe.data.target_dtype, world.device),
                                    device=str(world.device))
    with torch.no_grad():
        rows = training_rows(recipe.data, prepared_rows(recipe.data, target_path))
        drafter = build_drafter(recipe, target_path, target, tokenizer, rows.token_counts, world)
        return recipe_source(recipe, target_path, rows, target, drafter).cache
