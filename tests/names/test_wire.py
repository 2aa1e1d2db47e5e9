"""The wire table covers every torch dtype with a unique code that is the same in
every process (the in-band header once coded unknown dtypes with hash())."""

import json
import os
import subprocess
import sys

import pytest
import torch

from plait.comm import ops
from plait.comm.inband import CallSignature, describe_codes
from plait.names import wire
from plait.names.collectives import NO_OP, REDUCE_OPS

TORCH_DTYPES = sorted({wire.dtype_name(getattr(torch, name)) for name in dir(torch)
                       if isinstance(getattr(torch, name), torch.dtype)})
CARRIED = [name for name in TORCH_DTYPES if wire.BY_NAME[name].refused is None]

# what a fresh process computes: every dtype's header codes, as a broadcast's signature sends them
HEADER_CODES = """
import json, sys, torch
from plait.comm.inband import CallSignature
names = json.loads(sys.argv[1])
print(json.dumps({name: CallSignature("broadcast", "tree", 5, getattr(torch, name), "none", 0, 0, 1, 1).codes(3)
                  for name in names}))
"""


def test_every_torch_dtype_has_one_unique_code():
    assert len(TORCH_DTYPES) > 40  # every dtype torch has, aliases (torch.float, torch.half) folded
    missing = [name for name in TORCH_DTYPES if name not in wire.BY_NAME]
    assert not missing, f"add these dtypes to plait.names.wire.DTYPES: {missing}"
    codes = [entry.code for entry in wire.DTYPES]
    assert len(set(codes)) == len(codes) == len(wire.BY_NAME) == len(wire.BY_CODE)
    assert all(isinstance(code, int) and 0 <= code < 1 << 16 for code in codes)
    for name in TORCH_DTYPES:
        entry = wire.BY_NAME[name]
        assert wire.describe_dtype_code(entry.code) == name
        assert entry.itemsize == getattr(torch, name).itemsize, name
        if entry.refused is None:
            assert wire.dtype_code(getattr(torch, name)) == entry.code


def test_codes_are_the_ones_plait_always_sent():
    """The first twelve codes are what plait's headers carried before the table."""
    legacy = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
    assert [wire.dtype_code(dtype) for dtype in legacy] == list(range(12))
    assert wire.OP_CODES == {op: code for code, op in enumerate((NO_OP, *REDUCE_OPS))}
    assert wire.OP_CODES["none"] == 0 and wire.OP_CODES["bxor"] == 8


def test_header_codes_are_the_same_in_every_process():
    """Two fresh processes with different hash seeds code every carried dtype alike."""
    answers = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-c", HEADER_CODES, json.dumps(CARRIED)], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        answers.append(json.loads(out))
    assert answers[0] == answers[1]
    for name in CARRIED:
        codes = answers[0][name]
        assert codes[5] == wire.BY_NAME[name].code
        assert f"5 elements of {name}" in describe_codes(codes)


@pytest.mark.parametrize("name", [name for name in TORCH_DTYPES if wire.BY_NAME[name].refused is not None])
def test_a_dtype_plait_cannot_carry_is_refused_by_name(name):
    with pytest.raises(TypeError, match=f"broadcast cannot carry dtype {name}: .*(send|pack)"):
        ops.check_carried(getattr(torch, name), "broadcast")
    with pytest.raises(TypeError, match=name):
        CallSignature("broadcast", "tree", 5, getattr(torch, name), "none", 0, 0, 1, 1).codes(0)


def test_a_dtype_the_table_lacks_is_refused_by_name():
    with pytest.raises(TypeError, match="dtype float2_e1m1 has no code in plait's wire table.*uint8"):
        wire.dtype_code("torch.float2_e1m1", "all_gather")


def test_op_tables_come_from_the_wire_table():
    assert set(wire.OP_FAMILIES) == set(REDUCE_OPS) == set(ops.ALLOWED_DTYPES)
    assert ops.REDUCING_DTYPES == tuple(getattr(torch, e.name) for e in wire.DTYPES if e.family is not None)
    assert torch.uint16 not in ops.REDUCING_DTYPES and torch.float8_e4m3fn not in ops.REDUCING_DTYPES
    assert {wire.describe_op_code(code) for code in wire.OP_BY_CODE} == {NO_OP, *REDUCE_OPS}


def test_every_code_decodes_to_its_torch_dtype():
    """What the pipeline's and the evaluation's headers decode (comm.ops.dtype_from_code)."""
    for name in TORCH_DTYPES:
        assert ops.dtype_from_code(wire.BY_NAME[name].code) == getattr(torch, name)
    with pytest.raises(ValueError, match="dtype code 9999 is not in plait's wire table"):
        ops.dtype_from_code(9999)
