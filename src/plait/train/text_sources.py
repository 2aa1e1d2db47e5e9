"""The files behind ``plait train --data`` and the documents in each, read from local
files only.

``--data`` entries: a file, a directory (every regular, non-hidden file under it,
sorted by relative path; a ``datasets`` ``save_to_disk`` directory: its Arrow shards)
or a glob (``*``, ``?``, ``[``; ``**`` recursive; sorted). Entries keep their order; a
file named twice is read once. A file's format is its suffix:

- ``.jsonl`` / ``.ndjson``: one JSON object per non-blank line, the document is its
  ``text_field`` (a string); a line without it, or not an object, is refused by line.
- ``.parquet``: ``datasets.load_dataset("parquet", data_files=...)``, offline
  (``DownloadConfig(local_files_only=True)``), its Arrow cache inside our cache
  directory (a temporary one when there is none); one document per row.
- ``.arrow``: ``datasets.Dataset.from_file`` (the Arrow stream ``datasets`` writes), or
  the Arrow IPC file format (pyarrow's ``ipc.new_file``, Feather v2); one row each.
- ``.json``, compressed files: refused (convert to JSONL / decompress).
- anything else is UTF-8 plain text (a BOM dropped), **one document per file**: a
  file is the natural unit of a book, an article or a source file (splitting on blank
  lines would cut code into pieces). Non-UTF-8 bytes are refused by file and offset.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})
ARROW_SUFFIXES = frozenset({".arrow"})
REFUSED_SUFFIXES = {
    ".json": "a JSON document is not read (one record per line is): write it as JSONL (.jsonl)",
    ".gz": "compressed files are not read: decompress it", ".bz2": "compressed files are not read: decompress it",
    ".xz": "compressed files are not read: decompress it", ".zst": "compressed files are not read: decompress it",
    ".zip": "archives are not read: extract it",
}
GLOB_CHARACTERS = frozenset("*?[")
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")  # what datasets' save_to_disk writes
HASH_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True, kw_only=True)
class DataFile:
    """One file of the data and how it is read: "text", "jsonl", "parquet" or "arrow"."""

    path: Path
    format: str


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in REFUSED_SUFFIXES:
        raise ValueError(f"--data file {str(path)!r}: {REFUSED_SUFFIXES[suffix]}, or leave it out of --data")
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in ARROW_SUFFIXES:
        return "arrow"
    return "text"


def _saved_dataset_shards(directory: Path) -> list[Path] | None:
    """The Arrow shards of a ``save_to_disk`` directory (state.json's order), or None."""
    if not all((directory / name).is_file() for name in SAVED_DATASET_FILES):
        return None
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--data directory {str(directory)!r} looks like a datasets save_to_disk directory but "
                         f"its state.json is unreadable ({error}); save it again or pass its .arrow files") from None
    shards = [directory / name for name in names]
    if not names or any(Path(name).name != name or not path.is_file() for name, path in zip(names, shards)):
        raise ValueError(f"--data directory {str(directory)!r}: state.json lists shards {names} that are not "
                         f"files in it; save it again with Dataset.save_to_disk or pass its .arrow files")
    return shards


def _directory_files(directory: Path) -> list[Path]:
    shards = _saved_dataset_shards(directory)
    if shards is not None:
        return shards
    found = []
    for parent, subdirs, names in os.walk(directory):
        subdirs[:] = sorted(name for name in subdirs if not name.startswith("."))
        for name in names:
            path = Path(parent) / name
            if not name.startswith(".") and path.is_file():
                found.append(path)
    return sorted(found, key=lambda path: path.relative_to(directory).as_posix())


def resolve_data(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[DataFile]:
    """The files of ``--data`` entries (a path, or a list of them) in reading order,
    each with its format; no entry, or one naming nothing, is refused by name."""
    entries = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not entries:
        raise ValueError("--data names no files; pass text/JSONL/Parquet/Arrow files, a directory or a glob")
    files, seen = [], set()
    for entry in entries:
        text = os.fspath(entry)
        path = Path(text).expanduser()
        if any(character in GLOB_CHARACTERS for character in text) and not path.exists():
            matches = sorted(Path(match) for match in glob.glob(os.path.expanduser(text), recursive=True))
            paths = [match for match in matches if match.is_file()]
            if not paths:
                raise ValueError(f"--data glob {text!r} matches no file; check the pattern (use ** to recurse)")
        elif path.is_dir():
            paths = _directory_files(path)
            if not paths:
                raise ValueError(f"--data directory {text!r} holds no (non-hidden) files; pass a directory with "
                                 f"text, JSONL, Parquet or Arrow files")
        elif path.is_file():
            paths = [path]
        else:
            raise ValueError(f"--data {text!r}: no such file or directory; pass text/JSONL/Parquet/Arrow files, a "
                             f"directory or a glob")
        for found in paths:
            key = found.resolve()
            if key not in seen:
                seen.add(key)
                files.append(DataFile(path=found, format=_file_format(found)))
    return files


def content_digest(path: Path) -> str:
    """sha256 hex of a file's bytes (the token cache's key: content, not mtime)."""
    hasher = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


# --------------------------------------------------------------------------- documents

def _text_documents(path: Path) -> list[str]:
    raw = path.read_bytes()
    try:
        return [raw.decode("utf-8-sig")]
    except UnicodeDecodeError as error:
        raise ValueError(f"--data file {str(path)!r} is not UTF-8 text (byte {error.start}: "
                         f"{raw[error.start:error.start + 1]!r}); convert it to UTF-8 or leave it out") from None


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    documents = []
    with open(path, encoding="utf-8-sig") as stream:
        try:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                where = f"--data {str(path)!r} line {number}"
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise ValueError(f"{where} is not JSON ({error}); write one JSON object per line") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object; write one object "
                                     f"per line with a {text_field!r} field")
                if text_field not in record:
                    keys = ", ".join(repr(key) for key in list(record)[:8]) or "none"
                    raise ValueError(f"{where} has no field {text_field!r} (its fields: {keys}); pass "
                                     f"--text-field with the field holding the text, or drop the record")
                value = record[text_field]
                if not isinstance(value, str):
                    raise ValueError(f"{where}: field {text_field!r} is a {type(value).__name__}, not a string; "
                                     f"pass --text-field naming a text field")
                documents.append(value)
        except UnicodeDecodeError as error:
            raise ValueError(f"--data {str(path)!r} is not UTF-8 ({error.reason} at byte {error.start} of a "
                             f"chunk); convert it to UTF-8") from None
    return documents


def _column_documents(dataset, path: Path, text_field: str) -> list[str]:
    """The ``text_field`` column of a ``datasets.Dataset`` as strings; refused by name."""
    if text_field not in dataset.column_names:
        columns = ", ".join(repr(name) for name in dataset.column_names[:8])
        raise ValueError(f"--data {str(path)!r} has no column {text_field!r} (its columns: {columns}); pass "
                         f"--text-field with the column holding the text")
    values = list(dataset[text_field])
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"--data {str(path)!r} row {row}: column {text_field!r} holds "
                             f"{type(value).__name__} {value!r:.40}, not a string; fill or drop the row, or pass "
                             f"--text-field naming a text column")
    return values


def _datasets_module(path: Path):
    """(datasets, pyarrow), or a one-line error naming the fix."""
    # datasets (with pyarrow, its dependency) is the optional extra `hf` and takes ~1 s to
    # import: only for Parquet / Arrow files.
    try:
        import datasets
        import pyarrow.ipc
    except ImportError:
        raise ValueError(f"--data {str(path)!r} is read with the datasets library, which is not installed; "
                         f"pip install 'plait[hf]' or convert it to JSONL") from None
    return datasets, pyarrow


def _parquet_documents(path: Path, text_field: str, hf_cache_dir: Path) -> list[str]:
    datasets, _ = _datasets_module(path)
    download = datasets.DownloadConfig(local_files_only=True, cache_dir=str(hf_cache_dir), disable_tqdm=True)
    try:
        dataset = datasets.load_dataset("parquet", data_files=[str(path.resolve())], split="train",
                                        cache_dir=str(hf_cache_dir), download_config=download)
    except (OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"--data {str(path)!r} is not a Parquet file datasets reads ({first_line}); check the "
                         f"file or rename it if it is not Parquet") from None
    return _column_documents(dataset, path, text_field)


def _arrow_documents(path: Path, text_field: str) -> list[str]:
    datasets, pyarrow = _datasets_module(path)
    try:
        dataset = datasets.Dataset.from_file(str(path))
    except pyarrow.ArrowInvalid:
        try:  # not the stream format datasets writes: the Arrow IPC file format (Feather v2)?
            with pyarrow.memory_map(str(path)) as source:
                dataset = datasets.Dataset(pyarrow.ipc.open_file(source).read_all())
        except pyarrow.ArrowInvalid as error:
            raise ValueError(f"--data {str(path)!r} is neither an Arrow stream (datasets) nor an Arrow IPC "
                             f"file ({error}); check the file or rename it if it is not Arrow") from None
    return _column_documents(dataset, path, text_field)


def iter_documents(files: Sequence[DataFile], text_field: str = "text",
                   hf_cache_dir: str | os.PathLike | None = None) -> Iterator[tuple[DataFile, list[str]]]:
    """(file, its documents) for each file in order. ``hf_cache_dir``: where ``datasets``
    writes its Arrow copy of a Parquet file (our cache directory's subdirectory; None:
    a temporary directory, removed afterwards). Never touches the network."""
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"--text-field {text_field!r} is empty; name the JSONL field / column holding the text, "
                         f"e.g. text")
    with ExitStack() as stack:
        cache = Path(hf_cache_dir) if hf_cache_dir is not None else None
        for data_file in files:
            if data_file.format == "text":
                documents = _text_documents(data_file.path)
            elif data_file.format == "jsonl":
                documents = _jsonl_documents(data_file.path, text_field)
            elif data_file.format == "parquet":
                if cache is None:
                    cache = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="plait-hf-datasets-")))
                documents = _parquet_documents(data_file.path, text_field, cache)
            else:
                documents = _arrow_documents(data_file.path, text_field)
            yield data_file, documents
