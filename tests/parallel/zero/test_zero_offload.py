"""ZeRO with optimizer-state offload to memory-mapped files (offload="disk"), on real
gloo ranks: training is bitwise the training without offload (the same operations on
the same values, one unit at a time), sharded checkpoints round-trip, the state is
really in files and out of the process after a step (read from the kernel's
/proc/self/smaps, not from the offloader's bookkeeping), nothing is left on disk, and
bad settings are named."""

import os
import tempfile

import pytest
import torch

from plait.parallel.zero.module import ZeRO
from plait.testing import run_distributed

from tests.parallel.zero.test_zero import TiedNet, _data, _loss, _model, _optimizer

STEPS = 3


def _train(rank, world_size, stage, offload, directory, resume_at=None):
    """STEPS steps with clipping and 2-way accumulation; with ``resume_at`` the wrapper
    is rebuilt from its sharded state dict after that many steps."""

    def build():
        return ZeRO(_model(), _optimizer, stage=stage, offload=offload, offload_dir=directory, bucket_mb=0.001)

    zero = build()
    resident, leftovers = [], []
    for step in range(STEPS):
        if step == resume_at:
            state = zero.local_state_dict()
            zero = build()
            zero.load_local_state_dict(state)
        tokens, targets = _data(step)
        mine = slice(rank * 6, rank * 6 + 6)
        with zero.no_sync():
            (_loss(zero, tokens[mine][:3], targets[mine][:3]) / 2).backward()
        (_loss(zero, tokens[mine][3:], targets[mine][3:]) / 2).backward()
        zero.clip_grad_norm_(0.5)
        zero.step()
        zero.zero_grad()
        if offload:
            resident.append(zero.offload.resident_bytes())
            leftovers.append(sorted(os.listdir(directory)))
    where = []
    if offload:  # which mappings hold the state, from the kernel's list of this process's mappings
        pointers = [value.untyped_storage().data_ptr() for entry in zero.optimizer.state.values()
                    for value in entry.values() if value.dim() > 0]
        where = [_mapping_name(pointer) for pointer in pointers]
    return {"state": zero.full_state_dict(), "memory": zero.model_state_bytes(), "resident": resident,
            "leftovers": leftovers, "where": where, "units": [unit.padded * 8 for unit in zero.units]}


def _mapping_name(pointer: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if low <= pointer < high:
                return fields[5].strip() if len(fields) > 5 else "[anonymous]"
    return "[not mapped]"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_disk_offload_trains_bitwise_as_without(stage):
    with tempfile.TemporaryDirectory() as directory:
        plain = run_distributed(_train, 2, stage, None, None)
        offloaded = run_distributed(_train, 2, stage, "disk", directory)
        resumed = run_distributed(_train, 2, stage, "disk", directory, 1)
        left = os.listdir(directory)
    assert left == []
    for want, got, again in zip(plain, offloaded, resumed):
        for name, value in want["state"].items():
            assert torch.equal(got["state"][name], value), name
            assert torch.equal(again["state"][name], value), name


@pytest.mark.slow
def test_disk_offload_keeps_the_state_in_files_out_of_the_process():
    """After each step: no page of the state files resident in the process (smaps Rss
    0), every state tensor in a mapping of a deleted file named by the offloader (the
    file is unlinked once mapped: the directory stays empty), the state's bytes 2Ψ/N
    (Adam's two moments of this rank's shards) and only the scalar step counts left
    in memory."""
    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_train, 2, 2, "disk", directory)
    for result in results:
        psi = sum(result["units"])
        assert result["resident"] == [0] * STEPS
        assert result["leftovers"] == [[]] * STEPS
        assert result["where"] and all("plait-optimizer-state-" in name and name.endswith("(deleted)")
                                       for name in result["where"])
        assert result["memory"]["offloaded_bytes"] == 2 * psi // 2
        assert result["memory"]["optimizer_bytes"] <= 8 * len(result["units"])  # the step counts


def _bad_offload(rank, world_size):
    errors = []
    for kwargs in ({"offload": "gpu"}, {"offload": "cpu"}, {"offload": "disk", "offload_dir": "/nonexistent/plait"}):
        try:
            ZeRO(TiedNet().double(), _optimizer, stage=1, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.mark.slow
def test_bad_offload_settings_are_named():
    errors = run_distributed(_bad_offload, 2)[0]
    assert "offload='gpu' must be None, 'cpu' or 'disk'" in errors[0]
    assert "already in host memory: use offload='disk'" in errors[1]
    assert "offload_dir='/nonexistent/plait' is not a directory" in errors[2]
