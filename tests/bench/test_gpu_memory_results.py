"""plait's activation formula against the memory measured on a GPU (issue 22).

bench/gpu/results/ holds `plait bench memory` summaries measured on an H200 (plait
train, dp2 x pp2, 4 processes sharing the GPU over gloo). Each run is re-priced here
by the formula as it is now, for the device it ran on (CUDA autocast keeps the
attention probabilities in float32 and 16 bits: plait.plan.precision). Without
recomputation, and with selective recomputation without offload, the formula counts
every saved tensor, so it must equal the measurement to the byte; full recomputation
and offload are held to the bench's own 10% (their working sets are priced as one
whole block, which the measurement's peak need not reach).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "results"
SUMMARIES = ["run2-memory.json", "run3-memory4.json", "run3-memory4-fp32.json"]
MIB = 1 << 20


def _memory_table():
    spec = importlib.util.spec_from_file_location("memory_table", RESULTS.parent / "memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows():
    table = _memory_table()
    vocab = table.corpus_vocab()
    return [row for name in SUMMARIES for row in table.rows_of(str(RESULTS / name), vocab)]


def test_the_h200_measurements_are_priced_by_the_cuda_formula(rows):
    assert len(rows) == 13
    for row in rows:
        where = f"{row['file']}: {row['recompute']} {row['precision']} offload={row['offload']}"
        # the measured state also holds AdamW's one-element float32 `step` per parameter
        # tensor (4 bytes each, a few dozen tensors), which the per-element formula leaves out
        assert 0 <= (row["state_measured_mib"] - row["state_predicted_mib"]) * MIB <= 4096, where
        if row["recompute"] in ("none", "selective") and not row["offload"]:
            assert row["predicted_mib"] == row["measured_mib"], where
        else:
            assert abs(row["predicted_mib"] / row["measured_mib"] - 1) <= 0.10, where
