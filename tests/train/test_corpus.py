"""Character corpus: vocabulary, split, cache, sources, and the stateless batching of
training windows across epochs and data-parallel ranks."""

import hashlib
import os
import sysconfig
from pathlib import Path

import pytest
import torch

from plait.train import corpus as corpus_module
from plait.train.corpus import (UNKNOWN_CHAR, eval_batch, lm_batch, load_corpus, stdlib_files,
                                windows_per_epoch)

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n" * 40


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return path


def full_stream(corpus) -> torch.Tensor:
    return torch.cat([corpus.train, corpus.val]).long()


# --------------------------------------------------------------------------- text and ids

def test_user_file_vocabulary_round_trip_and_unknown(tmp_path):
    source = write(tmp_path / "code.py", TEXT)
    corpus = load_corpus(str(source), cache_dir=tmp_path / "cache")
    # Small file: every character it has gets an id, sorted by code point after id 0.
    assert corpus.chars == UNKNOWN_CHAR + "".join(sorted(set(TEXT)))
    assert corpus.vocab_size == len(set(TEXT)) + 1
    assert corpus.train.dtype == torch.int16 and corpus.val.dtype == torch.int16
    assert corpus.files == 1 and corpus.nbytes == len(TEXT) and str(source) in corpus.source
    assert corpus.decode(full_stream(corpus)) == TEXT
    assert corpus.decode(full_stream(corpus).tolist()) == TEXT
    ids = corpus.encode("add(b, a)")
    assert ids.dtype == torch.int64 and corpus.decode(ids) == "add(b, a)"
    assert ids[0].item() == corpus.chars.index("a")
    # Characters never seen map to the unknown id 0, which decodes to U+FFFD.
    unknown = corpus.encode("a€Z😀\t")
    assert unknown.tolist() == [corpus.chars.index("a"), 0, 0, 0, 0]
    assert corpus.decode(unknown) == "a" + UNKNOWN_CHAR * 4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        corpus.decode([corpus.vocab_size])


def test_vocabulary_keeps_characters_seen_16_times_in_a_large_text(tmp_path):
    # 300,000 characters >= 16 * 16,384: a character needs 16 occurrences for an id.
    text = "x" * (300_000 - 31) + "r" * 15 + "k" * 16
    corpus = load_corpus(str(write(tmp_path / "big.txt", text)), cache_dir=tmp_path / "cache")
    assert corpus.chars == UNKNOWN_CHAR + "kx"
    stream = full_stream(corpus)
    assert (stream == 0).sum().item() == 15             # the r's
    assert (stream == 1).sum().item() == 16             # the k's


def test_split_is_the_last_val_fraction(tmp_path):
    source = write(tmp_path / "code.py", TEXT)
    corpus = load_corpus(str(source), val_fraction=0.1, cache_dir=tmp_path / "cache")
    n_val = round(len(TEXT) * 0.1)
    assert len(corpus.val) == n_val and len(corpus.train) == len(TEXT) - n_val
    assert torch.equal(corpus.train.long(), corpus.encode(TEXT[:-n_val]))
    assert torch.equal(corpus.val.long(), corpus.encode(TEXT[-n_val:]))


# --------------------------------------------------------------------------- sources

def test_directory_reads_utf8_files_by_relative_path_and_skips_binaries(tmp_path):
    root = tmp_path / "texts"
    write(root / "b.txt", "second file, ünïcode ok\n" * 5)
    write(root / "a" / "z.md", "first file\n" * 5)
    write(root / "c.bin", bytes(range(256)) * 4)          # not UTF-8
    write(root / "d.dat", b"abc\x00def" * 10)              # UTF-8, but NUL bytes: binary
    write(root / ".git" / "HEAD", "hidden: never read\n")
    corpus = load_corpus(str(root), cache_dir=tmp_path / "cache")
    assert corpus.decode(full_stream(corpus)) == "first file\n" * 5 + "second file, ünïcode ok\n" * 5
    assert corpus.files == 2
    assert "2 non-UTF-8 files skipped" in corpus.source and str(root.resolve()) in corpus.source


def test_max_bytes_takes_whole_files_then_cuts_the_last(tmp_path):
    root = tmp_path / "texts"
    write(root / "1.txt", "a" * 100)
    write(root / "2.txt", "b" * 100)
    write(root / "3.txt", "c" * 100)
    corpus = load_corpus(str(root), max_bytes=150, val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert corpus.nbytes == 150 and corpus.files == 2
    assert corpus.decode(full_stream(corpus)) == "a" * 100 + "b" * 50


def test_stdlib_files_are_sorted_py_without_tests_or_packages():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files, key=lambda path: path.as_posix())
    assert all(path.suffix == ".py" and not path.is_absolute() for path in files)
    excluded = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    assert not any(excluded & set(path.parts) for path in files)
    assert Path("os.py") in files and Path("json/decoder.py") in files


def test_stdlib_corpus_follows_the_sha1_order(tmp_path):
    corpus = load_corpus("stdlib", max_bytes=200_000, cache_dir=tmp_path)
    root = Path(sysconfig.get_paths()["stdlib"])
    order = sorted(stdlib_files(), key=lambda path: hashlib.sha1(path.as_posix().encode()).hexdigest())
    expected, count = "", 0
    for path in order:
        if len(expected) >= 200_000:
            break
        expected += (root / path).read_bytes().decode("utf-8")
        count += 1
    expected = expected[:200_000]
    assert corpus.nbytes == 200_000 and corpus.files == count
    assert corpus.source.startswith("Python 3.") and f"({count} files, 0.2 MB)" in corpus.source
    assert torch.equal(full_stream(corpus), corpus.encode(expected))
    assert set("def return class import") <= set(corpus.chars)


# --------------------------------------------------------------------------- cache

def test_loads_are_deterministic(tmp_path):
    source = write(tmp_path / "code.py", TEXT)
    first = load_corpus(str(source), cache_dir=tmp_path / "one")
    second = load_corpus(str(source), cache_dir=tmp_path / "two")   # built afresh
    assert first.digest == second.digest and first.chars == second.chars
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    other = load_corpus(str(source), val_fraction=0.2, cache_dir=tmp_path / "one")
    assert other.digest != first.digest                              # the split is part of the identity


def test_cache_hit_reads_no_text_and_a_changed_source_is_rebuilt(tmp_path, monkeypatch):
    source = write(tmp_path / "texts" / "code.py", TEXT)
    cache = tmp_path / "cache"
    built = load_corpus(str(source.parent), cache_dir=cache)
    assert len(list(cache.glob("corpus-*.npz"))) == 1 and not list(cache.glob("*.tmp"))

    def no_reading(*args):
        raise AssertionError("a cached corpus must not read its source texts")

    with monkeypatch.context() as patch:
        patch.setattr(corpus_module, "_read_text", no_reading)
        cached = load_corpus(str(source.parent), cache_dir=cache)
    assert cached.digest == built.digest and cached.source == built.source
    assert cached.chars == built.chars and torch.equal(cached.train, built.train)

    write(source, TEXT.replace("add", "sum"))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    rebuilt = load_corpus(str(source.parent), cache_dir=cache)
    assert rebuilt.digest != built.digest and rebuilt.decode(full_stream(rebuilt)) == TEXT.replace("add", "sum")


def test_a_corrupt_cache_file_is_rebuilt(tmp_path):
    source = write(tmp_path / "code.py", TEXT)
    built = load_corpus(str(source), cache_dir=tmp_path)
    (cache_file,) = tmp_path.glob("corpus-*.npz")
    cache_file.write_bytes(cache_file.read_bytes()[:200])            # truncated, as by a crash
    assert load_corpus(str(source), cache_dir=tmp_path).digest == built.digest
    assert corpus_module._load_cached(cache_file).digest == built.digest  # and written whole again


# --------------------------------------------------------------------------- errors

def test_source_and_argument_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=r"nope\.txt.*does not exist.*'stdlib'"):
        load_corpus(str(missing), cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*no files"):
        load_corpus(str(tmp_path / "empty"), cache_dir=tmp_path)
    write(tmp_path / "blank.txt", "")
    with pytest.raises(ValueError, match=r"blank\.txt.*has 0 characters"):
        load_corpus(str(tmp_path / "blank.txt"), cache_dir=tmp_path)
    write(tmp_path / "tiny.txt", "hello")
    with pytest.raises(ValueError, match=r"tiny\.txt.*has 5 characters.*at least 30"):
        load_corpus(str(tmp_path / "tiny.txt"), cache_dir=tmp_path)
    write(tmp_path / "latin1.txt", "café".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"latin1\.txt.*not UTF-8"):
        load_corpus(str(tmp_path / "latin1.txt"), cache_dir=tmp_path)
    for bad in (0.0, 0.5, -0.1):
        with pytest.raises(ValueError, match=rf"val_fraction must be in \(0, 0\.5\), got {bad}"):
            load_corpus(str(tmp_path / "tiny.txt"), val_fraction=bad, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        load_corpus("stdlib", max_bytes=0, cache_dir=tmp_path)


def test_batch_errors():
    tokens = torch.arange(101, dtype=torch.int16)                     # 10 windows of seq_len 10
    with pytest.raises(ValueError, match="6 is not a positive multiple of world_size 4; use a multiple of 4"):
        lm_batch(tokens, 0, 6, 10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="batch_size 12 exceeds the 10 windows"):
        lm_batch(tokens, 0, 12, 10)
    with pytest.raises(ValueError, match="hold no window"):
        eval_batch(tokens, 0, 2, 100 + 1)
    with pytest.raises(ValueError, match="rank=3, world_size=3"):
        lm_batch(tokens, 0, 6, 10, rank=3, world_size=3)


# --------------------------------------------------------------------------- batches

def window_ids(inputs: torch.Tensor, seq_len: int) -> list[int]:
    """With tokens = arange, row i of a batch starts at window * seq_len."""
    return (inputs[:, 0] // seq_len).tolist()


def test_windows_tile_the_stream_and_targets_are_shifted_inputs():
    seq_len, tokens = 8, torch.arange(1000, 1085, dtype=torch.int16)   # 85 tokens: 10 windows, 4 left over
    assert windows_per_epoch(tokens, seq_len) == 10 and windows_per_epoch(tokens[:8], seq_len) == 0
    inputs, targets = lm_batch(tokens, 3, 6, seq_len, seed=7)
    assert inputs.shape == targets.shape == (6, seq_len) and inputs.dtype == targets.dtype == torch.int64
    for row_inputs, row_targets in zip(inputs, targets):
        start = row_inputs[0].item() - 1000
        assert start % seq_len == 0 and start + seq_len + 1 <= len(tokens)
        assert torch.equal(row_inputs, tokens[start : start + seq_len].long())
        assert torch.equal(row_targets, tokens[start + 1 : start + seq_len + 1].long())


def test_every_window_once_per_epoch_across_the_epoch_boundary():
    seq_len, windows, batch_size = 4, 10, 4                            # batches straddle epochs
    tokens = torch.arange(windows * seq_len + 1)
    seen = [window for step in range(15)
            for window in window_ids(lm_batch(tokens, step, batch_size, seq_len, seed=3)[0], seq_len)]
    epochs = [seen[e * windows : (e + 1) * windows] for e in range(6)]
    assert all(sorted(epoch) == list(range(windows)) for epoch in epochs)
    assert epochs[0] != epochs[1]                                     # reshuffled each epoch
    # Step 2 = positions 8..11: the last two of epoch 0's order, then the first two of epoch 1's.
    order = [torch.randperm(windows, generator=torch.Generator().manual_seed(3 * 1_000_003 + e)).tolist()
             for e in range(2)]
    assert window_ids(lm_batch(tokens, 2, batch_size, seq_len, seed=3)[0], seq_len) == order[0][8:] + order[1][:2]
    other_seed = [w for step in range(3) for w in window_ids(lm_batch(tokens, step, 4, seq_len, seed=4)[0], seq_len)]
    assert other_seed[:10] != epochs[0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_rank_slices_concatenate_to_the_global_batch(world_size):
    tokens = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
    windows = windows_per_epoch(tokens, 7)
    for step in (0, 5, 9):                                              # 9 * 12 > 57 windows: second epoch
        whole = lm_batch(tokens, step, 12, 7, seed=1)
        parts = [lm_batch(tokens, step, 12, 7, seed=1, rank=rank, world_size=world_size) for rank in range(world_size)]
        assert all(part[0].shape == (12 // world_size, 7) for part in parts)
        assert torch.equal(torch.cat([part[0] for part in parts]), whole[0])
        assert torch.equal(torch.cat([part[1] for part in parts]), whole[1])
    assert windows == 57


def test_eval_batches_go_in_order_and_wrap_around():
    seq_len, tokens = 5, torch.arange(5 * 7 + 1)                      # 7 windows
    assert window_ids(eval_batch(tokens, 0, 4, seq_len)[0], seq_len) == [0, 1, 2, 3]
    assert window_ids(eval_batch(tokens, 1, 4, seq_len)[0], seq_len) == [4, 5, 6, 0]
    assert window_ids(eval_batch(tokens, 1, 4, seq_len, rank=1, world_size=2)[0], seq_len) == [6, 0]
    inputs, targets = eval_batch(tokens, 3, 4, seq_len)
    assert torch.equal(targets[:, :-1], inputs[:, 1:]) and torch.equal(targets[:, -1], inputs[:, -1] + 1)
