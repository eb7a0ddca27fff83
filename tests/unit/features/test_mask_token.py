import pytest

from dflash_train.errors import ConfigError
from dflash_train.features.mask_token import check_mask_token_id, default_mask_token_id


def test_smollm2_default_is_an_unused_special_token(smollm2):
    _, tok = smollm2
    mask = default_mask_token_id(tok, 49152)
    assert tok.added_tokens_decoder[mask].special
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       tokenize=True, return_dict=False)
    assert mask not in rendered and mask not in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
    check_mask_token_id(mask, tok, 49152)


def test_spare_row_is_preferred(smollm2):
    _, tok = smollm2
    assert default_mask_token_id(tok, 49152 + 64) == len(tok)
    check_mask_token_id(len(tok), tok, 49152 + 64)


@pytest.mark.parametrize("mask,message", [
    (100, "ordinary token the tokenizer uses for real text"),
    (2, "emitted by the chat template or is bos/eos/pad"),
    (49152, "outside the target's embedding rows"),
])
def test_bad_mask_ids_are_named(smollm2, mask, message):
    with pytest.raises(ConfigError, match=message):
        check_mask_token_id(mask, smollm2[1], 49152, field="mask_token_id")
