"""eval/target_cache.py: after a verify forward, every cache kind holds exactly the kept tokens."""

import pytest
import torch

from dflash_train.eval.target_cache import TargetCache
from dflash_train.target import cache_arg

# key/value only, sliding window (+ sinks), hybrid linear attention (dense and MoE), MLA
KINDS = ["qwen3", "gemma3_text", "gpt_oss", "qwen3_5_text", "qwen3_next", "deepseek_v3"]


@pytest.mark.parametrize("model_type", KINDS)
def test_keep_equals_feeding_only_the_kept_tokens(model_type, tiny_target, one_thread):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target(model_type)), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 4000, (1, 20), generator=g)  # longer than the sliding windows (8)
    block = torch.randint(5, 4000, (1, 5), generator=g)
    nxt = torch.randint(5, 4000, (1, 2), generator=g)
    with torch.no_grad():
        for kept in (1, 3, 5):
            cache = TargetCache(model)
            model(input_ids=prompt, **cache_arg(model, cache.cache), use_cache=True)
            for _ in range(2):  # two rounds: a restored cache must verify and roll back again
                cache.before_verify()
                model(input_ids=block, **cache_arg(model, cache.cache), use_cache=True)
                cache.keep(model, block, kept)
            assert cache.length() == prompt.shape[1] + 2 * kept
            got = model(input_ids=nxt, **cache_arg(model, cache.cache), use_cache=True).logits

            ref_cache = DynamicCache(config=model.config)
            fed = torch.cat([prompt, block[:, :kept], block[:, :kept]], dim=1)
            model(input_ids=fed, **cache_arg(model, ref_cache), use_cache=True)
            want = model(input_ids=nxt, **cache_arg(model, ref_cache), use_cache=True).logits
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_key_value_caches_take_the_crop_path(tiny_target):
    from transformers import AutoModelForCausalLM

    kv = TargetCache(AutoModelForCausalLM.from_pretrained(str(tiny_target("qwen3"))))
    kv.before_verify()
    assert kv.recurrent == [] and kv._snapshot is None  # nothing copied per step
    hybrid = TargetCache(AutoModelForCausalLM.from_pretrained(str(tiny_target("qwen3_5_text"))))
    assert hybrid.recurrent == [0, 2]  # the linear-attention layers


def test_keep_without_snapshot_is_a_bug_not_a_silent_mistake(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target("qwen3_5_text"))).eval()
    cache = TargetCache(model)
    ids = torch.arange(5, 15)[None]
    with torch.no_grad():
        model(input_ids=ids, **cache_arg(model, cache.cache), use_cache=True)
        model(input_ids=ids[:, :4], **cache_arg(model, cache.cache), use_cache=True)
        with pytest.raises(RuntimeError, match="before_verify"):
            cache.keep(model, ids[:, :4], 2)
