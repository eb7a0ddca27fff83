"""What a `drafter.init_from` folder decides: the drafter fields its config fixes, taken into the resolved
recipe (layer `drafter.init_from`) so the run's resolved config records what is trained."""

from __future__ import annotations

from dflash_train.errors import ConfigError
from dflash_train.train.recipe import ResolvedRecipe, TrainRecipe

# drafter fields a drafter.init_from folder decides, and how to read each from its config
INIT_FROM_FIELDS = {
    "num_layers": lambda c: c.num_hidden_layers,
    "block_size": lambda c: c.block_size,
    "mask_token_id": lambda c: c.mask_token_id,
    "num_features": lambda c: c.num_aux_layers,
    "target_layer_ids": lambda c: c.target_layer_ids,
    "intermediate_size": lambda c: c.intermediate_size,
    "draft_vocab_size": lambda c: c.draft_vocab_size if c.reduced_vocab else None,
}
USER_LAYERS = ("recipe", "--set")


def apply_init_from(resolved: ResolvedRecipe, cfg) -> ResolvedRecipe:
    """The recipe with every drafter field that `drafter.init_from` decides taken from its config `cfg`
    (layer `drafter.init_from`), so the resolved config records what is trained. A field the user set
    (recipe or --set) to another value is an error naming it; defaults are replaced silently."""
    d = resolved.recipe.drafter
    src = resolved.sources
    if d.init_from_target_layer is not None:
        raise ConfigError("drafter.init_from_target_layer and drafter.init_from both initialise the drafter; "
                          "unset one of them")
    conflicts, update = [], {}
    for name, read in INIT_FROM_FIELDS.items():
        value, ours = read(cfg), getattr(d, name)
        same = ours == value or (name == "draft_vocab_size" and value is None and ours == cfg.vocab_size)
        if src.get(f"drafter.{name}") in USER_LAYERS and not same:
            conflicts.append(f"drafter.{name} is {ours!r} but the drafter has {value!r}")
        update[name] = ours if same else value
    if conflicts:
        raise ConfigError(f"drafter.init_from {d.init_from}: " + "; ".join(conflicts) + "; remove these fields "
                          "from the recipe (the loaded drafter decides them) or start from another drafter")
    data = resolved.recipe.model_dump()
    data["drafter"].update(update)
    sources = dict(src)
    for name in INIT_FROM_FIELDS:
        if sources.get(f"drafter.{name}") not in USER_LAYERS:
            sources[f"drafter.{name}"] = "drafter.init_from"
    return ResolvedRecipe(TrainRecipe.model_validate(data), sources)


def resolve_init_from(resolved: ResolvedRecipe) -> ResolvedRecipe:
    """`apply_init_from` with the config read from the recipe's drafter.init_from folder (no-op without one)."""
    from dflash_train.errors import DFlashError
    from dflash_train.model.checkpoint import read_drafter_config

    folder = resolved.recipe.drafter.init_from
    if not folder:
        return resolved
    try:
        cfg = read_drafter_config(folder, mask_token_id=resolved.recipe.drafter.mask_token_id)
    except DFlashError as exc:
        raise ConfigError(f"drafter.init_from {folder}: {exc}") from None
    return apply_init_from(resolved, cfg)
