"""ActivationOffloader's writes off the forward's thread (plait.memory.offload): each
file's bytes are written by the writer thread while the forward goes on, the gradients
bitwise those without offload; end() waits for the writer down to ``max_pending_bytes``
(0: everything written); a saved tensor written in place after it was offloaded is
refused by name at its read (autograd's own check, which saved-tensor hooks bypass)."""

import threading

import pytest
import torch

from plait.memory.offload import ActivationOffloader


def _gradient(offloader: ActivationOffloader | None):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, dtype=torch.float64, generator=generator, requires_grad=True)
    inputs = torch.randn(256, 256, dtype=torch.float64, generator=generator)
    records = []

    def pack(tensor):
        packed = offloader.pack(tensor)
        if not isinstance(packed, torch.Tensor):
            records.append(packed.stored)
        return packed

    if offloader is None:
        ((inputs @ weight).tanh() @ weight).sin().sum().backward()
        return weight.grad, records
    offloader.begin((0, 0))
    with torch.autograd.graph.saved_tensors_hooks(pack, offloader.unpack):
        loss = ((inputs @ weight).tanh() @ weight).sin().sum()
    offloader.end()
    assert len(records) >= 3 and all(stored.written.is_set() for stored in records)  # end(): nothing pending
    loss.backward()
    return weight.grad, records


def test_writes_leave_the_forward_thread_and_end_bounds_what_is_pending(tmp_path):
    offloader = ActivationOffloader(tmp_path, min_bytes=1024, max_pending_bytes=0)
    grad, records = _gradient(offloader)
    assert {stored.writer for stored in records} == {offloader._writer.ident} != {threading.get_ident()}
    offloader.close()
    assert torch.equal(grad, _gradient(None)[0])
    del records  # the last holders of the records: their files go
    assert offloader._pending_bytes == 0 and list(tmp_path.iterdir()) == []


def test_a_saved_tensor_written_in_place_after_its_offload_is_named(tmp_path):
    offloader = ActivationOffloader(tmp_path, min_bytes=1024, max_pending_bytes=0)
    inputs = torch.randn(256, 256, dtype=torch.float64, requires_grad=True)
    offloader.begin((0, 0))
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        hidden = inputs * 2
        out = hidden.sin()  # saves hidden
        with torch.no_grad():
            hidden.mul_(3)
    offloader.end()
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        out.sum().backward()
    offloader.close()
