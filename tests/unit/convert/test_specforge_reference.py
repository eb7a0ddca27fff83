"""A drafter SpecForge trains, read by our converter, computes what SpecForge's own model computes.

SpecForge's DFlash draft model (imported from its package, not copied) with random weights is saved by its
own `save_pretrained`, converted by `convert_checkpoint` to a speculators folder and loaded as ours; a block
at an anchor over a context of target features must give the same hidden states and logits in both. This
is the path bench/bench_peer_specforge.py measures the peer trainer's drafter through, and the check that
our reading of SpecForge and z-lab folders (names, layer ids, RoPE, norms, GQA) matches theirs.
"""

from __future__ import annotations

import pytest
import torch

from convert.convert import convert_checkpoint
from dflash_train.model.checkpoint import load_drafter

HIDDEN, VOCAB, MASK, LAYER_IDS, CONTEXT = 64, 101, 100, [1, 3, 5], 24


def _specforge_drafter(specforge, block_size: int, num_layers: int):
    from transformers import Qwen3Config

    dflash, _ = specforge
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                         rms_norm_eps=1e-6, rope_theta=1000.0, max_position_embeddings=256)
    config.block_size, config.num_target_layers = block_size, 8
    config.dflash_config = {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK}
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = dflash.DFlashDraftModel(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # large weights (the norms' too), so every term of the layer matters
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize(("block_size", "num_layers", "anchor"), [(4, 1, 0), (4, 1, 13), (16, 2, 1), (16, 2, 20)])
def test_specforge_saved_drafter_computes_the_same_block_as_ours(tmp_path, specforge, block_size, num_layers,
                                                                  anchor):
    _, family = specforge
    theirs = _specforge_drafter(specforge, block_size, num_layers)
    theirs.save_pretrained(tmp_path / "specforge")  # SpecForge's checkpoint as it writes one
    convert_checkpoint(tmp_path / "specforge", tmp_path / "ours", "speculators")
    ours = load_drafter(tmp_path / "ours").eval()
    assert ours.config.block_size == block_size and ours.config.mask_token_id == MASK
    assert ours.config.aux_hidden_state_layer_ids == [i + 1 for i in LAYER_IDS]

    gen = torch.Generator().manual_seed(1)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1
    ours.attach_target_weights(embed, head)
    features = torch.randn(1, CONTEXT, len(LAYER_IDS) * HIDDEN, generator=gen)
    first = torch.randint(0, VOCAB - 1, (1,), generator=gen)
    block = ours.embed(ours.block_ids(first))  # the anchor's token, then mask tokens: [1, B, H]
    assert torch.equal(block, embed[torch.tensor([[int(first)] + [MASK] * (block_size - 1)])])

    with torch.no_grad():
        anchors = torch.tensor([[anchor]])
        mask = family.create_dflash_sdpa_mask(anchor_positions=anchors, block_keep_mask=torch.ones(1, 1, dtype=bool),
                                              S=CONTEXT, block_size=block_size, device=torch.device("cpu"))
        positions = torch.cat([torch.arange(CONTEXT), anchor + torch.arange(block_size)])[None]
        expected = theirs(position_ids=positions, attention_mask=mask, noise_embedding=block, target_hidden=features)
        cache = ours.new_cache()
        if anchor > 0:  # our decode cache holds the positions before the anchor, as SpecForge's mask does
            ours.append_context(cache, features[:, :anchor], torch.arange(anchor)[None])
        got = ours.forward_block(block, torch.tensor([anchor]), cache)
    assert expected.shape == got.shape == (1, block_size, HIDDEN)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.logits(got), expected @ head.T, rtol=1e-4, atol=1e-4)
    # the off-by-one this guards against fails it: a context that also holds the anchor's own position
    with torch.no_grad():
        longer = ours.new_cache()
        ours.append_context(longer, features[:, :anchor + 1], torch.arange(anchor + 1)[None])
        off_by_one = ours.forward_block(block, torch.tensor([anchor]), longer)
    assert (off_by_one - expected).abs().max() > 1e-2
