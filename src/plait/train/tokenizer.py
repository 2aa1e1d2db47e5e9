"""Tokenizers for ``plait train --tokenizer SPEC``: a ``tokenizer.json`` of the
``tokenizers`` library, a directory ``transformers.AutoTokenizer`` loads from local
files, or ``train:bpe:VOCAB``, a byte-level BPE of VOCAB tokens trained here on the
training text (nothing downloaded).

Every kind ends as one ``tokenizers.Tokenizer`` (a fast tokenizer's backend) plus the
end-of-text token that separates packed documents. Its identity is the sha256 of its
serialized JSON and that token: what the token cache is keyed by, so a changed
tokenizer never reuses another's tokens. Text is encoded without special tokens (no
BOS/EOS added by a post-processor); the packer (plait.train.text_data) puts exactly
one end-of-text id after each document.

End-of-text token: a directory's ``eos_token`` (tokenizer_config.json); for a bare
tokenizer.json the first of ``EOS_CANDIDATES`` among its special added tokens; for a
trained BPE ``<|endoftext|>`` (id 0). None found: refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from plait.train.atomic_files import atomic_write

TRAIN_BPE_PREFIX = "train:bpe:"
END_OF_TEXT = "<|endoftext|>"
# The end-of-text tokens of GPT-2/-NeoX, Llama 1-2/T5/Mistral, Llama 3, Gemma, in that order.
EOS_CANDIDATES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>")
BYTE_ALPHABET_SIZE = 256
MIN_BPE_VOCAB = BYTE_ALPHABET_SIZE + 1   # every byte, plus <|endoftext|>
# Bump when the trained BPE's recipe (pre-tokenizer, trainer options) changes: part of its cache key.
BPE_RECIPE = "plait-byte-bpe-1"
SPEC_HELP = ("pass a tokenizer.json file, a directory holding a tokenizer AutoTokenizer loads "
             "(tokenizer.json + tokenizer_config.json), or train:bpe:VOCAB (e.g. train:bpe:8192)")


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """A parsed ``--tokenizer`` value: kind "file", "pretrained" (a directory) or "train_bpe"."""

    text: str
    kind: str
    path: Path | None = None
    vocab_size: int | None = None


def parse_tokenizer_spec(spec: str) -> TokenizerSpec:
    """The kind of ``spec``: train:bpe:VOCAB, an existing file, or an existing directory.
    Reads nothing but the file system's entries; a bad spec raises a one-line ValueError."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--tokenizer {spec!r} is empty; {SPEC_HELP}")
    if spec.startswith("train:"):
        vocab_text = spec[len(TRAIN_BPE_PREFIX):] if spec.startswith(TRAIN_BPE_PREFIX) else ""
        if not spec.startswith(TRAIN_BPE_PREFIX) or not vocab_text.isdigit():
            raise ValueError(f"--tokenizer {spec!r} is not train:bpe:VOCAB with VOCAB a whole number of tokens; "
                             f"e.g. train:bpe:8192")
        vocab_size = int(vocab_text)
        if vocab_size < MIN_BPE_VOCAB:
            raise ValueError(f"--tokenizer {spec!r}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens "
                             f"({BYTE_ALPHABET_SIZE} bytes + {END_OF_TEXT}); use e.g. train:bpe:8192")
        return TokenizerSpec(text=spec, kind="train_bpe", vocab_size=vocab_size)
    path = Path(spec).expanduser()
    if path.is_dir():
        return TokenizerSpec(text=spec, kind="pretrained", path=path)
    if path.is_file():
        return TokenizerSpec(text=spec, kind="file", path=path)
    raise ValueError(f"--tokenizer {spec!r}: no such file or directory; {SPEC_HELP}")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its end-of-text token, its identity and a count of
    the texts it has encoded (``encoded_texts``: what shows that a cached load tokenized
    nothing)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token: str, source: str):
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer {source}: its end-of-text token {eos_token!r} is not in its vocabulary; "
                             f"add it (tokenizer.add_special_tokens([{eos_token!r}])) and save it again")
        self.backend, self.eos_token, self.eos_id, self.source = backend, eos_token, eos_id, source
        self.encoded_texts = 0

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source}, vocab_size={self.vocab_size}, eos={self.eos_token!r} "
                f"(id {self.eos_id}), identity={self.identity[:12]})")

    @property
    def vocab_size(self) -> int:
        """Ids 0..vocab_size-1, added (special) tokens included: the model's vocabulary."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def json(self) -> str:
        """The tokenizer's serialized JSON (what tokenizer.json holds)."""
        return self.backend.to_str()

    @cached_property
    def identity(self) -> str:
        """sha256 hex of the serialized JSON and the end-of-text token."""
        hasher = hashlib.sha256(self.json.encode("utf-8"))
        hasher.update(b"\0eos\0" + self.eos_token.encode("utf-8"))
        return hasher.hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, no special tokens added (BOS/EOS are the packer's)."""
        texts = list(texts)
        self.encoded_texts += len(texts)
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Ids of one text, no special tokens added."""
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens (the end-of-text separator) written out."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json to ``path`` atomically (what ``--tokenizer PATH`` reloads,
        with this end-of-text token among its special tokens); returns the path."""
        path = Path(path)
        data = self.json.encode("utf-8")
        atomic_write(path, lambda temp_name: Path(temp_name).write_bytes(data), len(data))
        return path

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json and tokenizer_config.json into ``directory`` (atomically,
        each), so ``transformers.AutoTokenizer.from_pretrained(directory)`` loads this
        tokenizer (as a PreTrainedTokenizerFast) with its end-of-text token as eos_token.
        For the Hugging Face export; returns the directory."""
        directory = Path(directory)
        self.save(directory / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
                  "bos_token": self.eos_token, "unk_token": None, "model_max_length": int(1e30),
                  "clean_up_tokenization_spaces": False}
        data = (json.dumps(config, indent=2) + "\n").encode("utf-8")
        atomic_write(directory / "tokenizer_config.json", lambda temp_name: Path(temp_name).write_bytes(data),
                     len(data))
        return directory


def _eos_of_file(backend: tokenizers.Tokenizer, path: Path) -> str:
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    for candidate in EOS_CANDIDATES:
        if candidate in special:
            return candidate
    raise ValueError(f"tokenizer {path} has no end-of-text special token (looked for {', '.join(EOS_CANDIDATES)}) "
                     f"to separate documents; add one (tokenizer.add_special_tokens(['{END_OF_TEXT}'])) and save "
                     f"it, or pass a directory whose tokenizer_config.json names its eos_token")


def _load_file(path: Path) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 -- the library raises a bare Exception for any bad JSON
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"--tokenizer {str(path)!r} is not a tokenizer.json the tokenizers library reads "
                         f"({first_line}); {SPEC_HELP}") from None
    return Tokenizer(backend, eos_token=_eos_of_file(backend, path), source=f"file {path}")


def _load_pretrained(directory: Path) -> Tokenizer:
    # transformers is the optional extra `hf` and takes ~3 s to import: only for a directory.
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"--tokenizer {str(directory)!r} is a directory, read with transformers.AutoTokenizer, "
                         f"which is not installed; pip install 'plait[hf]' or pass its tokenizer.json") from None
    try:
        loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"--tokenizer {str(directory)!r}: AutoTokenizer cannot load it from local files "
                         f"({first_line}); {SPEC_HELP}") from None
    if not getattr(loaded, "is_fast", False):
        raise ValueError(f"--tokenizer {str(directory)!r} holds a slow (Python) tokenizer only; save a fast one "
                         f"into it (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(dir)) or "
                         f"pass a tokenizer.json")
    if not loaded.eos_token:
        raise ValueError(f"--tokenizer {str(directory)!r} names no eos_token to separate documents; set "
                         f"\"eos_token\" in its tokenizer_config.json (e.g. \"{END_OF_TEXT}\")")
    return Tokenizer(loaded.backend_tokenizer, eos_token=str(loaded.eos_token), source=f"directory {directory}")


def load_tokenizer(spec: str | TokenizerSpec) -> Tokenizer:
    """The tokenizer of a file or directory spec (see parse_tokenizer_spec). A
    train:bpe:VOCAB spec needs the text: plait.train.text_data.load_text_data trains
    it (and caches it), or train_bpe."""
    parsed = spec if isinstance(spec, TokenizerSpec) else parse_tokenizer_spec(spec)
    if parsed.kind == "train_bpe":
        raise ValueError(f"--tokenizer {parsed.text!r} is trained on the data; call "
                         f"plait.train.text_data.load_text_data(data, tokenizer=spec, ...) or train_bpe(texts, vocab_size)")
    return _load_file(parsed.path) if parsed.kind == "file" else _load_pretrained(parsed.path)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder, no prefix space) of at most
    ``vocab_size`` tokens trained on ``texts``: id 0 is <|endoftext|>, ids 1..256 the
    bytes, then merges by frequency. A small text may stop before vocab_size (no pair
    left to merge): the tokenizer's vocab_size says how many it has. The same texts
    train the same tokenizer (tests/train/test_tokenizer.py); runs stay reproducible
    anyway by saving it (Tokenizer.save; load_text_data caches it)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size {vocab_size!r}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens "
                         f"({BYTE_ALPHABET_SIZE} bytes + {END_OF_TEXT}); use e.g. 8192")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, eos_token=END_OF_TEXT, source=f"byte-level BPE of {vocab_size} tokens trained on the data")


def load_trained_bpe(path: Path, vocab_size: int) -> Tokenizer:
    """A BPE that ``train_bpe`` trained and ``Tokenizer.save`` wrote to ``path``."""
    backend = tokenizers.Tokenizer.from_file(str(path))
    return Tokenizer(backend, eos_token=END_OF_TEXT,
                     source=f"byte-level BPE of {vocab_size} tokens trained on the data ({path})")
