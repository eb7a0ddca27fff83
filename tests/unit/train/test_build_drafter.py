"""The drafter a run starts from: its mask embedding trained, kept frozen or absent as the recipe says."""

import torch

from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.train.build_drafter import with_mask_embedding


class _Target(torch.nn.Module):
    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(rows, hidden)

    def get_input_embeddings(self):
        return self.embed


def test_the_mask_embedding_starts_at_the_targets_row_trains_or_stays_as_the_recipe_says(tiny_config):
    target = _Target(tiny_config.vocab_size, tiny_config.target_hidden_size)
    row = target.embed.weight[tiny_config.mask_token_id].detach()
    plain = with_mask_embedding(DFlashDraftModel(tiny_config), False, target)
    assert plain.mask_embedding is None
    trained = with_mask_embedding(DFlashDraftModel(tiny_config), True, target)
    assert trained.mask_embedding.requires_grad and torch.equal(trained.mask_embedding.detach(), row)
    assert any(p is trained.mask_embedding for p in trained.parameters())  # the optimizer sees it
    # a drafter that has one (drafter.init_from) keeps its own: frozen unless trained, never reset to the row
    with torch.no_grad():
        trained.mask_embedding.add_(1.0)
    kept = with_mask_embedding(trained, False, target)
    assert not kept.mask_embedding.requires_grad and torch.equal(kept.mask_embedding.detach(), row + 1.0)
    assert with_mask_embedding(kept, True, target).mask_embedding.requires_grad
    assert torch.equal(kept.mask_embedding.detach(), row + 1.0)
