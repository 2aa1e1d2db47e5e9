"""The host model: the sharing of cores by ranks and the wait for the slowest rank.

- HostModel on 4 ranks x 1 thread on 2 cores against hand-computed share, time scale and
  waits (a measured group size's own terms; an unmeasured size through f(n) = (n-1)/(n+1));
  moving it to another rank count; bad values refused by name; the local cluster carries it.
- fit_sync_wait on synthetic rows built from known (a_n, b_n): exact without noise
  (float64: 1e-12 relative); with noise of at most eps on every rank's blocked time,
  within the least-squares bound (the estimate is linear in the waits: |da|, |db| <=
  eps * sum |w_i| over its weights w_i); a, b >= 0 enforced.
- Slow: plait.bench.sync_drift on 4 real ranks (the world and its two pairs): sane rows and
  a finite, non-negative fit.
"""

from __future__ import annotations

import math
import random

import pytest

from plait.bench.sync_drift import SyncDriftConfig, sync_drift_job
from plait.cost import LinkModel
from plait.plan import cluster_preset, device_preset
from plait.plan.host import HostModel, fit_sync_wait, lateness_factor, sharing
from plait.testing import run_distributed

MS = 1e-3


def _host_4_on_2() -> HostModel:
    return HostModel(ranks=4, cores=2, threads_per_rank=1, sync_wait_s=1.5 * MS, sync_wait_per_compute=0.06,
                     sync_group_size=4, sync_wait_by_size=((2, 0.75 * MS, 0.015), (4, 1.5 * MS, 0.06)))


def test_sharing_by_hand():
    host = _host_4_on_2()
    assert host.oversubscribed and host.spare_cores == 0
    assert host.share == 0.5  # 2 cores / (4 ranks x 1 thread)
    assert host.cpu_time_scale(4) == 1.0  # a 4-rank profile already holds the sharing
    assert host.cpu_time_scale(2) == 2.0  # measured 2 ranks alone on 2 cores (share 1): twice as long at 4
    assert host.cpu_time_scale(1, 2) == 2.0  # one rank of 2 threads had both cores too
    assert host.cpu_time_scale(8) == 0.5  # 8 ranks had a quarter core each
    assert sharing(3, 2) == 2 / 3 and sharing(1, 2) == 1.0
    threaded = HostModel(ranks=2, cores=2, threads_per_rank=2)  # 4 threads on 2 cores
    assert threaded.oversubscribed and threaded.share == 0.5 and threaded.cpu_time_scale(1) == 2.0
    quiet = HostModel(ranks=2, cores=4, threads_per_rank=1)
    assert not quiet.oversubscribed and quiet.spare_cores == 2 and quiet.share == 1.0


def test_wait_by_hand():
    host = _host_4_on_2()
    assert host.wait_s(1, 0.05) == 0.0  # one rank waits for nobody
    assert host.wait_s(4, 0.05) == pytest.approx(1.5 * MS + 0.06 * 0.05, rel=1e-12)  # 4.5 ms
    assert host.wait_s(2, 0.05) == pytest.approx(0.75 * MS + 0.015 * 0.05, rel=1e-12)  # 1.5 ms: its own terms
    # size 3 was not measured: the size-4 terms times f(3)/f(4) = (2/4)/(3/5) = 5/6
    assert lateness_factor(3) / lateness_factor(4) == pytest.approx(5 / 6, rel=1e-15)
    assert host.wait_s(3, 0.05) == pytest.approx(4.5 * MS * 5 / 6, rel=1e-12)  # 3.75 ms
    assert host.wait_s(4, 0.0) == 0.0 and host.wait_s(4, -1.0) == 0.0  # back-to-back: the link's price
    plain = HostModel(ranks=4, cores=2, sync_wait_s=1e-3, sync_wait_per_compute=0.1)  # n_ref: all 4 ranks
    assert plain.wait_s(2, 0.01) == pytest.approx(2e-3 * (1 / 3) / (3 / 5), rel=1e-12)


def test_for_ranks():
    host = _host_4_on_2()
    assert host.for_ranks(4) is host
    two = host.for_ranks(2)  # 2 ranks on 2 cores: not time-sliced, nothing to wait for
    assert (two.ranks, two.sync_wait_s, two.sync_wait_per_compute, two.sync_wait_by_size) == (2, 0.0, 0.0, ())
    assert two.wait_s(2, 1.0) == 0.0 and "not time-sliced" in two.source
    with pytest.raises(ValueError, match=r"for_ranks\(3\).*sync_drift --nprocs 3"):
        host.for_ranks(3)


def test_bad_values_named():
    with pytest.raises(ValueError, match=r"ranks=0 .*sync_wait_s=-1"):
        HostModel(ranks=0, cores=2, sync_wait_s=-1)
    with pytest.raises(ValueError, match=r"sync_group_size=8 > ranks=4"):
        HostModel(ranks=4, cores=2, sync_group_size=8)
    with pytest.raises(ValueError, match=r"sync_wait_by_size entry \(5, "):
        HostModel(ranks=4, cores=2, sync_wait_by_size=((5, 0.0, 0.0),))
    assert HostModel(ranks=4, cores=2, sync_wait_by_size=[[2, 1e-3, 0.0]]).sync_wait_by_size == ((2, 1e-3, 0.0),)
    with pytest.raises(ValueError, match=r"measured_ranks=0"):
        _host_4_on_2().cpu_time_scale(0)


def test_local_cluster_carries_the_host():
    device, link = device_preset("a100-80gb"), LinkModel(1e-5, 1e-9)
    host = _host_4_on_2()
    cluster = cluster_preset("local", nprocs=4, device=device, local_link=link, host=host)
    assert cluster.host is host and cluster.sync_wait_s(2, 0.05) == host.wait_s(2, 0.05)
    bare = cluster_preset("local", nprocs=4, device=device, local_link=link)
    assert bare.host is None and bare.sync_wait_s(4, 0.05) == 0.0
    with pytest.raises(ValueError, match=r"host.ranks=4 != nprocs=3"):
        cluster_preset("local", nprocs=3, device=device, local_link=link, host=host)
    with pytest.raises(ValueError, match=r"host= is for cluster 'local'"):
        cluster_preset("dgx-h100", gpus=8, host=host)


def test_p2p_call_cost():
    """A pipeline message pays n beta + its own fitted call cost (p2p_call_s, latency
    included: no alpha) when given, else alpha + n beta + a collective call's cost."""
    device, link = device_preset("a100-80gb"), LinkModel(1e-5, 1e-9)
    plain = cluster_preset("local", nprocs=2, device=device, local_link=link, call_overhead_s=4e-4)
    fitted = cluster_preset("local", nprocs=2, device=device, local_link=link, call_overhead_s=4e-4, p2p_call_s=3e-5)
    assert plain.p2p_time_s(1000, False) == pytest.approx(1e-5 + 1000 * 1e-9 + 4e-4, rel=1e-12)
    assert fitted.p2p_time_s(1000, False) == pytest.approx(1000 * 1e-9 + 3e-5, rel=1e-12)
    assert fitted.collective_time_s("all_reduce", 1000, 2, 1)[0] == plain.collective_time_s("all_reduce", 1000, 2, 1)[0]
    with pytest.raises(ValueError, match=r"p2p_call_s=-1"):
        cluster_preset("local", nprocs=2, device=device, local_link=link, p2p_call_s=-1)


# ---- the fit on synthetic rows -------------------------------------------------------

TRUTH = {2: (0.7 * MS, 0.015), 4: (1.5 * MS, 0.065)}  # size: (a_s, b)
SEGMENTS_S = (0.0, 1 * MS, 3 * MS, 10 * MS, 30 * MS)
SHARING_SLOWDOWN = 2.0  # 4 ranks on 2 cores: a segment's wall time, before the drawn jitter
LATENCY_S = {2: 1.5 * MS, 4: 2.8 * MS}


def _rows(noise_s: float, seed: int = 0) -> tuple[list[dict], dict]:
    """Rows of a 4-rank world, groups {0,1},{2,3} and {0..3}, as measure_sync_wait gives
    them: each rank's blocked time is latency + wait + its own offset (offsets of a group
    sum to zero: the group's mean is the wait) + a draw in [-noise, noise]; returns the
    rows and, per size, the group-mean points (x, noise of the mean) the fit sees."""
    draw = random.Random(seed)
    rows, noise_by_point = [], {}
    for size, groups in ((2, [(0, 1), (2, 3)]), (4, [(0, 1, 2, 3)])):
        a_s, b = TRUTH[size]
        for ranks in groups:
            for segment_s in SEGMENTS_S:
                work_s = [segment_s * SHARING_SLOWDOWN * (1 + 0.1 * draw.random()) for _ in ranks]
                x = sum(work_s) / len(ranks)
                wait_s = 0.0 if segment_s == 0 else a_s + b * x
                offsets = [0.4 * MS * (i - (len(ranks) - 1) / 2) for i in range(len(ranks))]
                jitter = [draw.uniform(-noise_s, noise_s) for _ in ranks]
                noise_by_point[(ranks, segment_s)] = sum(jitter) / len(ranks)
                for rank, work, offset, extra in zip(ranks, work_s, offsets, jitter):
                    rows.append({"group_size": size, "group_ranks": list(ranks), "world_size": 4, "rank": rank,
                                 "threads": 1, "repeats": 30, "segment_s": segment_s, "work_s": work,
                                 "work_cpu_s": segment_s, "blocked_s": LATENCY_S[size] + wait_s + offset + extra,
                                 "blocked_median_s": LATENCY_S[size] + wait_s})
    return rows, noise_by_point


def test_fit_exact_without_noise():
    fit = fit_sync_wait(_rows(0.0)[0])
    for size, (a_s, b) in TRUTH.items():
        assert fit.by_size[size][0] == pytest.approx(a_s, rel=1e-9, abs=1e-15)
        assert fit.by_size[size][1] == pytest.approx(b, rel=1e-9)
    # rounding only: sums of ~10 float64 terms of ~1e-3 s, and a 2x2 solve (condition ~1e3)
    assert fit.rms_residual_s < 1e-14
    assert (fit.sync_wait_s, fit.sync_wait_per_compute, fit.group_size) == (*fit.by_size[4], 4)
    assert fit.latency_s == pytest.approx(LATENCY_S, rel=1e-12)
    # the rows' wall time is 2x-2.2x their CPU time: the measured sharing
    assert all(SHARING_SLOWDOWN <= ratio <= 1.1 * SHARING_SLOWDOWN for ratio in fit.slowdown.values())
    assert sorted(fit.slowdown) == list(SEGMENTS_S[1:])
    host = fit.host(cores=2)
    assert host.wait_s(2, 0.05) == pytest.approx(TRUTH[2][0] + TRUTH[2][1] * 0.05, rel=1e-9)
    assert host.wait_s(4, 0.05) == pytest.approx(TRUTH[4][0] + TRUTH[4][1] * 0.05, rel=1e-9)


def test_fit_within_least_squares_bound_with_noise():
    """With each rank's blocked time off by at most eps, a group's mean wait is off by at
    most 2 eps (its own mean and the latency's); the least-squares estimate is linear in
    the waits, b = sum w_i y_i with w_i = (x_i - mean x) / Sxx, a = mean y - b mean x, so
    |db| <= 2 eps sum|w_i| and |da| <= 2 eps (1 + |mean x| sum|w_i|) (free fit, a, b > 0)."""
    eps = 0.2 * MS
    rows, _ = _rows(eps, seed=3)
    fit = fit_sync_wait(rows)
    for size, (a_s, b) in TRUTH.items():
        xs = [work for n, segment, work, *_ in fit.residuals if n == size]
        mean_x = sum(xs) / len(xs)
        sxx = sum((x - mean_x) ** 2 for x in xs)
        weights = sum(abs(x - mean_x) for x in xs) / sxx
        assert abs(fit.by_size[size][1] - b) <= 2 * eps * weights
        assert abs(fit.by_size[size][0] - a_s) <= 2 * eps * (1 + mean_x * weights)
        assert fit.by_size[size][1] != b  # the noise moved it: the bound was exercised
    assert 0 < fit.rms_residual_s <= 2 * eps


def test_fit_keeps_terms_non_negative():
    rows, _ = _rows(0.0)
    for row in rows:  # waits that shrink with compute: the free slope would be negative
        if row["segment_s"] > 0:
            row["blocked_s"] = LATENCY_S[row["group_size"]] + 2 * MS - 0.01 * row["work_s"]
    fit = fit_sync_wait(rows)
    for size in (2, 4):
        a_s, b = fit.by_size[size]
        assert b == 0.0 and a_s > 0  # the best flat line: the mean wait
        waits = [wait for n, _, _, wait, _ in fit.residuals if n == size]
        assert a_s == pytest.approx(sum(waits) / len(waits), rel=1e-12)


def test_fit_refuses_by_name():
    rows, _ = _rows(0.0)
    with pytest.raises(ValueError, match="no segment 0"):
        fit_sync_wait([row for row in rows if row["segment_s"] > 0])
    with pytest.raises(ValueError, match="< 2 distinct segments"):
        fit_sync_wait([row for row in rows if row["segment_s"] in (0.0, 1 * MS)])
    with pytest.raises(ValueError, match=r"every row has segment_s 0 .* at least two segments > 0"):
        fit_sync_wait([row for row in rows if row["segment_s"] == 0.0])
    with pytest.raises(ValueError, match=r"worlds \[3, 4\]"):
        fit_sync_wait(rows + [{**rows[0], "world_size": 3}])


# ---- the real measurement ------------------------------------------------------------

def _measure(rank, world_size):
    return sync_drift_job(SyncDriftConfig(segments_s=(0.0, 2 * MS, 6 * MS), repeats=6, rounds=2, group_sizes=(2, 4),
                                          transport=None, timeout_s=60.0))


@pytest.mark.slow
def test_measured_on_real_ranks():
    results = run_distributed(_measure, 4, timeout_s=90)
    rows = results[0]
    assert all(result == rows for result in results)  # every rank holds every rank's rows
    assert len(rows) == 2 * 4 * 3  # (world + pairs) x 4 ranks x 3 segments
    assert {tuple(row["group_ranks"]) for row in rows} == {(0, 1), (2, 3), (0, 1, 2, 3)}
    for row in rows:
        assert row["threads"] == 1 and row["world_size"] == 4 and row["repeats"] == 6
        assert row["blocked_s"] > 0 and row["blocked_median_s"] > 0
        if row["segment_s"] > 0:
            # the work is counted in CPU time: within 2x of the asked segment (the rate is
            # the best of three calibration passes), and wall time never below CPU time
            assert 0.5 * row["segment_s"] <= row["work_cpu_s"] <= 2 * row["segment_s"], row
            assert row["work_s"] >= row["work_cpu_s"] - 1e-4, row
    fit = fit_sync_wait(rows)
    for a_s, b in fit.by_size.values():
        assert math.isfinite(a_s) and math.isfinite(b) and a_s >= 0 and b >= 0
    assert fit.host(cores=2).wait_s(4, 0.01) >= 0
