import pytest
import torch

from dflash_train.errors import ConfigError
from dflash_train.features.extract import TargetFeatures
from dflash_train.features.layer_ids import default_target_layer_ids


@pytest.fixture(scope="module")
def ids():
    return torch.randint(20, 49000, (2, 24), generator=torch.Generator().manual_seed(0))


def test_features_are_hidden_states_t_plus_one(smollm2, ids):
    model, _ = smollm2
    layer_ids = default_target_layer_ids(30, 5)
    out = TargetFeatures(model, layer_ids)(ids, with_next_tokens=True)
    ref = model(ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[t + 1] for t in layer_ids], dim=-1)
    assert out.features.shape == (2, 24, 5 * 576)
    torch.testing.assert_close(out.features, expected, rtol=0, atol=1e-5)
    assert torch.equal(out.next_tokens, ref.logits.argmax(-1))


def test_feature_only_run_stops_early_and_agrees(smollm2, ids):
    model, _ = smollm2
    calls = []
    handle = model.model.layers[29].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        extractor = TargetFeatures(model, [1, 8, 14])
        short = extractor(ids)
        assert calls == []  # layer 29 never ran
        full = extractor(ids, with_next_tokens=True)
        assert calls == [1]
    finally:
        handle.remove()
    assert short.next_tokens is None
    torch.testing.assert_close(short.features, full.features, rtol=0, atol=1e-5)


def test_last_layer_is_its_output_before_the_final_norm_as_vllm_serves_it(smollm2, ids):
    model, _ = smollm2
    out = TargetFeatures(model, [29])(ids)
    ref = model(ids, output_hidden_states=True).hidden_states[30]  # HF: after the final norm
    pre_norm = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    try:
        model(ids)
    finally:
        handle.remove()
    torch.testing.assert_close(out.features, pre_norm[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(model.model.norm(out.features), ref, rtol=0, atol=1e-5)


def test_layer_id_beyond_target_is_rejected(smollm2):
    with pytest.raises(ConfigError, match="layer id 30 is outside"):
        TargetFeatures(smollm2[0], [1, 30])


def test_topk_log_probs_come_from_the_same_forward_as_the_features(smollm2, ids):
    model, _ = smollm2
    layer_ids = [2, 9, 15]
    out = TargetFeatures(model, layer_ids)(ids, with_next_tokens=True, topk=8)
    ref = model(ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[t + 1] for t in layer_ids], dim=-1)
    torch.testing.assert_close(out.features, expected, rtol=0, atol=1e-5)
    ref_logp, ref_ids = torch.log_softmax(ref.logits.float(), -1).topk(8, dim=-1)
    assert out.topk_ids.shape == (2, 24, 8) and out.topk_ids.dtype == torch.int32
    assert torch.equal(out.topk_ids, ref_ids.int())
    torch.testing.assert_close(out.topk_logp, ref_logp, rtol=0, atol=1e-4)
    assert torch.equal(out.next_tokens, ref.logits.argmax(-1))
    assert bool((out.topk_logp[..., :-1] >= out.topk_logp[..., 1:]).all())  # largest first


def test_head_outputs_never_hold_more_than_a_chunk_of_logits(smollm2, ids):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from dflash_train.features.extract import head_outputs

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # logits-like results (the head's transposed/expanded views [.., H, V] are not allocations)
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() > 1
                     and t.shape[-2] != 576]
            Largest.biggest = max([Largest.biggest, *sizes])
            return out

    model, _ = smollm2
    final = torch.randn(2, 24, 576)
    head = model.get_output_embeddings()
    with Largest():
        greedy, top_ids, top_logp = head_outputs(head, final, topk=4, chunk=5)
    vocab = head.weight.shape[0]
    assert Largest.biggest == 5 * vocab  # one chunk of 5 positions' logits, never [2, 24, V]
    logits = head(final)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(top_ids.long(), torch.log_softmax(logits, -1).topk(4, dim=-1).indices)


@pytest.mark.slow
def test_greedy_labels_come_chunk_by_chunk_and_equal_the_full_argmax(smollm2):
    """with_next_tokens (the online and memory feature modes): the greedy next tokens equal the argmax
    of the full forward's logits, and no tensor as large as the [B, T, V] logits is ever made: the head
    runs over 256 positions at a time (here 2 x 140 positions)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    model, _ = smollm2
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(20, 49000, (2, 140), generator=torch.Generator().manual_seed(1))

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # logits-like results (the head's transposed view [H, V] is not an allocation)
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() > 1
                     and t.shape[-1] == vocab and t.shape[-2] != 576]
            Largest.biggest = max([Largest.biggest, *sizes])
            return out

    with Largest():
        out = TargetFeatures(model, [2, 9, 28])(ids, with_next_tokens=True)  # not the last: pre-norm there
    assert Largest.biggest == 256 * vocab  # one chunk of logits, not 280 positions' worth
    ref = model(ids, output_hidden_states=True)
    assert torch.equal(out.next_tokens, ref.logits.argmax(-1))
    torch.testing.assert_close(out.features, torch.cat([ref.hidden_states[t + 1] for t in [2, 9, 28]], -1),
                               rtol=0, atol=1e-5)


def test_head_outputs_over_a_vocabulary_are_the_top_k_of_those_ids_normalised_over_them(smollm2):
    """`vocab` (a drafter's reduced vocabulary): the top k of the head's logits at those ids only, as target
    ids, with log-probabilities normalised over those ids; greedy=False returns no argmax, and a top-k over
    the whole head without the argmax is refused (it gives the argmax for free)."""
    from dflash_train.features.extract import head_outputs, vocab_tag

    model, _ = smollm2
    head = model.get_output_embeddings()
    final = torch.randn(2, 9, 576)
    vocab = torch.sort(torch.randperm(head.weight.shape[0], generator=torch.Generator().manual_seed(0))[:300]).values
    greedy, ids, logp = head_outputs(head, final, topk=5, chunk=4, vocab=vocab, greedy=False)
    assert greedy is None and ids.shape == (2, 9, 5) and ids.dtype == torch.int32
    ref = torch.log_softmax(head(final)[..., vocab], -1)
    want_logp, want_index = ref.topk(5, dim=-1)
    assert torch.equal(ids.long(), vocab[want_index])
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    assert bool(torch.isin(ids.long(), vocab).all()) and float(logp[..., 0].max()) < 0
    full_greedy, _, _ = head_outputs(head, final, topk=5, chunk=4, vocab=vocab)
    assert torch.equal(full_greedy, head(final).argmax(-1))  # greedy=True still takes the whole head's argmax
    with pytest.raises(ValueError, match="greedy=False needs a vocab"):
        head_outputs(head, final, topk=5, greedy=False)
    assert vocab_tag(vocab) == vocab_tag(vocab.clone()) != vocab_tag(vocab[1:])
    assert vocab_tag(vocab).startswith("300-")


def test_head_outputs_take_the_argmax_only_where_asked(smollm2):
    """`greedy` a [B, T] mask (dataset labels with the prompts' positions): the whole head's argmax at those
    positions, -1 at the others, and the draft-vocabulary top k at every position as without the mask. Under a top k
    over the whole head every argmax is computed anyway, so every position gets one."""
    from dflash_train.features.extract import head_outputs

    model, _ = smollm2
    head = model.get_output_embeddings()
    final = torch.randn(2, 9, 576, generator=torch.Generator().manual_seed(1))
    vocab = torch.arange(0, 49152, 7)
    where = torch.rand(2, 9, generator=torch.Generator().manual_seed(2)) < 0.4
    where[0, 0], where[1, -1] = True, False
    greedy, ids, logp = head_outputs(head, final, topk=5, chunk=3, vocab=vocab, greedy=where)
    full = head(final).argmax(-1)
    assert torch.equal(greedy[where], full[where]) and bool((greedy[~where] == -1).all())
    _, ids_all, logp_all = head_outputs(head, final, topk=5, chunk=3, vocab=vocab, greedy=False)
    assert torch.equal(ids, ids_all) and torch.equal(logp, logp_all)
    only, none_k, _ = head_outputs(head, final, chunk=3, greedy=where)  # no top k: the argmax alone, where asked
    assert none_k is None and torch.equal(only, greedy)
    whole, _, _ = head_outputs(head, final, topk=5, chunk=3, greedy=where)
    assert torch.equal(whole, full)
