"""Teacher-forced block acceptance on the very sequences speculative decoding produced.

Training reports a block acceptance length (train.loss: 1 + the leading slots predicted right)
averaged over anchors spread across each answer; serving reports committed tokens per step.
To tell a train/serve mismatch from a difference in *where* the two measure, each decoded
sequence (prompt + generated tokens) is put through the training path itself:

- features and greedy labels from one full target forward (`TargetFeatures`, as the trainer's
  memory mode computes them), the loss mask over the generated tokens;
- blocks laid out, labelled and run by `build_microbatch` + `microbatch_predictions` (the
  training forward, split attention), anchored
  (a) `all`: at every generated position with a successor (training's anchor candidates), and
  (b) `at_decode_steps`: exactly where the decode steps began (`Step.position`).

Under greedy decoding (b) must reproduce each step's accepted count: the block, its context
(positions < p), its positions and its labels (the target's greedy tokens, i.e. the tokens
decoding committed) are the same, so any step that differs is a train/serve mismatch.
`step_agreement` is the fraction of steps that agree exactly. Blocks are compared by
1 + accepted drafts (`served`), which differs from tau only in steps cut at EOS or the token
limit (tau counts what such a step kept; a block counts its labelled slots).

`at_decode_steps_bf16_features`: the same blocks with the features rounded to bfloat16, the way the trainer
stores them (memory mode and the offline cache), so a drafter that depends on that rounding shows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_train.data.packing import Document
from dflash_train.features.extract import TargetFeatures
from dflash_train.train.batches import build_microbatch, microbatch_predictions
from dflash_train.train.loss import accept_lengths, slot_correct

AGREEMENT_FOR_SELECTION = 0.99  # below this, too many steps differ for the gap to be selection alone


def decoded_document(extract: TargetFeatures, prompt_ids: Sequence[int], new_tokens: Sequence[int]) -> Document:
    """Prompt + generated tokens as a training document: one full target forward for the
    features and the greedy labels; the loss mask covers the generated tokens."""
    ids = torch.tensor([*prompt_ids, *new_tokens], dtype=torch.long)
    device = next(extract.model.parameters()).device
    out = extract(ids[None].to(device), with_next_tokens=True)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[len(prompt_ids):] = True
    return Document(input_ids=ids, loss_mask=mask, features=out.features[0], greedy_next=out.next_tokens[0].cpu())


@torch.no_grad()
def block_accept_lengths(draft, doc: Document, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N] acceptance lengths of blocks at `anchors` (in-document positions), training forward."""
    if anchors.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    mb = build_microbatch([doc], [0], block_size=block_size, anchors_per_document=0, labels="greedy", seed=0,
                          epoch=0, anchors=[anchors])
    _, preds = microbatch_predictions(draft, mb)
    return accept_lengths(slot_correct(mb.labels, preds.cpu()))


def _mean(lengths: torch.Tensor) -> float | None:
    return float(lengths.double().mean()) if lengths.numel() else None


def _rates(lengths: torch.Tensor, block_size: int) -> list[float | None]:
    """Per-slot acceptance rates: slot k (1..B-1) accepted means a length > k."""
    return [float((lengths > k).double().mean()) if lengths.numel() else None for k in range(1, block_size)]


def teacher_forced_report(draft, target_model, prompts: Sequence[Sequence[int]], generations, block_size: int,
                          max_disagreements: int = 20) -> dict:
    """The teacher-forced diagnosis of a greedy run: `prompts` token ids and their `Generation`s.

    Acceptance lengths: `all`, `at_decode_steps`, `served` (1 + accepted drafts of the same steps)
    and `at_decode_steps_bf16_features`; `per_position` rates and `blocks` counts for the first
    three; `step_agreement`, up to `max_disagreements` differing steps, and the `verdict`.
    `greedy_mismatch`: per prompt, the first generated token that is not the target's argmax after
    its prefix in the same full forward (None: the output is the target's greedy decoding).
    """
    extract = TargetFeatures(target_model, draft.config.target_layer_ids)
    everywhere, at_steps, at_steps_bf16, served = [], [], [], []
    disagreements, agree, greedy_mismatch = [], 0, []
    for i, (prompt, gen) in enumerate(zip(prompts, generations, strict=True)):
        doc = decoded_document(extract, prompt, gen.tokens)
        argmax = doc.greedy_next[len(prompt) - 1: len(prompt) - 1 + len(gen.tokens)]
        wrong = torch.nonzero(argmax != torch.tensor(gen.tokens, dtype=torch.long)).flatten()
        greedy_mismatch.append(int(wrong[0]) if wrong.numel() else None)
        candidates = torch.nonzero(doc.loss_mask[:-1] & doc.loss_mask[1:]).flatten()
        positions = torch.tensor([s.position for s in gen.steps], dtype=torch.long)
        everywhere.append(block_accept_lengths(draft, doc, candidates, block_size))
        at = block_accept_lengths(draft, doc, positions, block_size)
        at_steps.append(at)
        rounded = Document(doc.input_ids, doc.loss_mask, doc.features.to(torch.bfloat16), doc.greedy_next)
        at_steps_bf16.append(block_accept_lengths(draft, rounded, positions, block_size))
        for step, length in zip(gen.steps, at.tolist(), strict=True):
            served.append(1 + step.accepted)
            if length == 1 + step.accepted:
                agree += 1
            elif len(disagreements) < max_disagreements:
                disagreements.append({"prompt": i, "position": step.position, "served_accepted": step.accepted,
                                      "teacher_forced_accepted": length - 1})
    lengths = {"all": torch.cat(everywhere), "at_decode_steps": torch.cat(at_steps),
               "served": torch.tensor(served, dtype=torch.long)}
    steps = len(served)
    report = {name: _mean(x) for name, x in lengths.items()}
    report.update(
        at_decode_steps_bf16_features=_mean(torch.cat(at_steps_bf16)),
        per_position={name: _rates(x, block_size) for name, x in lengths.items()},
        blocks={name: int(x.numel()) for name, x in lengths.items()},
        step_agreement=agree / steps if steps else None,
        steps=steps,
        disagreements=disagreements,
        greedy_mismatch=greedy_mismatch,
    )
    report["verdict"] = verdict(report)
    return report


def verdict(tf: dict) -> str:
    """`selection` when the training forward reproduces the served steps, else `mismatch`."""
    agreement = tf.get("step_agreement")
    return "selection" if agreement is not None and agreement >= AGREEMENT_FOR_SELECTION else "mismatch"


def headline(tf: dict | None) -> dict | None:
    """The scalar part of a diagnosis (acceptance lengths, agreement, verdict) for summaries."""
    if not tf:
        return None
    keys = ("all", "at_decode_steps", "served", "at_decode_steps_bf16_features", "step_agreement", "steps", "verdict")
    return {k: tf[k] for k in keys}
