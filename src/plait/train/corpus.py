"""Character-level language-modelling corpus that ships with the machine: the Python
standard library's own source files (no download), or a user's UTF-8 text file or
directory, tokenised to one id per character and cut into next-character windows.

Text -> ids: id 0 is "unknown" (decodes to U+FFFD); ids 1..V-1 are the characters
that occur often enough (see ``_min_count``), sorted by code point. The stream's last
``val_fraction`` is validation, the rest training. Batches are stateless functions
of the global step, so every data-parallel rank computes its own slice of the same
global batch and resuming needs nothing but the step number.

Tokenising goes through numpy (UTF-32 code points -> lookup table), ~0.1 s for 4 MB;
the result is cached as ``corpus-<key>.npz`` in the cache directory given (the CLI's)
so later loads only stat the sources.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

UNKNOWN_CHAR = "\ufffd"
# Bump when the text selection, vocabulary rule, split or file layout changes: it is
# part of the cache key, so old cache files are simply never matched again.
FORMAT_VERSION = "plait-char-corpus-1"
# Directory names never read from the standard library: third-party packages, bytecode
# and test suites (test, tests, idle_test: their data includes deliberately malformed,
# non-UTF-8 and Python-2 files, e.g. lib2to3/tests/data).
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
MAX_MIN_COUNT = 16          # a character needs this many occurrences in a large corpus
CHARS_PER_MIN_COUNT = 16_384  # ... and one per this many characters in a small one


@dataclass(frozen=True, kw_only=True, eq=False)
class CharCorpus:
    """Token ids of a character corpus, split into train and validation streams."""

    chars: str                                  # chars[i] is the character of id i
    train: torch.Tensor = field(repr=False)     # (n_train,) int16 (int32 if vocab > 32767)
    val: torch.Tensor = field(repr=False)       # (n_val,) same dtype
    source: str
    files: int
    nbytes: int                                 # characters read (after the max_bytes cut)
    digest: str

    def __post_init__(self):
        if not self.chars or self.chars[0] != UNKNOWN_CHAR:
            raise ValueError(f"chars must start with the unknown character {UNKNOWN_CHAR!r}, "
                             f"got {self.chars[:1]!r}")
        if self.train.dim() != 1 or self.val.dim() != 1 or self.train.dtype != self.val.dtype:
            raise ValueError(f"train and val must be 1-D with one dtype, got shapes {tuple(self.train.shape)}, "
                             f"{tuple(self.val.shape)} and dtypes {self.train.dtype}, {self.val.dtype}")

    @property
    def vocab_size(self) -> int:
        """Number of ids, the unknown id 0 included."""
        return len(self.chars)

    @cached_property
    def _code_points(self) -> np.ndarray:
        # (vocab_size,) uint32, ascending after index 0: the searchsorted table of encode.
        return np.frombuffer(self.chars.encode("utf-32-le"), dtype="<u4").copy()

    def encode(self, text: str) -> torch.Tensor:
        """Ids (len(text),) int64 of ``text``; characters outside the vocabulary -> 0."""
        # surrogatepass: a lone surrogate (only from surrogateescape'd text) is just unknown.
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        known = self._code_points[1:]
        position = np.searchsorted(known, codes)
        found = position < len(known)
        found[found] = known[position[found]] == codes[found]
        return torch.from_numpy(np.where(found, position + 1, 0).astype(np.int64))

    def decode(self, ids) -> str:
        """Text of a 1-D tensor or list of ids (id 0 -> U+FFFD)."""
        array = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        array = array.astype(np.int64).reshape(-1) if array.ndim == 0 else array.astype(np.int64)
        if array.ndim != 1:
            raise ValueError(f"decode takes a 1-D sequence of ids, got shape {array.shape}; decode rows one at a time")
        bad = (array < 0) | (array >= self.vocab_size)
        if bad.any():
            raise ValueError(f"id {int(array[bad][0])} is outside the vocabulary 0..{self.vocab_size - 1}")
        return self._code_points[array].astype("<u4").tobytes().decode("utf-32-le")


# --------------------------------------------------------------------------- sources

def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Sorted relative paths of the standard library's ``*.py`` files, without any
    directory named in ``STDLIB_EXCLUDED_DIRS`` (site-/dist-packages, __pycache__ and
    the test suites test/, tests/, idle_test/)."""
    root = _stdlib_root()
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in STDLIB_EXCLUDED_DIRS]
        for name in names:
            if name.endswith(".py"):
                found.append((Path(directory) / name).relative_to(root))
    return sorted(found, key=lambda path: path.as_posix())


def _user_files(root: Path) -> list[Path]:
    """Sorted relative paths of every regular file under ``root``, skipping hidden
    (dot) files and directories such as .git."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if not name.startswith(".")]
        for name in names:
            path = Path(directory) / name
            if not name.startswith(".") and path.is_file():
                found.append(path.relative_to(root))
    return sorted(found, key=lambda path: path.as_posix())


def _stdlib_order(relative_path: Path) -> str:
    # A stable hash spreads the max_bytes budget over the whole library instead of
    # taking the alphabetically first packages (asyncio, collections, ...).
    return hashlib.sha1(relative_path.as_posix().encode()).hexdigest()


def _read_text(path: Path, max_chars: int) -> str | None:
    """At most ``max_chars`` characters of UTF-8 ``path``, line endings kept; None if
    it is not UTF-8 text (fails to decode or contains NUL bytes)."""
    try:
        with open(path, encoding="utf-8", newline="") as stream:
            # read(n) allocates n characters up front: ask for no more than the file can hold
            text = stream.read(min(max_chars, os.fstat(stream.fileno()).st_size))
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def _size_text(nchars: int) -> str:
    return f"{nchars / 1e6:.1f} MB" if nchars >= 100_000 else f"{nchars / 1e3:.1f} kB"


def _resolve_source(source: str) -> tuple[str, Path, list[Path]]:
    """(kind, root, relative files in reading order) for ``source``."""
    if source == "stdlib":
        return "stdlib", _stdlib_root(), sorted(stdlib_files(), key=_stdlib_order)
    path = Path(source).expanduser()
    if path.is_file():
        return "file", path.resolve(), [Path()]
    if path.is_dir():
        return "dir", path.resolve(), _user_files(path)
    raise ValueError(f"corpus source {source!r} does not exist; pass an existing text file, "
                     f"a directory of text files, or 'stdlib'")


def _read_source(kind: str, root: Path, files: list[Path], max_bytes: int) -> tuple[str, int, str]:
    """(text, files used, description): whole files in order, the last cut so the
    text has at most ``max_bytes`` characters; non-UTF-8 files are skipped."""
    pieces, nchars, used, skipped = [], 0, 0, 0
    for relative in files:
        if nchars >= max_bytes:
            break
        text = _read_text(root / relative, max_bytes - nchars)
        if text is None:
            if kind == "file":
                raise ValueError(f"corpus file {str(root)!r} is not UTF-8 text; pass a UTF-8 text file")
            skipped += 1
            continue
        pieces.append(text)
        nchars += len(text)
        used += 1
    if kind == "stdlib":
        description = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"
    else:
        description = f"{'text file' if kind == 'file' else 'directory'} {root}"
    description += f" ({used} file{'s' * (used != 1)}, {_size_text(nchars)}"
    description += f"; {skipped} non-UTF-8 file{'s' * (skipped != 1)} skipped)" if skipped else ")"
    return "".join(pieces), used, description


# --------------------------------------------------------------------------- tokens

def _min_count(nchars: int) -> int:
    """Occurrences a character needs to get its own id: 16 in a corpus of 256 KiB or
    more, one per 16 KiB below that, and at least 1, so a small user file keeps every
    character it has."""
    return max(1, min(MAX_MIN_COUNT, nchars // CHARS_PER_MIN_COUNT))


def _tokenise(text: str) -> tuple[str, np.ndarray]:
    """(chars, ids (len(text),) int16/int32) with the vocabulary rule of ``_min_count``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    counts = np.bincount(codes)                           # (max code point + 1,)
    kept = np.flatnonzero(counts >= _min_count(len(codes)))
    kept = kept[kept != ord(UNKNOWN_CHAR)]                # U+FFFD in the text is unknown anyway
    table = np.zeros(len(counts), dtype=np.int32)
    table[kept] = np.arange(1, len(kept) + 1, dtype=np.int32)
    vocab_size = len(kept) + 1
    dtype = np.int16 if vocab_size <= 32767 else np.int32
    chars = UNKNOWN_CHAR + kept.astype("<u4").tobytes().decode("utf-32-le")
    return chars, table[codes].astype(dtype)


def _digest(chars: str, train: np.ndarray, val: np.ndarray) -> str:
    """sha256 of the format, the characters, the train length and all ids as int32."""
    hasher = hashlib.sha256(FORMAT_VERSION.encode())
    hasher.update(chars.encode("utf-8"))
    hasher.update(len(train).to_bytes(8, "little"))
    hasher.update(train.astype("<i4").tobytes())
    hasher.update(val.astype("<i4").tobytes())
    return hasher.hexdigest()


# --------------------------------------------------------------------------- cache

def _cache_key(kind: str, root: Path, files: list[Path], max_bytes: int, val_fraction: float) -> str:
    """sha256 over the format, the source and every candidate file's size and mtime
    (stat only: computing it never reads a text), max_bytes and val_fraction."""
    listing = []
    for relative in sorted(files, key=lambda path: path.as_posix()):
        stat = (root / relative).stat()
        listing.append([relative.as_posix(), stat.st_size, stat.st_mtime_ns])
    payload = [FORMAT_VERSION, kind, str(root), listing, max_bytes, repr(float(val_fraction))]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def _load_cached(path: Path) -> CharCorpus | None:
    """The corpus in ``path``, or None if it is missing, unreadable or fails its digest."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(str(archive["meta"]))
            chars = archive["chars"].astype("<u4").tobytes().decode("utf-32-le")
            train, val = archive["train"], archive["val"]
        if meta["format"] != FORMAT_VERSION or _digest(chars, train, val) != meta["digest"]:
            return None
        return CharCorpus(chars=chars, train=torch.from_numpy(train), val=torch.from_numpy(val),
                          source=meta["source"], files=meta["files"], nbytes=meta["nbytes"], digest=meta["digest"])
    except Exception:  # noqa: BLE001 -- any damaged cache file (truncated zip, bad json, ...) is rebuilt
        return None


def _save_cached(path: Path, corpus: CharCorpus) -> None:
    """Write ``corpus`` to ``path`` atomically (temp file in the same directory, fsync,
    rename), so concurrent loaders see either no file or a whole one."""
    meta = {"format": FORMAT_VERSION, "source": corpus.source, "files": corpus.files,
            "nbytes": corpus.nbytes, "digest": corpus.digest}
    temp_path = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                                         delete=False) as stream:
            temp_path = stream.name
            np.savez(stream, meta=np.array(json.dumps(meta)), chars=corpus._code_points,
                     train=corpus.train.numpy(), val=corpus.val.numpy())
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp_path, path)
        temp_path = None
    except OSError as error:
        warnings.warn(f"could not cache the corpus at {path} ({error}); it will be tokenised again next time. "
                      f"Pass a writable cache_dir or set PLAIT_CACHE_DIR", stacklevel=3)
    finally:
        if temp_path is not None:   # failed before the rename: leave no partial file behind
            Path(temp_path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- load

class CorpusTooSmall(ValueError):
    """The text holds too few characters for one training and one validation window."""

    def __init__(self, description: str, nchars: int, val_fraction: float):
        self.description, self.nchars, self.val_fraction = description, nchars, val_fraction
        needed = min_characters(1, 1, val_fraction)
        super().__init__(f"corpus {description} has {nchars} characters, too few for one training and one "
                         f"validation window at val_fraction={val_fraction}; pass at least {needed} characters of "
                         "UTF-8 text")


def min_characters(train_windows: int, seq_len: int, val_fraction: float, *, val_windows: int = 1) -> int:
    """The fewest characters N whose split (N - round(N·val_fraction) training,
    round(N·val_fraction) validation) holds ``train_windows`` training windows and
    ``val_windows`` validation windows of seq_len + 1 ids (see windows_per_epoch)."""
    need_train, need_val = train_windows * seq_len + 1, (val_windows * seq_len + 1 if val_windows else 0)

    def enough(n: int) -> bool:
        n_val = int(round(n * val_fraction))
        return n - n_val >= max(need_train, 2) and n_val >= max(need_val, 2)

    # n_train <= N(1 - f) + 1/2 and n_val >= k only if N·f >= k - 1/2: N below these fails. enough() is
    # monotone in N (n_train and n_val never shrink as N grows), so stepping up from there finds the least.
    low = math.ceil((max(need_train, 2) - 0.5) / (1 - val_fraction))
    if val_fraction:
        low = max(low, math.ceil((max(need_val, 2) - 0.5) / val_fraction))
    n = max(low - 1, 1)
    while not enough(n):
        n += 1
    return n


def load_corpus(source: str = "stdlib", *, max_bytes: int = 4_000_000, val_fraction: float = 0.05,
                cache_dir: str | os.PathLike | None = None) -> CharCorpus:
    """The character corpus of ``source`` ("stdlib", a UTF-8 text file or a directory):
    at most ``max_bytes`` characters, the last ``val_fraction`` of the ids for validation.

    Files are read whole, in order, until ``max_bytes`` characters (the last one cut):
    a directory's files by relative path, the standard library's by sha1 of the
    relative path so any budget samples the whole library. Cached under ``cache_dir``
    keyed by the sources' sizes and mtimes; None: not cached (the library writes files
    only where it is told; the ``plait`` CLI passes its cache directory,
    plait.cli.environment.cache_dir)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int (characters to read), got {max_bytes!r}")
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction!r}; e.g. 0.05")
    kind, root, files = _resolve_source(str(source))
    if not files:
        raise ValueError(f"corpus directory {str(root)!r} has no files (0 characters); "
                         f"pass a directory with UTF-8 text files, a text file, or 'stdlib'")
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir).expanduser()
        cache_path = cache_path / f"corpus-{_cache_key(kind, root, files, max_bytes, val_fraction)[:32]}.npz"
        cached = _load_cached(cache_path)
        if cached is not None:
            return cached

    text, used, description = _read_source(kind, root, files, max_bytes)
    n_val = int(round(len(text) * val_fraction))
    if n_val < 2 or len(text) - n_val < 2:
        raise CorpusTooSmall(description, len(text), val_fraction)
    chars, ids = _tokenise(text)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    corpus = CharCorpus(chars=chars, train=torch.from_numpy(train.copy()), val=torch.from_numpy(val.copy()),
                        source=description, files=used, nbytes=len(text), digest=_digest(chars, train, val))
    if cache_path is not None:
        _save_cached(cache_path, corpus)
    return corpus


# --------------------------------------------------------------------------- batches

def windows_per_epoch(tokens: torch.Tensor, seq_len: int) -> int:
    """Windows of seq_len + 1 ids that tile ``tokens`` (neighbours share one id so
    targets line up): (len(tokens) - 1) // seq_len."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return max(0, (len(tokens) - 1) // seq_len)


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, windows: int) -> torch.Tensor:
    """(windows,) int64: the order in which epoch ``epoch`` visits the windows."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(windows, generator=generator)


def _check_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, rank: int, world_size: int) -> int:
    """Validate the batch arguments; returns the number of windows."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D id stream, got shape {tuple(tokens.shape)}")
    return check_batch_args(len(tokens), batch_size, seq_len, rank, world_size)


def check_batch_args(n_tokens: int, batch_size: int, seq_len: int, rank: int, world_size: int) -> int:
    """Validate the batch arguments for a stream of ``n_tokens`` ids; returns the
    number of windows (see windows_per_epoch). Shared with plait.train.text_data."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(f"global batch_size {batch_size} is not a positive multiple of world_size {world_size}; "
                         f"use a multiple of {world_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    windows = max(0, (n_tokens - 1) // seq_len)
    if windows < 1:
        raise ValueError(f"{n_tokens} tokens hold no window of seq_len + 1 = {seq_len + 1}; "
                         f"use a shorter seq_len or more text")
    return windows


def train_window_ids(windows: int, step: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                     world_size: int = 1) -> torch.Tensor:
    """(batch_size / world_size,) int64: the windows of this rank's slice of global
    training batch ``step`` (the order of ``lm_batch``, which see). Needs B <= W."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size > windows:
        raise ValueError(f"batch_size {batch_size} exceeds the {windows} windows of the training stream; "
                         f"use batch_size <= {windows}, a shorter seq_len or more text")
    per_rank = batch_size // world_size
    first = step * batch_size + rank * per_rank
    positions = torch.arange(first, first + per_rank)
    epochs = positions // windows
    window_ids = torch.empty(per_rank, dtype=torch.int64)
    for epoch in torch.unique(epochs).tolist():   # at most two, since per_rank <= W
        mask = epochs == epoch
        window_ids[mask] = _epoch_order(seed, epoch, windows)[positions[mask] % windows]
    return window_ids


def eval_window_ids(windows: int, index: int, batch_size: int, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """(batch_size / world_size,) int64: the windows of this rank's slice of validation
    batch ``index`` (the order of ``eval_batch``, which see)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    per_rank = batch_size // world_size
    first = index * batch_size + rank * per_rank
    return torch.arange(first, first + per_rank) % windows


def _gather(tokens: torch.Tensor, window_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(window_ids), seq_len) int64, of the given windows."""
    index = window_ids[:, None] * seq_len + torch.arange(seq_len + 1)   # (b, seq_len + 1)
    windows = tokens[index].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def lm_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, *, seed: int = 0,
             rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous 1/world_size slice of global training batch ``step``:
    inputs and targets (batch_size / world_size, seq_len) int64, targets = inputs
    shifted by one id.

    Epoch e visits all W = windows_per_epoch windows in randperm order seeded by
    seed * 1_000_003 + e; step s takes positions [s B, (s+1) B) of the epochs' orders
    laid end to end, so a batch may straddle two epochs and each window is seen once
    per epoch. Needs B <= W."""
    windows = _check_batch(tokens, batch_size, seq_len, rank, world_size)
    if batch_size > windows:
        raise ValueError(f"batch_size {batch_size} exceeds the {windows} windows of seq_len {seq_len} in "
                         f"{len(tokens)} tokens; use batch_size <= {windows}, a shorter seq_len or more text")
    window_ids = train_window_ids(windows, step, batch_size, seed=seed, rank=rank, world_size=world_size)
    return _gather(tokens, window_ids, seq_len)


def eval_batch(tokens: torch.Tensor, index: int, batch_size: int, seq_len: int, *, rank: int = 0,
               world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of validation batch ``index``: windows [index B, (index+1) B)
    in stream order, modulo W (so it wraps around); shapes as in ``lm_batch``. Batches
    0..ceil(W / B) - 1 cover every window."""
    windows = _check_batch(tokens, batch_size, seq_len, rank, world_size)
    return _gather(tokens, eval_window_ids(windows, index, batch_size, rank=rank, world_size=world_size), seq_len)
