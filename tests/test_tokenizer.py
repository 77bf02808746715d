"""LightTokenizer, saved and loaded back, answers as the transformers tokenizer it came from.

On SmolLM2's GGUF tokenizer (byte-level BPE, the default model), the tiny test models' word-level
tokenizer, one that cleans up spaces before punctuation, and a tiny GGUF file's tokenizer.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.tokenizer import LightTokenizer, TokenizerFormatError
from tests.model.tiny import make_tiny_llama, save_tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading space",
    "trailing space ",
    "multiple   spaces\tand\ttabs\n\n\nnewlines\r\n",
    "Unicode: café, naïve, 日本語, 한국어, emoji 🤖🎉👩‍👩‍👧, math ∑∫√",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> inside <s> text </s> <unk>",
    "code: def f(x):\n    return x ** 2  # comment",
    "don't won't it's we're I'm they've , . ! ? ' s",
    "the a of to and is in it you that he was w5 w17 user assistant",
    "a" * 300,
    "Ġ weird ▁ chars \u200b zero width",
    "numbers 1234567890 3.14159 -42",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again: café 🤖"},
    ],
    [{"role": "user", "content": "no system", "name": None}],
]


def _round_trip(hf, folder: Path) -> LightTokenizer:
    LightTokenizer.from_hf(hf).save(folder)
    return LightTokenizer.load(folder, name_or_path=str(folder))


def _id_lists(hf, rng: random.Random) -> list[list[int]]:
    ids = [hf.encode(t, add_special_tokens=True) for t in TEXTS]
    special = list(hf.all_special_ids)
    ids.append(special + ids[0] + special)
    vocab = len(hf)
    ids += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    return ids


def assert_same(light: LightTokenizer, hf) -> None:
    """Every call the engine, server and benchmarks make gives the same answer."""
    assert len(light) == len(hf) and light.vocab_size == hf.vocab_size
    assert light.get_vocab() == hf.get_vocab()
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.all_special_tokens == hf.all_special_tokens
    assert light.all_special_ids == hf.all_special_ids
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(light, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(light, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert light.chat_template == hf.chat_template
    for text in TEXTS:
        for add in (True, False):
            assert light.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            ), (text, add)
    rng = random.Random(0)
    for ids in _id_lists(hf, rng):
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
        assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == (
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        )
        if ids:
            assert light.decode(ids[0]) == hf.decode(ids[0])
    tokens = list(hf.get_vocab())[:50] + ["<not a token>"]
    assert light.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    # Incremental detokenisation, as the engine streams text, both skip settings.
    for ids in _id_lists(hf, rng)[:20]:
        for skip in (True, False):
            ours = IncrementalDetokenizer(light, ids[:3], skip)
            theirs = IncrementalDetokenizer(hf, ids[:3], skip)
            for token in ids[3:]:
                assert ours.add_tokens([token]) == theirs.add_tokens([token])
    if hf.chat_template is None:
        return
    for conversation in CONVERSATIONS:
        for generation in (True, False):
            kwargs = {"add_generation_prompt": generation}
            text = light.apply_chat_template(conversation, tokenize=False, **kwargs)
            assert text == hf.apply_chat_template(conversation, tokenize=False, **kwargs)
            ids = light.apply_chat_template(conversation, return_dict=False, **kwargs)
            assert ids == hf.apply_chat_template(conversation, return_dict=False, **kwargs)
            assert light.apply_chat_template(conversation, **kwargs)["input_ids"] == ids


def test_smollm2_gguf_tokenizer(smollm2_hf_tokenizer, tmp_path: Path) -> None:
    light = _round_trip(smollm2_hf_tokenizer, tmp_path)
    assert light.chat_template is not None and light.eos_token == "<|im_end|>"
    assert_same(light, smollm2_hf_tokenizer)


def test_tiny_word_level_tokenizer(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert_same(_round_trip(hf, tmp_path / "light"), hf)


def test_bos_and_eos_added_by_the_post_processor(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf", add_bos_token=True, add_eos_token=True)
    ids = hf.encode("the a")
    assert ids[0] == hf.bos_token_id and ids[-1] == hf.eos_token_id
    assert_same(_round_trip(hf, tmp_path / "light"), hf)


def test_clean_up_tokenization_spaces(tmp_path: Path) -> None:
    words = ["<unk>", "<s>", "</s>", "hello", ",", ".", "?", "'s", "n't", "do", "it"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=True,
    )
    light = _round_trip(hf, tmp_path)
    ids = hf.encode("hello , it 's do n't .", add_special_tokens=False)
    assert light.decode(ids) == hf.decode(ids) == "hello, it's don't."
    assert_same(light, hf)


def test_tiny_gguf_tokenizer_is_cached(monkeypatch, tmp_path: Path) -> None:
    from pagedattn.model.gguf_loader import GGUFCheckpoint, _meta_cache_dir
    from tests.model.gguf_writer import write_gguf

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_gguf(make_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf", "llama")
    first = GGUFCheckpoint(gguf).tokenizer()  # converted, then saved
    saved = _meta_cache_dir(gguf) / "tokenizer.json"
    assert saved.is_file()
    mtime = saved.stat().st_mtime_ns
    second = GGUFCheckpoint(gguf).tokenizer()  # read back
    assert saved.stat().st_mtime_ns == mtime
    assert second.name_or_path == first.name_or_path == str(gguf)
    assert_same(second, GGUFCheckpoint(gguf).hf_tokenizer())


def test_deep_copy_is_independent_and_equal(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path / "hf")
    light = _round_trip(AutoTokenizer.from_pretrained(tmp_path / "hf"), tmp_path / "light")
    clone = copy.deepcopy(light)
    assert clone.backend_tokenizer is not light.backend_tokenizer
    assert clone.encode("the a w3") == light.encode("the a w3")
    assert clone.chat_template == light.chat_template


def test_damaged_or_foreign_files_raise(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFormatError):
        LightTokenizer.load(tmp_path)  # nothing there
    save_tiny_tokenizer(tmp_path / "hf")
    LightTokenizer.from_hf(AutoTokenizer.from_pretrained(tmp_path / "hf")).save(tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFormatError):
        LightTokenizer.load(tmp_path / "t")
