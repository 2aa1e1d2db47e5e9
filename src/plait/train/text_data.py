"""A user's text data for ``plait train --data ... --tokenizer ...``: read (plain text,
JSONL, Parquet, Arrow; plait.train.text_sources), tokenized once into a memory-mapped
token cache (plait.train.token_cache), packed with one end-of-text id after every
document, split by documents, and cut into the same per-rank batches as the char
corpus (plait.train.corpus's window order).

Split: the last ``max(1, round(n_docs · val_fraction))`` documents, in reading order,
are validation, the rest training (as Megatron-LM splits by document ranges); at least
one of each, so the data needs two documents or more. The split is a view of the one
cached stream: changing val_fraction re-tokenizes nothing.

Batches: windows of seq_len + 1 ids tile each stream (neighbours share one id) and
cross document boundaries (the end-of-text id marks them), as GPT-2 / Megatron-LM pack.
Global training batch ``step`` is a function of (seed, step, global batch) alone and
dp rank r of dp takes rows [r·B/dp, (r+1)·B/dp): every dp size sees the same samples
in the same order, so a resume on another dp size continues exactly
(plait.train.corpus.train_window_ids).

``train:bpe:VOCAB`` trains the BPE on the training documents only (validation text
never shapes the tokenizer) and saves its tokenizer.json in the cache directory as
``tokenizer-bpe-<key>.json``, keyed like the token cache plus VOCAB and val_fraction,
so a second load reuses it (nothing retrained, nothing re-tokenized).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from plait.train.corpus import check_batch_args, eval_window_ids, train_window_ids
from plait.train.text_sources import DataFile, content_digest, iter_documents, resolve_data
from plait.train.token_cache import (PackedTokens, cache_key, pack_chunk, pack_in_memory, read_cache, token_dtype,
                                     write_cache)
from plait.train.tokenizer import (BPE_RECIPE, Tokenizer, TokenizerSpec, load_tokenizer, load_trained_bpe,
                                   parse_tokenizer_spec, train_bpe)

HF_CACHE_SUBDIR = "hf-datasets"     # datasets' Arrow copies of Parquet files, inside our cache directory
ENCODE_BATCH_DOCUMENTS = 1024       # documents per encode_batch call (bounds the Python lists held)
SAMPLE_PROMPT_TOKENS = 16


@dataclass(frozen=True, kw_only=True, eq=False)
class TextData:
    """Tokenized documents, packed: ``train`` and ``val`` are 1-D uint16/uint32 views of
    one stream (memory-mapped when cached); ``digest`` identifies data, tokenizer and split."""

    tokenizer: Tokenizer
    packed: PackedTokens
    train_documents: int
    source: str
    digest: str
    tokenizer_path: Path | None = None   # a trained BPE's tokenizer.json in the cache, else None

    def __post_init__(self):
        if not 1 <= self.train_documents < self.packed.documents:
            raise ValueError(f"train_documents must be in 1..{self.packed.documents - 1}, got {self.train_documents}")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def documents(self) -> int:
        return self.packed.documents

    @property
    def _split(self) -> int:
        return int(self.packed.doc_starts[self.train_documents])

    @property
    def train(self) -> np.ndarray:
        """(n_train,) ids of the training documents, each followed by the end-of-text id."""
        return self.packed.tokens[: self._split]

    @property
    def val(self) -> np.ndarray:
        """(n_val,) ids of the validation documents, each followed by the end-of-text id."""
        return self.packed.tokens[self._split:]

    def encode(self, text: str) -> torch.Tensor:
        """(len,) int64 ids of ``text`` (no special tokens added)."""
        return torch.tensor(self.tokenizer.encode(text), dtype=torch.int64)

    def decode(self, ids) -> str:
        """Text of a 1-D tensor or sequence of ids (the end-of-text token written out)."""
        values = ids.detach().cpu().reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(values)

    def train_windows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 ids in the training stream: (n_train - 1) // seq_len."""
        return max(0, (len(self.train) - 1) // seq_len)

    def val_windows(self, seq_len: int) -> int:
        return max(0, (len(self.val) - 1) // seq_len)

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's 1/world_size slice of global training batch ``step``: inputs and
        targets (batch_size / world_size, seq_len) int64 — exactly plait.train.corpus.lm_batch's
        windows and order (epochs of randperm(W) seeded by seed·1_000_003 + epoch)."""
        windows = check_batch_args(len(self.train), batch_size, seq_len, rank, world_size)
        if batch_size > windows:
            raise ValueError(f"batch_size {batch_size} exceeds the {windows} training windows of seq_len {seq_len} "
                             f"in {len(self.train)} tokens ({self.source}); use batch_size <= {windows}, a shorter "
                             f"seq_len or more text")
        window_ids = train_window_ids(windows, step, batch_size, seed=seed, rank=rank, world_size=world_size)
        return _gather(self.train, window_ids, seq_len)

    def eval_batch(self, index: int, batch_size: int, seq_len: int, *, rank: int = 0,
                   world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of validation batch ``index`` (windows in stream order,
        wrapping around; plait.train.corpus.eval_batch's order)."""
        windows = check_batch_args(len(self.val), batch_size, seq_len, rank, world_size)
        return _gather(self.val, eval_window_ids(windows, index, batch_size, rank=rank, world_size=world_size),
                       seq_len)

    def sample_prompt(self, tokens: int = SAMPLE_PROMPT_TOKENS) -> str:
        """The start of the first non-empty validation document: its first ``tokens`` ids,
        a few more when a character's bytes straddle the cut (byte-level BPE), never its
        end-of-text id. A prompt from the data for the closing sample; "" when every
        validation document is empty."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        starts = self.packed.doc_starts
        for document in range(self.train_documents, self.documents):
            start, end = int(starts[document]), int(starts[document + 1]) - 1   # end: its end-of-text id
            if end > start:
                ids = self.packed.tokens[start:end].tolist()
                count = min(tokens, len(ids))
                text = self.tokenizer.decode(ids[:count])
                while count < len(ids) and text.endswith("\ufffd"):   # half a character: take its other bytes
                    count += 1
                    text = self.tokenizer.decode(ids[:count])
                return text
        return ""


def _gather(tokens: np.ndarray, window_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(window_ids), seq_len) int64, read from a (memory-mapped) stream."""
    index = window_ids.numpy()[:, None] * seq_len + np.arange(seq_len + 1)   # (b, seq_len + 1)
    windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# --------------------------------------------------------------------------- loading

def _train_documents(n_docs: int, val_fraction: float, description: str) -> int:
    if n_docs < 2:
        raise ValueError(f"data {description} holds {n_docs} document{'s' * (n_docs != 1)}; validation is split by "
                         f"documents (a plain-text file is one document, a JSONL line / Parquet or Arrow row one): "
                         f"pass at least two (several files, or one record per document)")
    return n_docs - min(n_docs - 1, max(1, int(round(n_docs * val_fraction))))


def _training_texts(files: Sequence[DataFile], text_field: str, hf_cache: Path | None, count: int) -> Iterator[str]:
    """The first ``count`` documents (the training split) as texts, for BPE training."""
    seen = 0
    for _, documents in iter_documents(files, text_field, hf_cache):
        for document in documents:
            if seen == count:
                return
            seen += 1
            yield document


def _bpe(spec: TokenizerSpec, files, digests, text_field: str, val_fraction: float, cache_dir: Path | None,
         hf_cache: Path | None, description: str) -> tuple[Tokenizer, Path | None]:
    """The byte-level BPE of ``spec`` trained on the training documents (from the cache when there)."""
    payload = [BPE_RECIPE, [list(entry) for entry in digests], text_field, spec.vocab_size, repr(float(val_fraction))]
    key = hashlib.sha256(json.dumps(payload).encode("utf-8")).hexdigest()
    path = cache_dir / f"tokenizer-bpe-{key[:32]}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return load_trained_bpe(path, spec.vocab_size), path
        except Exception:  # noqa: BLE001 -- a damaged file (the library raises a bare Exception): trained again
            pass
    n_docs = sum(len(documents) for _, documents in iter_documents(files, text_field, hf_cache))
    train_docs = _train_documents(n_docs, val_fraction, description)
    tokenizer = train_bpe(_training_texts(files, text_field, hf_cache, train_docs), spec.vocab_size)
    if path is not None:
        tokenizer.save(path)
    return tokenizer, path


def _encoded_chunks(tokenizer: Tokenizer, files, text_field: str, hf_cache: Path | None, dtype) -> Iterator:
    for _, documents in iter_documents(files, text_field, hf_cache):
        for first in range(0, len(documents), ENCODE_BATCH_DOCUMENTS):
            encoded = tokenizer.encode_batch(documents[first:first + ENCODE_BATCH_DOCUMENTS])
            yield pack_chunk(encoded, tokenizer.eos_id, dtype)


def _describe(data, files: Sequence[DataFile]) -> str:
    """"--data ENTRIES (N files: n1 text, n2 jsonl, ...)"."""
    entries = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    named = ", ".join(os.fspath(entry) for entry in entries[:3]) + (", ..." if len(entries) > 3 else "")
    counts: dict[str, int] = {}
    for data_file in files:
        counts[data_file.format] = counts.get(data_file.format, 0) + 1
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.items())
    return f"--data {named} ({len(files)} file{'s' * (len(files) != 1)}: {kinds})"


def load_text_data(data: str | os.PathLike | Sequence[str | os.PathLike], *, tokenizer: str | Tokenizer,
                   text_field: str = "text", val_fraction: float = 0.05,
                   cache_dir: str | os.PathLike | None = None) -> TextData:
    """Read ``data`` (files, directories, globs: plait.train.text_sources), tokenize it
    with ``tokenizer`` (a --tokenizer spec or a Tokenizer) and pack it, split the last
    documents off for validation. ``cache_dir``: where the token stream (and a trained
    BPE, and datasets' Parquet copies) are cached; None: nothing written, tokenized in
    memory. Every load hashes the files' contents; a cached stream is reused without
    any tokenizer call. Errors name the bad value and the fix."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction!r}; e.g. 0.05")
    files = resolve_data(data)
    description = _describe(data, files)
    digests = [(data_file.format, content_digest(data_file.path)) for data_file in files]
    cache = Path(cache_dir).expanduser() if cache_dir is not None else None
    hf_cache = cache / HF_CACHE_SUBDIR if cache is not None else None
    tokenizer_path = None
    if isinstance(tokenizer, Tokenizer):
        resolved = tokenizer
    else:
        spec = parse_tokenizer_spec(tokenizer)
        if spec.kind == "train_bpe":
            resolved, tokenizer_path = _bpe(spec, files, digests, text_field, val_fraction, cache, hf_cache,
                                            description)
        else:
            resolved = load_tokenizer(spec)
    key = cache_key(digests, text_field, resolved.identity)
    dtype = token_dtype(resolved.vocab_size)
    found = read_cache(cache, key) if cache is not None else None
    if found is not None:
        packed = found[0]
    else:
        chunks = _encoded_chunks(resolved, files, text_field, hf_cache, dtype)
        if cache is None:
            packed = pack_in_memory(chunks, dtype)
        else:
            meta = {"source": description, "tokenizer": resolved.source, "eos_id": resolved.eos_id,
                    "vocab_size": resolved.vocab_size, "text_field": text_field, "files": [str(f.path) for f in files]}
            packed = write_cache(cache, key, chunks, dtype, meta)
    train_docs = _train_documents(packed.documents, val_fraction, description)
    digest = hashlib.sha256(f"{key}:{train_docs}".encode()).hexdigest()
    return TextData(tokenizer=resolved, packed=packed, train_documents=train_docs,
                    source=f"{description}, {packed.documents:,} documents, {len(packed.tokens):,} tokens",
                    digest=digest, tokenizer_path=tokenizer_path)
