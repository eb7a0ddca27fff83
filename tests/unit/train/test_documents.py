"""Memory-mode documents: features computed up front (length-sorted batches) equal the lazy ones;
which rows train, which are held out and which the periodic check reads."""

import pytest
import torch

from dflash_train.target import load_target
from dflash_train.train.documents import MEMORY_SHARE, DocumentSource, load_rows, memory_home


def test_warm_computes_every_row_once_and_matches_lazy_features(train_tiny_target, train_prepared, monkeypatch):
    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    idx = [3, 0, 7, 5, 11]
    lazy = DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64)
    warm = DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64)
    warm.warm(idx, tokens_per_batch=2 * max(warm.lengths), progress=False)  # batches of two rows
    assert sorted(warm._memory) == sorted(idx)

    def no_compute(_idx):
        raise AssertionError(f"rows {_idx} were computed again")

    monkeypatch.setattr(warm, "_compute", no_compute)
    got = warm.get(idx)
    ref = lazy.get(idx)
    for g, r, i in zip(got, ref, idx, strict=True):
        assert len(g) == len(rows[i]["input_ids"])
        torch.testing.assert_close(g.features.float(), r.features.float(), rtol=0, atol=2e-2)  # bf16 storage
        assert torch.equal(g.greedy_next, r.greedy_next)
        assert torch.equal(g.input_ids, r.input_ids)


def test_online_documents_of_unlike_lengths_take_grouped_forwards_with_one_forwards_numbers(train_tiny_target):
    """A micro-batch's documents of lengths 15 to 200, padded together, cost the target 6 x 200 positions; in
    groups of like lengths about their own 645. Each document's features, greedy tokens and top k are the
    one padded forward's, up to float rounding (right padding never reaches a real position)."""
    import datasets

    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    lengths = [200, 20, 190, 15, 60, 160]
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * n for n in lengths]})

    grouped = DocumentSource(rows, "online", model, [1, 3, 5], topk=4, target_hidden=64)
    one = DocumentSource(rows, "online", model, [1, 3, 5], topk=4, target_hidden=64)
    one.extra_call_tokens = float("inf")  # one padded forward, as before
    idx = list(range(len(lengths)))
    got, ref = grouped.get(idx), one.get(idx)
    assert one.forwards == {"forwards": 1, "positions": 6 * 200, "tokens": sum(lengths)}
    assert grouped.forwards["forwards"] > 1 and grouped.forwards["tokens"] == sum(lengths)
    assert grouped.forwards["positions"] < 1.25 * sum(lengths)
    for g, r, n in zip(got, ref, lengths, strict=True):
        assert len(g) == n
        torch.testing.assert_close(g.features, r.features, rtol=1e-4, atol=1e-5)
        assert torch.equal(g.greedy_next, r.greedy_next)
        torch.testing.assert_close(g.target_topk_logp, r.target_topk_logp, rtol=1e-4, atol=1e-5)


def test_memory_mode_stays_on_the_gpu_only_when_its_rows_fit_in_a_share_of_free_memory():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    free = 10 * 2**30
    assert memory_home(gpu, int(MEMORY_SHARE * free) - 1, free) == gpu
    assert memory_home(gpu, int(MEMORY_SHARE * free) + 1024, free) == cpu  # the steps need the rest
    assert memory_home(gpu, 1, None) == cpu  # free memory unknown
    assert memory_home(cpu, 1, free) == cpu


def test_warm_stores_owned_copies_of_the_estimated_size(train_tiny_target, train_prepared):
    """A bf16 target's features are already bf16: a row's slice of the padded batch must still be copied
    (a view kept would hold the whole batch, on a GPU too), and the store matches bytes_per_token."""
    model, _ = load_target(str(train_tiny_target), dtype=torch.bfloat16, device="cpu")
    source = DocumentSource(load_rows(train_prepared), "memory", model, [1, 3, 5], target_hidden=64)
    source.extra_call_tokens = float("inf")  # never split into groups of like lengths
    idx = list(range(6))
    assert source.warm(idx, tokens_per_batch=10_000, progress=False) == torch.device("cpu")  # one padded batch
    docs = source.get(idx)
    lengths = {len(d) for d in docs}
    assert len(lengths) > 1  # rows of several lengths: the batch was padded
    stored = 0
    for d in docs:
        for t in (d.features, d.greedy_next):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            stored += t.numel() * t.element_size()
    assert docs[0].features.dtype == torch.bfloat16
    assert stored == sum(map(len, docs)) * source.bytes_per_token()


def test_warm_is_a_no_op_outside_memory_mode(train_tiny_target, train_prepared):
    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    source = DocumentSource(load_rows(train_prepared), "online", model, [1, 3, 5], target_hidden=64)
    source.warm([0, 1], progress=False)
    assert source._memory == {}


def test_a_released_source_serves_its_warmed_rows_and_lets_the_target_go(train_tiny_target, train_prepared):
    """After `warm`, memory mode needs no target: released, the model is freed (no hold left in the source), the
    warmed rows read as before, a row never warmed is refused by name, and an online source cannot release."""
    import gc
    import weakref

    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    source = DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64)
    source.warm([0, 2, 4], progress=False)
    before = [d.features.clone() for d in source.get([0, 2, 4])]
    online = DocumentSource(rows, "online", model, [1, 3, 5], target_hidden=64)
    with pytest.raises(RuntimeError, match="online runs the target every step"):
        online.release_target()
    del online
    ref = weakref.ref(model)
    source.release_target()
    del model
    gc.collect()
    assert ref() is None
    for b, d in zip(before, source.get([0, 2, 4]), strict=True):
        assert torch.equal(b, d.features)
    with pytest.raises(RuntimeError, match=r"rows \[1\] were not computed before the target was released"):
        source.get([1])


def test_an_offline_cache_is_written_with_the_loaded_target_of_its_dtype(tmp_path, train_tiny_target, train_prepared,
                                                                      monkeypatch):
    """The trainer's target computes its missing cache (no second copy beside it), into the same cache a fresh
    load writes; a target loaded in another dtype is not used: the writer loads one in the cache's."""
    import dflash_train.target as target_module
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    loads = []
    real = target_module.load_target

    def counted(*args, **kw):
        loads.append(kw.get("dtype"))
        return real(*args, **kw)

    monkeypatch.setattr(target_module, "load_target", counted)
    model, _ = real(str(train_tiny_target), dtype=torch.float32, device="cpu")
    fp32 = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path / "with-model"))
    reused = offline_cache(fp32, str(train_tiny_target), train_prepared, [1, 3, 5], model=model)
    assert loads == []
    fresh = offline_cache(fp32.model_copy(update={"cache_dir": str(tmp_path / "loaded")}), str(train_tiny_target),
                          train_prepared, [1, 3, 5])
    assert loads == [torch.float32]
    for i in (0, 5, len(reused.lengths()) - 1):
        a, b = reused.document(i), fresh.document(i)
        assert torch.equal(a.features, b.features) and torch.equal(a.greedy_next, b.greedy_next)
    bf16 = fp32.model_copy(update={"target_dtype": "bfloat16"})
    other = offline_cache(bf16, str(train_tiny_target), train_prepared, [1, 3, 5], model=model)
    assert loads == [torch.float32, torch.bfloat16] and other.manifest["target_dtype"] == "bfloat16"


def test_fractions_of_training_rows_are_nested_and_keep_each_source_share():
    from dflash_train.train.documents import fraction_of_rows

    rows = list(range(0, 400, 2))  # 200 training rows
    labels = ["chat" if i < 300 else "code" for i in range(400)]  # 150 chat, 50 code
    quarter, half = (fraction_of_rows(rows, f, seed=0, labels=labels) for f in (0.25, 0.5))
    assert len(quarter) == 50 and len(half) == 100 and set(quarter) <= set(half) <= set(rows)
    assert sum(labels[i] == "code" for i in quarter) == 12 and sum(labels[i] == "code" for i in half) == 25
    assert fraction_of_rows(rows, 1.0, seed=0) == rows
    assert fraction_of_rows(rows, 0.5, seed=1, labels=labels) != half  # seeded


def test_a_mixture_is_prepared_per_source_and_reuses_each_source(tmp_path, train_tiny_target):
    import json

    from dflash_train.train.documents import prepared_rows
    from dflash_train.train.recipe import DataConfig

    for name, n in (("chat", 4), ("code", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{name} {i}?", "response": f"answer {i}"}) + "\n" for i in range(n)))

    def mixture(code_samples):
        return DataConfig(source=[{"source": str(tmp_path / "chat.jsonl")},
                                  {"source": str(tmp_path / "code.jsonl"), "max_samples": code_samples}],
                          max_length=64, cache_dir=str(tmp_path / "cache"))

    path = prepared_rows(mixture(3), str(train_tiny_target))
    rows = load_rows(path)
    assert rows["source"] == ["chat"] * 4 + ["code"] * 3
    chat_parts = [p for p in (tmp_path / "cache" / "sources").iterdir()
                  if load_rows(p / "prepared")["source"][0] == "chat"]
    stamp = (chat_parts[0] / "prepared" / "dataset_info.json").stat().st_mtime_ns
    other = prepared_rows(mixture(2), str(train_tiny_target))
    assert other != path and load_rows(other)["source"] == ["chat"] * 4 + ["code"] * 2
    # the chat source was prepared once: the second mixture reused it
    assert len([p for p in (tmp_path / "cache" / "sources").iterdir()]) == 3
    assert (chat_parts[0] / "prepared" / "dataset_info.json").stat().st_mtime_ns == stamp


def test_memory_mode_keeps_k_sized_topk_per_token(train_tiny_target, train_prepared):
    """kl: each document holds int32 ids and bf16 log-probs [T, k] (6 bytes per token per k, aligned
    like greedy_next), never anything vocabulary-sized; they are the target's own top-k."""
    from dflash_train.features.extract import TargetFeatures

    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    source = DocumentSource(rows, "memory", model, [1, 3, 5], topk=32, target_hidden=64)
    source.warm([0, 1, 2], progress=False)
    vocab = model.config.vocab_size
    for i in (0, 1, 2):
        d = source.get([i])[0]
        n = len(rows[i]["input_ids"])
        assert d.target_topk_ids.shape == d.target_topk_logp.shape == (n, 32)
        assert d.target_topk_ids.dtype == torch.int32 and d.target_topk_logp.dtype == torch.bfloat16
        topk_bytes = sum(t.untyped_storage().nbytes() for t in (d.target_topk_ids, d.target_topk_logp))
        assert topk_bytes == n * 32 * 6  # not a view into the padded batch, not [T, V] (x 49152 / 32)
        assert max(t.numel() for t in (d.input_ids, d.features, d.greedy_next, d.target_topk_ids)) < n * vocab / 100
        alone = TargetFeatures(model, [1, 3, 5])(d.input_ids, with_next_tokens=True, topk=32)
        agree = (alone.topk_ids[0] == d.target_topk_ids).float().mean()
        assert agree >= 0.99  # the batch of three pads rows: fp32 ties may swap
        torch.testing.assert_close(d.target_topk_logp.float(), alone.topk_logp[0], rtol=2 ** -7, atol=1e-2)
    assert DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64).get([0])[0].target_topk_ids is None


def test_offline_topk_comes_from_the_cache_and_a_larger_cache_k_is_cut(train_tiny_target, train_prepared, tmp_path):
    from dflash_train.errors import DataError
    from dflash_train.features.cache import FeatureCache, write_feature_cache

    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    out = write_feature_cache(str(train_tiny_target), train_prepared, tmp_path / "feats", target_layer_ids=[1, 3, 5],
                              model=model, topk=8)
    rows = load_rows(train_prepared)
    source = DocumentSource(rows, "offline", feature_cache=FeatureCache(out, topk=4), target_layer_ids=[1, 3, 5],
                            topk=4, target_hidden=64)
    full = FeatureCache(out).document(5)
    got = source.get([5])[0]
    assert torch.equal(got.target_topk_ids, full.target_topk_ids[:, :4])
    assert torch.equal(got.target_topk_logp, full.target_topk_logp[:, :4])
    with pytest.raises(DataError, match=rf"{out}: the feature cache holds 8 top-k.*features --topk 32"):
        FeatureCache(out, topk=32)


def test_an_interrupted_data_cache_feature_cache_is_finished_not_refused(tmp_path, train_tiny_target, train_prepared):
    import json

    from dflash_train.features.cache import MANIFEST_FILE
    from dflash_train.train.feature_source import cache_complete, offline_cache
    from dflash_train.train.recipe import DataConfig

    data = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path))
    cache = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5])
    whole = [cache.document(i).features.clone() for i in range(len(cache))]
    # as a kill leaves it: the manifest not complete, the last shard gone
    manifest = json.loads((cache.path / MANIFEST_FILE).read_text())
    last = manifest["shards"].pop()
    (cache.path / last["file"]).unlink()
    manifest["complete"] = False
    (cache.path / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert not cache_complete(cache.path)
    again = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5])
    assert cache_complete(again.path) and again.path == cache.path
    for i, features in enumerate(whole):
        torch.testing.assert_close(again.document(i).features, features, rtol=0, atol=0)


def test_a_bfloat16_target_gets_a_feature_cache_of_its_own(tmp_path, train_tiny_target, train_prepared):
    """Decision: data.target_dtype changes the features, not the rows: the prepared data's cache key stays
    the same, and the features go to a folder named for the dtype, which a float32 recipe refuses."""
    from dflash_train.errors import DataError
    from dflash_train.features.cache import FeatureCache
    from dflash_train.train.documents import data_cache_root
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    fp32 = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path))
    bf16 = fp32.model_copy(update={"target_dtype": "bfloat16"})
    assert data_cache_root(fp32, str(train_tiny_target)) == data_cache_root(bf16, str(train_tiny_target))
    a = offline_cache(fp32, str(train_tiny_target), train_prepared, [1, 3, 5])
    b = offline_cache(bf16, str(train_tiny_target), train_prepared, [1, 3, 5])
    assert b.path == a.path.with_name(a.path.name + "-bfloat16")
    assert (a.manifest["target_dtype"], b.manifest["target_dtype"]) == ("float32", "bfloat16")
    x, y = a.document(2).features.float(), b.document(2).features.float()
    rel = ((x - y).norm() / x.norm()).item()
    assert 0 < rel < 0.05  # computed in another dtype: close, not equal
    with pytest.raises(DataError, match="computed by the target in bfloat16, but data.target_dtype asks for float32"):
        FeatureCache(b.path, target_dtype="float32")
    FeatureCache(a.path, target_dtype="float32")


def test_dataset_labels_reuse_a_greedy_cache_or_write_a_lean_one(tmp_path, train_tiny_target, train_prepared):
    """Decision: a recipe with dataset labels reads a complete cache that has the greedy tokens when there
    is one; otherwise it writes a cache without them (no LM head) into a folder of its own."""
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    data = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path))
    lean = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], greedy=False)
    assert lean.path.name == "features-1-3-5-nogreedy" and lean.manifest["greedy_next"] is False
    full = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5])
    assert full.path.name == "features-1-3-5" and full.manifest["greedy_next"] is True
    assert torch.equal(lean.document(1).features, full.document(1).features)
    assert offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], greedy=False).path == full.path


def test_greedy_labels_over_a_lean_draft_vocab_cache_get_a_folder_of_their_own(tmp_path, train_tiny_target,
                                                                               train_prepared):
    """Decision: a draft-vocabulary teacher's cache written for dataset labels has no greedy tokens (its
    target forward skips the whole head); a later run with greedy labels writes one beside it instead of
    stopping on the lean one, and both hold the same features and teacher."""
    from dflash_train.features.extract import vocab_tag
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    data = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path))
    vocab = torch.arange(0, 64, 3)
    lean = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, greedy=False, topk_vocab=vocab)
    assert lean.path.name == f"features-1-3-5-top4-v{vocab_tag(vocab)}" and lean.manifest["greedy_next"] is False
    full = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, topk_vocab=vocab)
    assert full.path.name == f"{lean.path.name}-greedy" and full.manifest["greedy_next"] is True
    a, b = lean.document(1), full.document(1)
    assert torch.equal(a.features, b.features) and torch.equal(a.target_topk_ids, b.target_topk_ids)
    assert b.greedy_next is not None and b.greedy_next.shape == b.input_ids.shape
    # both now exist: each kind of label keeps reading its own
    again = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, topk_vocab=vocab)
    assert again.path == full.path
    assert offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, greedy=False,
                         topk_vocab=vocab).path == lean.path


def test_a_run_without_a_teacher_reads_a_kl_runs_cache_that_holds_its_labels(tmp_path, train_tiny_target,
                                                                             train_prepared):
    """Decision: a kl run's cache (features, greedy tokens where it wrote them, and the teacher) serves a ce run on
    the same rows and layers; the ce run writes no cache of its own, and its documents carry no teacher."""
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    data = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path))
    vocab = torch.arange(0, 64, 3)
    lean = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, greedy=False, topk_vocab=vocab)
    # dataset labels: the teacher's cache without greedy tokens is enough
    ce = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], greedy=False)
    assert ce.path == lean.path
    # greedy labels: not from the lean one, but from the greedy teacher cache once there is one
    full = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5], topk=4, topk_vocab=vocab)
    ce = offline_cache(data, str(train_tiny_target), train_prepared, [1, 3, 5])
    assert ce.path == full.path and full.path != lean.path
    assert sorted(p.name for p in lean.path.parent.glob("features-*")) == [lean.path.name, full.path.name]
    docs = DocumentSource(load_rows(train_prepared), "offline", feature_cache=ce, target_layer_ids=[1, 3, 5],
                          target_hidden=64).get([1, 2])
    assert all(d.target_topk_ids is None and d.target_topk_logp is None for d in docs)
    assert torch.equal(docs[0].features, full.document(1).features)
    assert torch.equal(docs[0].greedy_next, full.document(1).greedy_next)


def test_held_out_rows_of_a_mixture_alternate_between_sources():
    from dflash_train.train.documents import interleave_by_label

    rows = [3, 5, 8, 9, 12, 20]
    labels = ["chat", "chat", "chat", "chat", "code", "code"]
    assert interleave_by_label(rows, labels) == [3, 12, 5, 20, 8, 9]
    assert interleave_by_label([], []) == []


def test_the_periodic_check_reads_every_source_of_a_mixture():
    from dflash_train.train.documents import holdout_split, validation_rows

    # a mixture is stored source by source, so its sorted held-out ids start with the first source's
    labels = ["chitchat"] * 300 + ["sharegpt"] * 100
    _, held = holdout_split(len(labels), 0.1, seed=0)
    assert [labels[i] for i in held[:8]] == ["chitchat"] * 8
    rows = validation_rows(held, labels, 8)
    assert [labels[i] for i in rows] == ["chitchat", "sharegpt"] * 4
    assert set(rows) <= set(held) and len(set(rows)) == 8
    assert validation_rows(held, None, 8) == held[:8]  # unlabelled rows: the first ones
    assert validation_rows(held, labels, 1000) == validation_rows(held, labels, len(held))  # all of them


def test_the_check_on_training_rows_draws_each_source_in_turn_from_the_training_rows():
    from dflash_train.train.documents import fit_rows, holdout_split, validation_rows

    labels = ["chitchat"] * 300 + ["sharegpt"] * 100
    train, held = holdout_split(len(labels), 0.1, seed=0)
    rows = fit_rows(train, labels, 8, seed=0)
    assert [labels[i] for i in rows] == ["chitchat", "sharegpt"] * 4
    assert set(rows) <= set(train) and len(set(rows)) == 8
    assert not set(rows) & set(validation_rows(train, labels, 8))  # a random draw, not each source's first rows
    assert rows == fit_rows(train, labels, 8, seed=0) and rows != fit_rows(train, labels, 8, seed=1)
    assert fit_rows(train, labels, 0, seed=0) == []
    assert sorted(fit_rows(train, None, 1000, seed=0)) == train  # unlabelled: a shuffle of every row


def test_source_balance_weighs_every_source_by_as_many_rows():
    from dflash_train.train.documents import source_balance

    labels = ["chat"] * 6 + ["code"] * 2 + ["held"]
    weights = source_balance(list(range(8)), labels)
    assert weights[0] == pytest.approx(8 / (2 * 6)) and weights[7] == pytest.approx(8 / (2 * 2))
    # each source's rows add up to the same total, and the average row keeps weight 1
    assert sum(weights[i] for i in range(6)) == pytest.approx(sum(weights[i] for i in (6, 7)))
    assert sum(weights.values()) == pytest.approx(8) and 8 not in weights
    assert source_balance([0, 1], None) is None


def test_dataset_labels_with_the_prompts_positions_pick_a_cache_that_serves_them(tmp_path, train_tiny_target,
                                                                                 train_prepared):
    """Decision: dataset labels with the prompts' positions (greedy="prompts") over a draft-vocabulary teacher
    read the first complete cache that holds the argmax at the prompts' positions; where none does they write
    one, into the plain folder when it is free and `<name>-prompts` beside a lean one. Greedy labels then still
    get a cache with every argmax."""
    from dflash_train.features.extract import vocab_tag
    from dflash_train.train.feature_source import offline_cache
    from dflash_train.train.recipe import DataConfig

    vocab, layers = torch.arange(0, 64, 3), [1, 3, 5]
    plain = f"features-1-3-5-top4-v{vocab_tag(vocab)}"

    def cache(root, greedy):
        data = DataConfig(prepared=str(train_prepared), features="offline", cache_dir=str(tmp_path / root))
        return offline_cache(data, str(train_tiny_target), train_prepared, layers, topk=4, greedy=greedy,
                             topk_vocab=vocab)

    first = cache("fresh", "prompts")  # nothing yet: the plain folder, with the argmax where the prompts need it
    assert first.path.name == plain and first.manifest["greedy_next"] == "prompts"
    assert cache("fresh", False).path == first.path  # dataset labels on the answers read it too
    every = cache("fresh", True)
    assert every.path.name == f"{plain}-greedy" and every.manifest["greedy_next"] is True
    assert cache("fresh", "prompts").path == first.path

    lean = cache("lean", False)
    beside = cache("lean", "prompts")
    assert beside.path.name == f"{plain}-prompts" and lean.manifest["greedy_next"] is False
    d, e = beside.document(1), lean.document(1)
    assert torch.equal(d.features, e.features) and bool((d.greedy_next >= 0).any())
    cache("lean", True)
    assert cache("lean", "prompts").path.name == f"{plain}-greedy"  # every argmax serves them: the first that does


def test_a_forward_is_priced_by_its_launches_on_a_gpu_and_by_its_arithmetic_on_a_cpu():
    """On a GPU an 8B-class target's micro-batch of 3,072 tokens still splits (a forward's launches are worth
    less than a tenth of it); a 135M target's forward is mostly launches: a micro-batch of 8,192 like this stays whole."""
    from dflash_train.data.packing import padded_groups
    from dflash_train.train.documents import launch_tokens

    qwen3_8b, smollm2 = launch_tokens("cuda", 36, 8_190_000_000), launch_tokens("cuda", 30, 134_500_000)
    assert 100 < qwen3_8b < 3072 / 8 < 8192 < smollm2
    assert launch_tokens("cpu", 30, 134_500_000) == 0.0
    # a mixture of experts' forward launches per expert reached: on a GPU it stays one forward, on a CPU it splits
    assert launch_tokens("cuda", 48, 30_500_000_000, experts=128) == float("inf")
    assert launch_tokens("cpu", 48, 30_500_000_000, experts=128) == 0.0
    lengths = [3000, 2900, 1200, 900, 120, 40]
    assert len(padded_groups(lengths, max(sum(lengths) / 8, qwen3_8b))) > 1
    assert len(padded_groups(lengths, max(sum(lengths) / 8, smollm2))) == 1
