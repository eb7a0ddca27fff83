"""Online features: Documents computed from a loaded target inside training.

`target_forward` is the single function that turns token ids into (features, greedy next
tokens); the offline cache calls it too, so both paths compute the same numbers. It keeps
memory to one batch: decoder-layer outputs are captured by hooks (no tuple of every hidden
state) and the LM head runs in chunks over positions, keeping only the argmax.

Feature `t` is the output of decoder layer t (extract.py: the last layer's too, before the
final norm, as vLLM serves it).

Dtype: features come out in the model's dtype. The offline cache stores bfloat16 by default;
pass `storage_dtype=torch.bfloat16` to `OnlineFeatures` to round online features the same
way, which makes online and offline training batches bit-identical when computed in the
same batches (and equal up to one bf16 rounding step otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_train.data.packing import Document
from dflash_train.features.extract import capture_layers, decoder, decoder_layers, head_outputs
from dflash_train.features.layer_ids import check_target_layer_ids


@torch.no_grad()
def target_forward(model, layer_ids: Sequence[int], input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, topk: int | None = None,
                   greedy: bool | torch.Tensor = True, topk_vocab: torch.Tensor | None = None) -> tuple:
    """(features [B, T, n*H], greedy next tokens [B, T]) for a right-padded batch; with `topk`,
    also (top-k ids [B, T, k] int32, top-k log-probs [B, T, k] fp32) from the same head chunks.

    `greedy=False` (and no `topk`): the greedy tokens are None, and the forward stops after the
    deepest layer in `layer_ids`: the LM head (a fifth of SmolLM2's compute) and the layers
    above are never run. The features are the same either way. `topk_vocab` (sorted target ids): the
    top k over those ids only (`head_outputs`); with `greedy=False` the greedy tokens are None and only
    the head's rows of those ids run. `greedy` a bool [B, T] mask: the greedy tokens at those positions only
    (-1 elsewhere), the whole head run on their rows alone."""
    masked = isinstance(greedy, torch.Tensor)
    stop_at = None if masked or greedy or topk else max(layer_ids)
    with capture_layers(model, layer_ids, stop_at) as cap:
        out = decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    feats = cap.features()
    if stop_at is not None:
        return feats, None
    final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    g, ids, logp = head_outputs(model.get_output_embeddings(), final, topk, vocab=topk_vocab,
                                greedy=greedy if masked else greedy or topk_vocab is None)
    return (feats, g) if not topk else (feats, g, ids, logp)


def pad_right(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] ids, [B, T] attention mask) right-padded (causal attention never sees the pad)."""
    width = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : s.numel()] = s
        mask[r, : s.numel()] = 1
    return ids, mask


class OnlineFeatures:
    """Documents from a frozen target, one at a time or batched (padding-safe)."""

    def __init__(self, model, target_layer_ids: Sequence[int], storage_dtype: torch.dtype | None = None):
        self.model = model
        self.layer_ids = [int(t) for t in target_layer_ids]
        check_target_layer_ids(self.layer_ids, len(decoder_layers(model)), "target_layer_ids")
        self.storage_dtype = storage_dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def document(self, input_ids, loss_mask) -> Document:
        return self.documents([(input_ids, loss_mask)])[0]

    def documents(self, rows) -> list[Document]:
        ids_list = [torch.as_tensor(ids, dtype=torch.long).flatten() for ids, _ in rows]
        masks = [torch.as_tensor(m).flatten().bool() for _, m in rows]
        if not ids_list:
            return []
        for ids, m in zip(ids_list, masks, strict=True):
            if ids.numel() == 0 or ids.numel() != m.numel():
                raise ValueError(f"document with {ids.numel()} ids and {m.numel()} mask entries")
        ids, attn = pad_right(ids_list)
        feats, greedy = target_forward(self.model, self.layer_ids, ids.to(self.device), attn.to(self.device))
        if self.storage_dtype is not None:
            feats = feats.to(self.storage_dtype)
        docs = []
        for r, (row_ids, m) in enumerate(zip(ids_list, masks, strict=True)):
            n = row_ids.numel()
            docs.append(Document(input_ids=row_ids, loss_mask=m, features=feats[r, :n].clone(),
                                 greedy_next=greedy[r, :n].cpu()))
        return docs
