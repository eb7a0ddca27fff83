"""OnlineFeatures on the real SmolLM2 target: same numbers as a plain HF forward, padding-safe batches."""

from __future__ import annotations

import torch

from dflash_train.features.extract import TargetFeatures
from dflash_train.features.online import OnlineFeatures, target_forward

IDS = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 28120, 665, 2]


def test_target_forward_matches_hidden_states_and_argmax(smollm2):
    model, _ = smollm2
    ids = torch.tensor([IDS])
    layer_ids = [1, 14, 29]  # 29 = last layer: its output before the final norm (HF's hidden state is after it)
    feats, greedy = target_forward(model, layer_ids, ids, torch.ones_like(ids))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[2], out.hidden_states[15]], dim=-1)
    torch.testing.assert_close(feats[..., : 2 * 576], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.norm(feats[..., 2 * 576:]), out.hidden_states[30], rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy, out.logits.argmax(-1))
    fb = TargetFeatures(model, layer_ids)(ids, with_next_tokens=True)
    torch.testing.assert_close(feats, fb.features, rtol=1e-5, atol=1e-5)


def test_batched_documents_equal_one_by_one(smollm2):
    model, _ = smollm2
    online = OnlineFeatures(model, [1, 8, 14, 20, 27])
    rows = [(IDS, [0] * 7 + [1] * 6), (IDS[:5], [0, 0, 1, 1, 1]), (IDS[3:11], [1] * 8)]
    batched = online.documents(rows)
    for (ids, mask), doc in zip(rows, batched, strict=True):
        one = online.document(ids, mask)
        assert doc.features.shape == (len(ids), 5 * 576) and doc.input_ids.tolist() == ids
        assert doc.loss_mask.dtype == torch.bool and doc.loss_mask.int().tolist() == mask
        torch.testing.assert_close(doc.features, one.features, rtol=1e-4, atol=1e-4)
        assert torch.equal(doc.greedy_next, one.greedy_next)
    stored = OnlineFeatures(model, [1, 8, 14, 20, 27], storage_dtype=torch.bfloat16).document(*rows[0])
    assert stored.features.dtype == torch.bfloat16
