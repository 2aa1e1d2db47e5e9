"""Text data for plait train: text / JSONL / Parquet / Arrow read locally, packed with
one end-of-text id after each document (checked against the tokenizers library's own
ids), the token cache reused without a tokenizer call, the split by documents, batches
equal across dp sizes (the same global batch whatever dp, across an epoch boundary),
the sample prompt, and the refusals."""

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.train.corpus import lm_batch
from plait.train.text_data import load_text_data
from plait.train.token_cache import pack_chunk, token_dtype
from plait.train.tokenizer import END_OF_TEXT, Tokenizer, load_tokenizer, train_bpe

# ü (2 UTF-8 bytes) in most documents; 語 (3 bytes, unseen by the tokenizers, so 3 ids) opens the first validation one
DOCS = [("語 " if i == 9 else "") + f"def f{i}(x):\n    return x * {i} + {'ü' * (i % 3)}\n" * (1 + i % 4)
        for i in range(12)]


def bpe_file(tmp_path: Path) -> Path:
    """A tokenizer.json the test trains and saves (train_bpe + the tokenizers library's save)."""
    path = tmp_path / "tok" / "tokenizer.json"
    if not path.exists():
        train_bpe(DOCS[:9], 300).save(path)   # the training documents, as train:bpe does
    return path


def expected_stream(tokenizer_path: Path, documents) -> np.ndarray:
    """The oracle: the tokenizers library's own ids of each document, then the end-of-text id."""
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer.from_file(str(tokenizer_path))
    eos = backend.token_to_id(END_OF_TEXT)
    return np.array([i for doc in documents for i in [*backend.encode(doc, add_special_tokens=False).ids, eos]])


def write_text_dir(root: Path, documents) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for index, document in enumerate(documents):
        (root / f"doc{index:02d}.txt").write_text(document, encoding="utf-8")
    return root


def test_formats_pack_documents_with_end_of_text(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = bpe_file(tmp_path)
    parts = [DOCS[0:3], DOCS[3:6], DOCS[6:9], DOCS[9:12]]
    text_dir = write_text_dir(tmp_path / "text", parts[0])
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as stream:
        for index, document in enumerate(parts[1]):
            stream.write(json.dumps({"id": index, "body": document}) + "\n\n")   # blank lines are skipped
    pq.write_table(pa.table({"id": [1, 2, 3], "body": parts[2]}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"body": parts[3][:2], "n": [0, 1]}).save_to_disk(str(tmp_path / "saved"))
    table = pa.table({"body": parts[3][2:]})
    with pa.ipc.new_file(str(tmp_path / "d.arrow"), table.schema) as writer:   # Arrow IPC file format
        writer.write_table(table)
    cache = tmp_path / "cache"
    entries = [str(text_dir), str(tmp_path / "b.jsonl"), str(tmp_path / "c.parquet"), str(tmp_path / "saved"),
               str(tmp_path / "d.arrow")]
    # no network: a connection attempt while datasets reads Parquet/Arrow fails the test
    refuse = pytest.MonkeyPatch()
    refuse.setattr(socket.socket, "connect", lambda *args: pytest.fail(f"network access {args[1:]}"))
    try:
        data = load_text_data(entries, tokenizer=str(path), text_field="body", val_fraction=0.25, cache_dir=cache)
    finally:
        refuse.undo()
    assert (cache / "hf-datasets").is_dir()   # datasets' Arrow copy of the Parquet file stays in our cache
    want = expected_stream(path, DOCS)
    assert data.packed.tokens.dtype == np.uint16 and isinstance(data.packed.tokens, np.memmap)
    np.testing.assert_array_equal(np.asarray(data.packed.tokens, dtype=np.int64), want)
    # documents start where the oracle's do and each decodes back to its text
    assert data.documents == 12
    for index, document in enumerate(DOCS):
        start, end = data.packed.doc_starts[index], data.packed.doc_starts[index + 1]
        assert data.packed.tokens[end - 1] == data.eos_id
        assert data.decode(data.packed.tokens[start:end - 1].tolist()) == document
    # split by documents: the last round(12 * 0.25) = 3 documents are validation
    assert data.train_documents == 9
    np.testing.assert_array_equal(data.val, expected_stream(path, DOCS[9:]))
    np.testing.assert_array_equal(data.train, expected_stream(path, DOCS[:9]))
    # the closing sample's prompt: the start of the first validation document
    prompt = data.sample_prompt(tokens=6)
    assert prompt and DOCS[9].startswith(prompt)
    for tokens in range(1, 40):   # never a character cut in two (DOCS[9] opens with 語, 3 ids)
        assert DOCS[9].startswith(data.sample_prompt(tokens=tokens))
    assert data.sample_prompt(tokens=1) == "語"
    assert data.encode(prompt).tolist() == data.val[:len(data.encode(prompt))].tolist()


def test_cache_reused_without_tokenizing_and_keyed_by_content(tmp_path):
    path = bpe_file(tmp_path)
    source = write_text_dir(tmp_path / "text", DOCS)
    cache = tmp_path / "cache"
    first_tokenizer = load_tokenizer(str(path))
    first = load_text_data(str(source), tokenizer=first_tokenizer, cache_dir=cache)
    assert first_tokenizer.encoded_texts == len(DOCS)
    (stream_file,) = cache.glob("tokens-*.bin")
    before = os.stat(stream_file)
    # a second load with a fresh tokenizer: no text encoded, the stream file not rewritten
    second_tokenizer = load_tokenizer(str(path))
    second = load_text_data(str(source), tokenizer=second_tokenizer, cache_dir=cache)
    assert second_tokenizer.encoded_texts == 0
    after = os.stat(stream_file)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert second.digest == first.digest and second.packed.path == stream_file
    np.testing.assert_array_equal(second.packed.tokens, first.packed.tokens)
    # the key is the content: same size, same mtime, one character changed -> tokenized again
    target = source / "doc03.txt"
    stat = os.stat(target)
    target.write_text(DOCS[3].replace("return", "retorn"), encoding="utf-8")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    third_tokenizer = load_tokenizer(str(path))
    third = load_text_data(str(source), tokenizer=third_tokenizer, cache_dir=cache)
    assert third_tokenizer.encoded_texts == len(DOCS) and third.digest != first.digest
    # a damaged stream is rebuilt, never read
    damaged = next(p for p in cache.glob("tokens-*.bin") if p != stream_file)
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    fourth_tokenizer = load_tokenizer(str(path))
    fourth = load_text_data(str(source), tokenizer=fourth_tokenizer, cache_dir=cache)
    assert fourth_tokenizer.encoded_texts == len(DOCS)
    changed = [DOCS[3].replace("return", "retorn") if index == 3 else doc for index, doc in enumerate(DOCS)]
    np.testing.assert_array_equal(fourth.packed.tokens, expected_stream(path, changed))
    # a source file that cannot be read fails the load even with its tokens cached
    target.unlink()
    with pytest.raises(ValueError, match="doc03.txt"):
        load_text_data([str(source / "doc00.txt"), str(target)], tokenizer=str(path), cache_dir=cache)


def test_train_bpe_spec_trains_on_training_documents_and_is_cached(tmp_path):
    source = write_text_dir(tmp_path / "text", DOCS)
    cache = tmp_path / "cache"
    data = load_text_data(str(source), tokenizer="train:bpe:300", val_fraction=0.25, cache_dir=cache)
    assert data.tokenizer_path is not None and data.tokenizer_path.parent == cache
    # trained on the 9 training documents only: the same as training on them here
    assert data.tokenizer.identity == train_bpe(DOCS[:9], 300).identity
    assert data.tokenizer.eos_id == 0 and data.vocab_size <= 300
    again = load_text_data(str(source), tokenizer="train:bpe:300", val_fraction=0.25, cache_dir=cache)
    assert again.tokenizer.encoded_texts == 0 and again.digest == data.digest   # nothing retrained or re-tokenized
    np.testing.assert_array_equal(again.packed.tokens, expected_stream(data.tokenizer_path, DOCS))
    # no cache directory: nothing written, the same stream in memory
    loose = load_text_data(str(source), tokenizer="train:bpe:300", val_fraction=0.25)
    assert loose.tokenizer_path is None and loose.packed.path is None
    np.testing.assert_array_equal(loose.packed.tokens, data.packed.tokens)


def test_batches_equal_across_dp_sizes_and_epochs(tmp_path):
    path = bpe_file(tmp_path)
    data = load_text_data(str(write_text_dir(tmp_path / "text", DOCS)), tokenizer=str(path), val_fraction=0.2,
                          cache_dir=tmp_path / "cache")
    seq_len, batch_size = 8, 12
    windows = data.train_windows(seq_len)
    assert windows == (len(data.train) - 1) // seq_len and windows % batch_size   # batches straddle epochs
    oracle = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    for step in [0, 1, windows // batch_size, windows // batch_size + 1, 3 * windows // batch_size + 2]:
        inputs, targets = data.batch(step, batch_size, seq_len, seed=5)
        # the char corpus's window order on the same stream (plait.train.corpus.lm_batch)
        want_inputs, want_targets = lm_batch(oracle, step, batch_size, seq_len, seed=5)
        assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for dp in (2, 3, 4):
            slices = [data.batch(step, batch_size, seq_len, seed=5, rank=rank, world_size=dp) for rank in range(dp)]
            assert torch.equal(torch.cat([s[0] for s in slices]), inputs)
            assert torch.equal(torch.cat([s[1] for s in slices]), targets)
    # validation batches: stream order, the same across dp sizes
    full = data.eval_batch(1, 4, seq_len)
    halves = [data.eval_batch(1, 4, seq_len, rank=rank, world_size=2) for rank in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), full[0])
    val = np.asarray(data.val, dtype=np.int64)
    assert full[0][0].tolist() == val[4 * seq_len:5 * seq_len].tolist()
    with pytest.raises(ValueError, match=rf"batch_size {windows + 1} exceeds the {windows} training windows"):
        data.batch(0, windows + 1, seq_len)


def test_token_dtype_and_ids_that_do_not_fit():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    ids, lengths = pack_chunk([[1, 2], [], [65535]], 0, np.dtype(np.uint16))
    assert ids.tolist() == [1, 2, 0, 0, 65535, 0] and lengths.tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match=r"token id 65536 does not fit the cache's uint16 ids"):
        pack_chunk([[1, 65536]], 0, np.dtype(np.uint16))


def test_refusals_name_the_value_and_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = Tokenizer(load_tokenizer(str(bpe_file(tmp_path))).backend, eos_token=END_OF_TEXT, source="t")

    def load(data, **options):
        return load_text_data(data, tokenizer=tokenizer, **options)

    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "a"}\n{"body": "b", "id": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"r.jsonl' line 2 has no field 'text' \(its fields: 'body', 'id'\); pass "
                                         r"--text-field"):
        load(str(records))
    records.write_text('{"text": "a"}\n["text"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 is a JSON list, not an object"):
        load(str(records))
    records.write_text('{"text": "a"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: field 'text' is a int, not a string"):
        load(str(records))
    pq.write_table(pa.table({"content": ["x", "y"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet' has no column 'text' \(its columns: 'content'\)"):
        load(str(tmp_path / "p.parquet"), cache_dir=tmp_path / "cache")
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet' row 1: column 'text' holds NoneType"):
        load(str(tmp_path / "n.parquet"))
    (tmp_path / "one.txt").write_text("a single document", encoding="utf-8")
    with pytest.raises(ValueError, match=r"one.txt .* holds 1 document; validation is split by documents"):
        load(str(tmp_path / "one.txt"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 text \(byte 3"):
        load(str(tmp_path / "latin1.txt"))
    (tmp_path / "data.json").write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.json': a JSON document is not read .* write it as JSONL"):
        load(str(tmp_path / "data.json"))
    with pytest.raises(ValueError, match=r"glob '.*\*.nothing' matches no file"):
        load(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match=r"--data '.*missing.txt': no such file or directory"):
        load(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"--text-field '' is empty"):
        load(str(records), text_field="")
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 0.5\), got 0.5"):
        load(str(records), val_fraction=0.5)
