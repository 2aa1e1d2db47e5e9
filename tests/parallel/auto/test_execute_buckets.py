"""The gradient buckets' assignment (plait.parallel.auto.grad_buckets): one dtype, device
and set of mesh axes per bucket, in the given order (the same on every rank), cut at the
cap (DDP's smaller cap for bucket 0), a parameter over the cap alone; bad caps refused by
name. Exactness and the all-reduce counts are checked on real ranks in test_execute.py
(MLP batch: one bucket, 3 all-reduces per step) and test_execute_gpt2.py (two backward
passes per step over 4 KiB buckets, the tied embedding)."""

import pytest
import torch


def test_buckets_group_by_axes_and_dtype_and_cut_at_the_caps():
    from plait.parallel.auto.grad_buckets import assign_grad_buckets

    f64, f32 = torch.float64, torch.float32
    entries = [("a", torch.zeros(100, dtype=f64), (0,)),  # 800 B: bucket 0 (first cap 1000 B)
               ("b", torch.zeros(100, dtype=f64), (0,)),  # 1600 B would pass the first cap: bucket 1
               ("c", torch.zeros(200, dtype=f64), (0,)),  # 800 + 1600 > 2000: bucket 2
               ("d", torch.zeros(50, dtype=f32), (0,)),  # another dtype: bucket 3
               ("e", torch.zeros(10, dtype=f64), (0, 1)),  # other axes: bucket 4
               ("f", torch.zeros(300, dtype=f64), (0,)),  # 2400 B, over the cap: alone, bucket 5
               ("g", torch.zeros(10, dtype=f64), (0, 1)),  # joins e's bucket (its group's open one)
               ("h", torch.zeros(10, dtype=f64), (0,))]  # f's bucket is full: bucket 6
    assert assign_grad_buckets(entries, 2000, first_cap_bytes=1000) == [[0], [1], [2], [3], [4, 6], [5], [7]]
    assert assign_grad_buckets(entries, 1 << 20) == [[0, 1, 2, 5, 7], [3], [4, 6]]  # one per group
    with pytest.raises(ValueError, match="bucket cap 0 must be a whole number of bytes > 0"):
        assign_grad_buckets(entries, 0)


def test_a_bad_bucket_cap_is_refused_before_any_group():
    import sys
    from pathlib import Path

    from plait.parallel.auto.device_mesh import AutoMesh
    from plait.parallel.auto.execute import auto_parallelize

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_execute import _batch, _layouts, _mlp, mlp_plans

    with pytest.raises(ValueError, match=r"bucket_cap_mb=0 must be a finite number of MiB > 0 \(DDP's is 25\)"):
        auto_parallelize(_mlp(), _batch(0), _layouts(mlp_plans(1)["batch"], 1), AutoMesh((2,)), simplify=False,
                         bucket_cap_mb=0)
