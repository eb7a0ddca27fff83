"""The drafter a run starts from: new (seeded init, optionally a target layer's weights, a reduced draft
vocabulary from the training rows' token counts) or a saved one (`drafter.init_from`), with the head and
the mask embedding trained or frozen as the recipe says."""

from __future__ import annotations

from dflash_train.errors import ConfigError
from dflash_train.train.device import check_drafter_fits
from dflash_train.train.engine import World
from dflash_train.train.recipe import TrainRecipe


def build_drafter(recipe: TrainRecipe, target_path: str, target_model, tokenizer, token_counts, world: World):
    """A new drafter as the recipe says (or `drafter.init_from`); a reduced draft vocabulary keeps the
    ids most frequent in `token_counts`, a callable returning the training rows' supervised counts."""
    from dflash_train.features.layer_ids import check_target_layer_ids
    from dflash_train.features.mask_token import check_mask_token_id
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.model.init import drafter_config_for_target
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    d, tc = recipe.drafter, target_model.config.get_text_config()
    if d.target_layer_ids is not None:
        check_target_layer_ids(d.target_layer_ids, tc.num_hidden_layers, "drafter.target_layer_ids")
    if d.mask_token_id is not None:
        check_mask_token_id(d.mask_token_id, tokenizer, tc.vocab_size, "drafter.mask_token_id")
    if d.init_from:  # its config already decided the drafter fields (init_from.apply_init_from)
        model = load_drafter(d.init_from, target_config=target_model.config, tokenizer=tokenizer,
                             what="drafter.init_from")
        if model.lm_head is not None:
            model.lm_head.weight.requires_grad_(d.train_lm_head)
        if model.mask_embedding is not None and recipe.engine.zero_stage == 3:
            raise ConfigError(f"drafter.init_from {d.init_from}: the drafter has its own mask embedding "
                              "(mask_embedding.pt), which engine.zero_stage 3 would hand over partitioned; set "
                              "engine.zero_stage 2 (or 0/1)")
        return with_mask_embedding(model, d.train_mask_embedding, target_model)
    cfg = drafter_config_for_target(recipe.target, num_layers=d.num_layers, block_size=d.block_size,
                                    mask_token_id=d.mask_token_id, num_features=d.num_features,
                                    target_layer_ids=d.target_layer_ids, intermediate_size=d.intermediate_size,
                                    dtype=d.dtype)
    check_drafter_fits(recipe, cfg.num_parameters, world.device, world.size)
    model = DFlashDraftModel(cfg)
    model.init_weights(seed=recipe.seed)
    if d.init_from_target_layer is not None:
        from dflash_train.model.init import init_from_target_layer

        init_from_target_layer(model, target_model, d.init_from_target_layer)
    if d.draft_vocab_size is not None and d.draft_vocab_size < cfg.vocab_size:
        from dflash_train.model.init import reduce_drafter_vocab

        model = reduce_drafter_vocab(model, token_counts(), d.draft_vocab_size,
                                     target_model.get_output_embeddings().weight)
        model.lm_head.weight.requires_grad_(d.train_lm_head)
    return with_mask_embedding(model, d.train_mask_embedding, target_model)


def with_mask_embedding(model, train: bool, target_model):
    """`train`: the drafter's mask embedding trains, starting from the target's row of mask_token_id where
    the drafter has none yet. A drafter that has one (`init_from`) keeps it, frozen unless `train`."""
    if train and model.mask_embedding is None:
        model.learn_mask_embedding(target_model.get_input_embeddings().weight[model.config.mask_token_id].float())
    if model.mask_embedding is not None:
        model.mask_embedding.requires_grad_(train)
    return model
