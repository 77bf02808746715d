"""xgrammar sees a LightTokenizer as it sees the transformers tokenizer it came from."""

from __future__ import annotations

import pytest

from pagedattn.structured_output.compiler import tokenizer_info
from pagedattn.tokenizer import LightTokenizer

xgr = pytest.importorskip("xgrammar")


def _fields(info) -> dict:
    return {
        "vocab_type": info.vocab_type,
        "vocab_size": info.vocab_size,
        "add_prefix_space": info.add_prefix_space,
        "stop_token_ids": list(info.stop_token_ids),
        "special_token_ids": list(info.special_token_ids),
        "decoded_vocab": list(info.decoded_vocab),
        "metadata": info.dump_metadata(),
    }


@pytest.mark.parametrize("vocab_size", [None, 49_280])  # the tokenizer's size, a padded lm_head
def test_smollm2_tokenizer_info(smollm2_hf_tokenizer, vocab_size) -> None:
    hf = smollm2_hf_tokenizer
    vocab_size = vocab_size or len(hf)
    light = LightTokenizer.from_hf(hf)
    ours = _fields(tokenizer_info(light, vocab_size))
    theirs = _fields(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))
    assert ours["vocab_type"] == xgr.VocabType.BYTE_LEVEL
    assert ours == theirs


def test_grammar_masks_agree(smollm2_hf_tokenizer) -> None:
    hf = smollm2_hf_tokenizer
    light = LightTokenizer.from_hf(hf)
    schema = '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}'
    masks = []
    for info in (tokenizer_info(light, len(hf)), xgr.TokenizerInfo.from_huggingface(hf)):
        grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(schema)
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        rows = []
        for token in hf.encode('{"a": "'):
            matcher.fill_next_token_bitmask(bitmask)
            rows.append(bitmask.clone())
            assert matcher.accept_token(token)
        masks.append(rows)
    assert all((a == b).all() for a, b in zip(*masks, strict=True))
