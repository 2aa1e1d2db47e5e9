"""Optimizer-state offload for ZeRO: a rank's optimizer state (Adam's two moments, 8
bytes a parameter in float32 against the 4 of the parameter itself) kept in
memory-mapped files between steps rather than in the process's memory.

``StateFiles(directory)`` is ZeRO's ``offload="disk"``. The optimizer creates its state
as it always does, in memory, at the first step that has a gradient for a shard; right
after that step every state tensor shaped like the shard moves into a file of its own
under ``directory`` and the optimizer updates it in place there from then on: the step
runs where the state lives, on the CPU. Each file is unlinked as soon as it is mapped,
so nothing is left on disk whatever ends the process (the mapping keeps the data).

Per step: when the backward starts, ``prefetch()`` asks the kernel to read every
state page in (``madvise(WILLNEED)``), so the reads overlap the backward; the shards
are then stepped one unit at a time and each unit's pages are written back
(``msync``) and dropped from the process (``madvise(DONTNEED)``, which on a shared file
mapping keeps the data in the file) before the next unit's step. Between steps the
state is in the files (the kernel's page cache may keep copies while memory is free;
those pages are reclaimable, not the process's), and during the step only one unit's
state is resident at a time.

The directory should be on a disk: on a tmpfs (``/dev/shm``) the "files" are memory.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import torch


class StateFiles:
    """Shard-shaped optimizer state in unlinked memory-mapped files under ``directory``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"offload_dir={str(directory)!r} is not a directory; create it or give another "
                             "(it should be on a disk, not a tmpfs)")
        self._maps: dict[int, mmap.mmap] = {}  # data_ptr of a mapped tensor -> its mapping

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._maps

    def _mapped(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor in a new file-backed mapping holding ``tensor``'s values."""
        nbytes = tensor.numel() * tensor.element_size()
        path = self.directory / f"plait-optimizer-state-{os.getpid()}-{uuid.uuid4().hex}"
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(descriptor, nbytes)
            mapping = mmap.mmap(descriptor, nbytes)  # MAP_SHARED: writes go to the file
        finally:
            os.close(descriptor)
            os.unlink(path)
        mapped = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
        mapped.copy_(tensor)
        self._maps[mapped.untyped_storage().data_ptr()] = mapping
        return mapped

    def adopt(self, state: dict, shard: torch.Tensor) -> None:
        """Move ``shard``'s state tensors that are still in memory into files, then write
        its files back and drop their pages from the process."""
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.shape == shard.shape and value.numel() and not self.owns(value):
                state[key] = self._mapped(value)
        for value in state.values():
            if torch.is_tensor(value) and self.owns(value):
                mapping = self._maps[value.untyped_storage().data_ptr()]
                mapping.flush()
                mapping.madvise(mmap.MADV_DONTNEED)

    def prefetch(self) -> None:
        """Ask the kernel to read every state page back in, in the background."""
        for mapping in self._maps.values():
            mapping.madvise(mmap.MADV_WILLNEED)

    def forget(self, live: list[torch.Tensor]) -> None:
        """Drop mappings no state tensor in ``live`` uses any more (the state was replaced,
        e.g. by ``load_state_dict``); their memory goes when the tensors do."""
        keep = {tensor.untyped_storage().data_ptr() for tensor in live if torch.is_tensor(tensor)}
        for pointer in [pointer for pointer in self._maps if pointer not in keep]:
            del self._maps[pointer]

    def resident_bytes(self) -> int:
        """Bytes of the state files' pages now in this process's memory, from the kernel
        (``/proc/self/smaps``), not from what this class did."""
        starts = {pointer: len(mapping) for pointer, mapping in self._maps.items()}
        total = 0
        current = None
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(part, 16) for part in head.split("-"))
                    current = any(low <= pointer < high for pointer in starts)
                elif current and head == "Rss:":
                    total += int(line.split()[1]) * 1024
        return total

    def file_bytes(self) -> int:
        return sum(len(mapping) for mapping in self._maps.values())
