"""The packed token stream of a data set, tokenized once and memory-mapped after.

Layout: every document's ids followed by one end-of-text id, documents end to end, in
one 1-D stream of uint16 ids (uint32 when the vocabulary has more than 65,536 ids);
``doc_starts`` (n_docs + 1,) int64 holds where each document starts (its last entry
is the stream's length), so document d is ``tokens[doc_starts[d]:doc_starts[d+1]]``
with its end-of-text id last.

On disk, under the cache directory, three files named by the key
(``tokens-<key>.bin``, ``.docs.npy``, ``.json``), each written atomically
(plait.train.atomic_files), the JSON last: it records the sizes and the sha256 of the
other two, so a reader accepts the stream only whole and as written. The key
(``cache_key``) is a sha256 over the format, every file's content hash and format,
the text field and the tokenizer's identity, so changed data or another tokenizer
never reuses a stream, and a reused one needs no tokenizer call. A missing, partial or
damaged cache is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from plait.train.atomic_files import atomic_write

CACHE_FORMAT = "plait-token-cache-1"
UINT16_IDS = 1 << 16
KEY_CHARS = 32       # of the sha256 hex in the file names (128 bits)
HASH_CHUNK_BYTES = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.uint32)


def cache_key(file_digests: Sequence[tuple[str, str]], text_field: str, tokenizer_identity: str) -> str:
    """sha256 hex of the format, each file's (format, content sha256) in reading order,
    the text field and the tokenizer's identity."""
    payload = [CACHE_FORMAT, [list(entry) for entry in file_digests], text_field, tokenizer_identity]
    return hashlib.sha256(json.dumps(payload).encode("utf-8")).hexdigest()


@dataclass(frozen=True, kw_only=True, eq=False)
class PackedTokens:
    """A packed stream: ``tokens`` (n_tokens,) uint16/uint32 (a read-only memmap when
    cached), ``doc_starts`` (n_docs + 1,) int64; ``path`` the stream's file or None."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    path: Path | None = None

    def __post_init__(self):
        if self.tokens.ndim != 1 or self.doc_starts.ndim != 1 or len(self.doc_starts) < 1:
            raise ValueError(f"tokens and doc_starts must be 1-D, got shapes {self.tokens.shape}, "
                             f"{self.doc_starts.shape}")
        if self.doc_starts[0] != 0 or self.doc_starts[-1] != len(self.tokens):
            raise ValueError(f"doc_starts must run from 0 to len(tokens) = {len(self.tokens)}, got "
                             f"{int(self.doc_starts[0])}..{int(self.doc_starts[-1])}")

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1


def pack_chunk(documents: Sequence[Sequence[int]], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): the documents' ids each followed by ``eos_id``, as ``dtype``, and
    each document's length in that stream (its ids + 1). An id outside ``dtype`` (a
    tokenizer whose vocab_size is below its largest id) is refused by value."""
    lengths = np.fromiter((len(document) + 1 for document in documents), dtype=np.int64, count=len(documents))
    flat = np.fromiter(chain.from_iterable(chain(document, (eos_id,)) for document in documents), dtype=np.int64,
                       count=int(lengths.sum()))
    limit = np.iinfo(dtype).max
    if flat.size and (flat.min() < 0 or flat.max() > limit):
        bad = int(flat[(flat < 0) | (flat > limit)][0])
        raise ValueError(f"token id {bad} does not fit the cache's {np.dtype(dtype).name} ids (0..{limit}); the "
                         f"tokenizer's vocab_size is below its largest id: fix the tokenizer")
    return flat.astype(dtype), lengths


def pack_in_memory(chunks: Iterable[tuple[np.ndarray, np.ndarray]], dtype: np.dtype) -> PackedTokens:
    """The stream of ``pack_chunk`` results, held in memory (no cache directory)."""
    id_parts, length_parts = [np.empty(0, dtype=dtype)], [np.zeros(1, dtype=np.int64)]
    for ids, lengths in chunks:
        id_parts.append(ids)
        length_parts.append(lengths)
    return PackedTokens(tokens=np.concatenate(id_parts), doc_starts=np.cumsum(np.concatenate(length_parts)))


def _paths(cache_dir: Path, key: str) -> tuple[Path, Path, Path]:
    stem = f"tokens-{key[:KEY_CHARS]}"
    return cache_dir / f"{stem}.bin", cache_dir / f"{stem}.docs.npy", cache_dir / f"{stem}.json"


def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def write_cache(cache_dir: str | Path, key: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]],
                dtype: np.dtype, meta: dict) -> PackedTokens:
    """Stream ``pack_chunk`` results into the cache files of ``key`` (atomically, the
    JSON last, with ``meta`` in it) and return the stream memory-mapped from disk."""
    bin_path, docs_path, meta_path = _paths(Path(cache_dir), key)
    hasher, length_parts = hashlib.sha256(), [np.zeros(1, dtype=np.int64)]

    def write_tokens(temp_name: str) -> None:
        with open(temp_name, "wb") as stream:
            for ids, lengths in chunks:
                data = np.ascontiguousarray(ids, dtype=dtype).tobytes()
                stream.write(data)
                hasher.update(data)
                length_parts.append(lengths)

    atomic_write(bin_path, write_tokens)
    doc_starts = np.cumsum(np.concatenate(length_parts))
    atomic_write(docs_path, lambda temp_name: _save_npy(temp_name, doc_starts), doc_starts.nbytes)
    record = {**meta, "format": CACHE_FORMAT, "key": key, "dtype": np.dtype(dtype).name,
              "n_tokens": int(doc_starts[-1]), "n_docs": len(doc_starts) - 1,
              "tokens_sha256": hasher.hexdigest(), "docs_sha256": _file_sha256(docs_path)}
    data = (json.dumps(record, indent=1) + "\n").encode("utf-8")
    atomic_write(meta_path, lambda temp_name: Path(temp_name).write_bytes(data), len(data))
    found = read_cache(cache_dir, key)
    if found is None:  # what was just written does not read back: a broken file system, not a stale cache
        raise RuntimeError(f"the token cache written to {bin_path} does not read back whole; check the disk, or "
                           f"choose another cache directory")
    return found[0]


def _save_npy(temp_name: str, array: np.ndarray) -> None:
    # np.save given a name appends ".npy" when missing; a file object keeps atomic_write's temp name.
    with open(temp_name, "wb") as stream:
        np.save(stream, array)


def read_cache(cache_dir: str | Path, key: str) -> tuple[PackedTokens, dict] | None:
    """(the stream of ``key`` memory-mapped read-only, its JSON record) when all three
    files are there, whole and as written (sizes and sha256 checked); else None."""
    bin_path, docs_path, meta_path = _paths(Path(cache_dir), key)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
            return None
        dtype = np.dtype(meta["dtype"])
        n_tokens = int(meta["n_tokens"])
        if bin_path.stat().st_size != n_tokens * dtype.itemsize or _file_sha256(docs_path) != meta["docs_sha256"]:
            return None
        if _file_sha256(bin_path) != meta["tokens_sha256"]:
            return None
        doc_starts = np.load(docs_path, allow_pickle=False)
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else \
            np.empty(0, dtype=dtype)
        return PackedTokens(tokens=tokens, doc_starts=doc_starts, path=bin_path), meta
    except (OSError, ValueError, KeyError, TypeError):  # missing or damaged: rebuilt by the caller
        return None
