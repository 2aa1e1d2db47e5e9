"""ActivationOffloader on one process: a float64 GPT with dropout gives bitwise the same
gradients with its saved tensors in files; what autograd holds in memory drops
(measured from live storages); a backward split in two passes (zero bubble) reads each
file once; every file is gone once the backward is done."""

import errno
import re
import subprocess

import pytest
import torch

from plait.models import GPT, GPTConfig
from plait.memory.offload import ActivationOffloader
from plait.memory.saved_memory import SavedTensorMeter

CONFIG = GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=67, dropout=0.1, dtype="float64")


def _run(directory=None, split=False, recompute="none"):
    model = GPT(CONFIG, seed=3)
    model.set_recompute(recompute)
    tokens = torch.randint(0, CONFIG.vocab, (4, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    meter = SavedTensorMeter(exclude=params)
    offloader = None
    if directory is not None:
        offloader = ActivationOffloader(directory, min_bytes=1024, on_loaded=meter.pack)
        offloader.keep_storages |= {param.untyped_storage().data_ptr() for param in params}

    def pack(tensor):  # composed as the engine composes them: offload first, meter what stays
        packed = offloader.pack(tensor) if offloader is not None else tensor
        return packed if not isinstance(packed, torch.Tensor) else meter.pack(packed)

    def unpack(packed):
        packed = offloader.unpack(packed) if offloader is not None else packed
        return packed if isinstance(packed, torch.Tensor) else meter.unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    if offloader is not None:
        offloader.end()  # as the engine does after each stage forward
        written_in_forward = offloader.stats["storages"]
    held_after_forward = meter.live_bytes
    if split:  # B (the embedding's output gradient only, graph kept) then W (the weights)
        torch.autograd.backward(loss, inputs=params[1:2], retain_graph=True)
        torch.autograd.backward(loss, inputs=[params[0], *params[2:]])
    else:
        loss.backward()
    if offloader is not None:
        offloader.close()
        offloader.stats["written_in_backward"] = offloader.stats["storages"] - written_in_forward
    return [param.grad.clone() for param in params], held_after_forward, offloader


def test_offloaded_gradients_are_bitwise_and_memory_drops(tmp_path):
    grads, held, _ = _run()
    got, held_offloaded, offloader = _run(tmp_path / "off")
    assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    assert offloader.stats["offloaded_bytes"] > 0.8 * held  # most of what autograd kept went to files
    assert held_offloaded < 0.2 * held  # and is no longer held in memory after the forward
    assert list((tmp_path / "off").iterdir()) == []  # every file deleted once its views died


def test_a_split_backward_reads_each_file_once(tmp_path):
    grads, _, _ = _run(split=True)
    got, _, offloader = _run(tmp_path / "off", split=True)
    assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    stats = offloader.stats
    assert stats["late"] == stats["storages"]  # nothing was prefetched here: each storage read on demand, once
    assert list((tmp_path / "off").iterdir()) == []


def test_a_recompute_in_the_backward_stays_in_memory(tmp_path):
    """Full recomputation: the forward offloads each block's kept input; the tensors the
    backward regenerates are needed at once, so none of them is written to a file (and
    none is left held by the offloader: the gradients are bitwise, the files all gone)."""
    grads, _, _ = _run(recompute="full")
    got, _, offloader = _run(tmp_path / "off", recompute="full")
    assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    assert offloader.stats["storages"] > 0 and offloader.stats["written_in_backward"] == 0
    assert list((tmp_path / "off").iterdir()) == []


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def tiny_disk(small_tmpfs):
    """A 1 MiB tmpfs: a real filesystem that fills up."""
    return small_tmpfs("1m")


def test_a_full_disk_names_the_offload_file_and_its_bytes(tiny_disk):
    """Before: a bare "OSError: [Errno 28] No space left on device" from the pack hook,
    no path. Now: the checkpoint's message (plait.errors.DiskFull): the file, the bytes
    it needs, the bytes free; the part written is removed. A real 1 MiB tmpfs, a 2 MiB
    activation: nothing of plait's is simulated."""
    directory = tiny_disk / "offload"
    offloader = ActivationOffloader(directory, min_bytes=1024)
    weight = torch.ones(512, 512, dtype=torch.float64, requires_grad=True)  # 2 MiB: saved for the backward
    inputs = torch.ones(512, 512, dtype=torch.float64, requires_grad=True)
    offloader.begin((0, 0))
    with pytest.raises(OSError) as full, torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        (inputs * weight).sum()
    offloader.close()
    assert full.value.errno == errno.ENOSPC
    message = str(full.value)
    nbytes = 512 * 512 * 8
    assert f"no space left on device writing {directory / '0.bin'}: it needs about {nbytes:,} bytes" in message, \
        message
    assert "bytes are free there" in message and "offload" in message
    assert list(directory.iterdir()) == []  # the partial file is gone


def test_an_offload_directory_that_cannot_be_written_is_named(tiny_disk):
    """A read-only filesystem (root ignores permission bits, not a read-only mount): the
    error names the file it could not create."""
    directory = tiny_disk / "offload"
    directory.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    offloader = ActivationOffloader(directory, min_bytes=1024)
    offloader.begin((0, 0))
    weight = torch.ones(64, 64, dtype=torch.float64, requires_grad=True)
    with pytest.raises(OSError, match=re.escape(str(directory / "0.bin"))) as refused, \
            torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        (weight * weight).sum()
    offloader.close()
    assert refused.value.errno == errno.EROFS
