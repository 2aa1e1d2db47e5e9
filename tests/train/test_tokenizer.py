"""Tokenizer specs for plait train: a tokenizer.json the tokenizers library wrote, a
directory AutoTokenizer loads from local files, train:bpe:VOCAB trained here; the
end-of-text token, the identity the token cache is keyed by, and the refusals."""

import json
import socket
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from plait.train.tokenizer import (END_OF_TEXT, Tokenizer, load_tokenizer, parse_tokenizer_spec, train_bpe)

TEXTS = ["def add(a, b):\n    return a + b\n", "Größe und Maß — 日本語のテキスト 🙂\n", "print(add(2, 3))  # 5\n" * 5]


def word_level_json(path: Path, *specials: str) -> Path:
    """A whitespace word-level tokenizer.json written by the tokenizers library itself."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(specials))
    backend.save(str(path))
    return path


def test_train_bpe_is_byte_level_lossless_deterministic_and_saved(tmp_path):
    tokenizer = train_bpe(TEXTS, 300)
    assert tokenizer.eos_token == END_OF_TEXT and tokenizer.eos_id == 0
    # 256 bytes + <|endoftext|> + merges, never more than asked.
    assert 257 < tokenizer.vocab_size <= 300
    for text in [*TEXTS, "unseen ✓ ǅ \x00 text"]:   # byte-level: any text round-trips, seen or not
        ids = tokenizer.encode(text)
        assert 0 not in ids   # no special token is added by encode
        assert tokenizer.decode(ids) == text
    assert tokenizer.decode([*tokenizer.encode("a"), tokenizer.eos_id]) == "a" + END_OF_TEXT
    # the same text trains the same tokenizer (identity = sha256 of its JSON + eos)
    again = train_bpe(TEXTS, 300)
    assert again.json == tokenizer.json and again.identity == tokenizer.identity
    assert train_bpe(TEXTS, 280).identity != tokenizer.identity
    # saved as tokenizer.json it reloads as a file spec with the same identity and ids
    path = tokenizer.save(tmp_path / "out" / "tokenizer.json")
    reloaded = load_tokenizer(str(path))
    assert reloaded.identity == tokenizer.identity and reloaded.eos_id == 0
    assert reloaded.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])
    # encode_batch counts the texts it encodes (what shows a cached load tokenized nothing)
    counted = Tokenizer(reloaded.backend, eos_token=END_OF_TEXT, source="test")
    counted.encode_batch(TEXTS)
    counted.encode("x")
    assert counted.encoded_texts == len(TEXTS) + 1


def test_tokenizer_json_from_the_tokenizers_library(tmp_path):
    path = word_level_json(tmp_path / "tokenizer.json", "</s>")
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_id == 4 and tokenizer.vocab_size == 5
    assert tokenizer.encode("hello world again nope") == [1, 2, 3, 0]
    assert parse_tokenizer_spec(str(path)).kind == "file"
    # identity follows the JSON: another special token, another identity
    other = load_tokenizer(str(word_level_json(tmp_path / "other.json", END_OF_TEXT)))
    assert other.eos_token == END_OF_TEXT and other.identity != tokenizer.identity
    # several candidates: GPT-2's <|endoftext|> first (EOS_CANDIDATES' order)
    both = load_tokenizer(str(word_level_json(tmp_path / "both.json", "</s>", END_OF_TEXT)))
    assert both.eos_token == END_OF_TEXT and both.eos_id == 5


def test_autotokenizer_directory_local_files_and_save_pretrained(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = BackendTokenizer.from_file(str(word_level_json(tmp_path / "w.json")))
    # a directory written by transformers itself, eos named only in its tokenizer_config.json
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        tmp_path / "hf")
    assert parse_tokenizer_spec(str(tmp_path / "hf")).kind == "pretrained"
    refuse = pytest.MonkeyPatch()   # local files only: any connection attempt fails the test
    refuse.setattr(socket.socket, "connect", lambda *args: pytest.fail(f"network access {args[1:]}"))
    try:
        tokenizer = load_tokenizer(str(tmp_path / "hf"))
    finally:
        refuse.undo()
    assert tokenizer.eos_token == "<eos>" and tokenizer.eos_id == 4
    assert tokenizer.encode("hello again") == [1, 3]
    # save_pretrained writes what AutoTokenizer loads, with the same ids and eos
    bpe = train_bpe(TEXTS, 300)
    bpe.save_pretrained(tmp_path / "export")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    assert loaded.eos_token == END_OF_TEXT and loaded.eos_token_id == 0
    assert loaded(TEXTS[1], add_special_tokens=False)["input_ids"] == bpe.encode(TEXTS[1])
    assert load_tokenizer(str(tmp_path / "export")).encode(TEXTS[0]) == bpe.encode(TEXTS[0])
    # a directory with no tokenizer in it is refused by name
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty'.*AutoTokenizer cannot load it from local files"):
        load_tokenizer(str(tmp_path / "empty"))


@pytest.mark.parametrize("spec, message", [
    ("", r"--tokenizer '' is empty; pass a tokenizer.json"),
    ("train:bpe:abc", r"'train:bpe:abc' is not train:bpe:VOCAB .*e\.g\. train:bpe:8192"),
    ("train:wordpiece:1000", r"'train:wordpiece:1000' is not train:bpe:VOCAB"),
    ("train:bpe:100", r"'train:bpe:100': a byte-level BPE needs at least 257 tokens"),
    ("no/such/tokenizer.json", r"'no/such/tokenizer.json': no such file or directory; pass a tokenizer.json"),
])
def test_bad_specs_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tokenizer_spec(spec)


def test_bad_files_are_refused_by_name(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match=r"bad.json' is not a tokenizer.json the tokenizers library reads"):
        load_tokenizer(str(tmp_path / "bad.json"))
    no_eos = word_level_json(tmp_path / "no_eos.json", "[PAD]")
    with pytest.raises(ValueError, match=r"no_eos.json has no end-of-text special token .*add one"):
        load_tokenizer(str(no_eos))
    with pytest.raises(ValueError, match=r"'train:bpe:512' is trained on the data; call .*load_text_data"):
        load_tokenizer("train:bpe:512")
    with pytest.raises(ValueError, match=r"vocab_size 64: a byte-level BPE needs at least 257"):
        train_bpe(TEXTS, 64)
