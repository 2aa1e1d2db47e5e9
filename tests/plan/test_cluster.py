"""The planner's cluster at any size: group footprints from one group per residue equal
a walk over every group, bounded memory at 16M devices, a bounded cache, and clusters
beyond the limit refused."""

from __future__ import annotations

import tracemalloc

import pytest

from plait.cost import LinkModel
from plait.cost.transport_model import TransportModel
from plait.plan import cluster_preset, device_preset
from plait.plan.cluster import MAX_DEVICES, Cluster

LINK = LinkModel(1e-6, 1e-10)


def _cluster(nodes: int, per_node: int) -> Cluster:
    return Cluster(name="unit", nodes=nodes, devices_per_node=per_node, device=device_preset("a100-80gb"),
                   intra_link=LINK, inter_link=LINK)


def _walk_every_group(world: int, slots: int, size: int, stride: int) -> tuple[int, int, int]:
    """(size, per_node, nodes) of the worst group, walking every group's every rank."""
    if size == 1:
        return 1, 1, 1
    worst = (size, size, 1)
    if size * stride <= world and world % (size * stride) == 0:
        bases = [block + offset for block in range(0, world, size * stride) for offset in range(stride)]
    else:
        bases = [0]
    for base in bases:
        counts: dict[int, int] = {}
        for i in range(size):
            node = (base + i * stride) // slots
            counts[node] = counts.get(node, 0) + 1
        even = len(set(counts.values())) == 1
        shape = (size, min(counts.values()) if even else 1, len(counts))
        if (shape[2], -shape[1]) > (worst[2], -worst[1]):
            worst = shape
    return worst


def test_group_shapes_equal_a_walk_over_every_group():
    """One group per base residue modulo the node size, each counted in O(node size),
    gives the footprint the walk over every rank of every group gives: tilings and
    non-tilings, strides below, at and above the node size, uneven spreads."""
    for slots in (1, 2, 3, 8, 12):
        for nodes in range(1, 10):
            world = slots * nodes
            cluster = _cluster(nodes, slots)
            for size in range(1, world + 2):
                for stride in range(1, world + 2):
                    shape = cluster.group_shape(size, stride)
                    assert (shape.size, shape.per_node, shape.nodes) == _walk_every_group(world, slots, size, stride), \
                        (slots, nodes, size, stride)


def test_group_shapes_of_sixteen_million_devices_take_little_memory():
    """The footprint of the groups of a 2^24-device cluster is found without listing
    the 2^23 groups (which took hundreds of MB and ~10 s per shape)."""
    cluster = _cluster(MAX_DEVICES // 8, 8)
    tracemalloc.start()
    try:
        pairs = cluster.group_shape(2, 1)        # tp=2: inside a node
        strided = cluster.group_shape(4, 3)      # not a tiling of 2^24: the first group
        data = cluster.group_shape(1 << 20, 4)   # dp over tp=4: 2 per node on 2^19 nodes
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20, peak_bytes
    assert (pairs.per_node, pairs.nodes) == (2, 1)
    assert (strided.per_node, strided.nodes) == (1, 2)  # ranks 0, 3, 6 | 9: 3 + 1, uneven
    assert (data.per_node, data.nodes) == (2, 1 << 19)


def test_the_collective_price_cache_is_bounded():
    """A search prices many group sizes and byte counts; one cluster keeps at most
    16,384 of them (oldest out first), and an evicted price is recomputed the same."""
    cluster = cluster_preset("dgx-a100", gpus=64)
    first = cluster.collective_time_s("all_reduce", float(1 << 21), 8, 8)
    for k in range(17_000):
        cluster.collective_time_s("all_reduce", float((1 << 21) + k + 1), 8, 8)
    assert len(cluster._cache) <= 1 << 14
    assert ("all_reduce", float(1 << 21), 8, 8) not in cluster._cache
    assert cluster.collective_time_s("all_reduce", float(1 << 21), 8, 8) == first


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus=1 << 30), "gpus=1,073,741,824 is above the limit of 16,777,216"),
    (dict(nodes=1 << 28), r"nodes=268,435,456 is above the limit of 2,097,152 \(16,777,216 devices\)"),
])
def test_clusters_beyond_the_limit_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cluster_preset("dgx-a100", **kwargs)
    with pytest.raises(ValueError, match=r"nodes\(4,194,304\) \* devices_per_node\(8\) = 33,554,432 devices is "
                                         "above the limit of 16,777,216"):
        _cluster(1 << 22, 8)


def test_a_fitted_transport_prices_collectives_and_messages_within_a_host():
    """With the profile's transport model (format 2) a local cluster prices an all_reduce
    as call_s[all_reduce] + the cheapest closed form on the link at beta(n), and a
    pipeline message as call_s[p2p] + n beta(n) (no alpha); without one, the flat link
    and the mean call cost as before. Hand formulas, float64: rel 1e-12."""
    transport = TransportModel(alpha_s=5e-6, beta_cache_s_per_byte=1e-10, beta_dram_s_per_byte=4e-10,
                               cache_bytes=1e5, gamma_s_per_byte=2e-10, base_call_s=2e-5,
                               call_s={"all_reduce": 3e-5, "all_gather": 7e-5, "p2p": 1e-5})
    device, link = device_preset("a100-80gb"), LinkModel(1e-5, 1e-9)
    fitted = cluster_preset("local", nprocs=2, device=device, local_link=link, call_overhead_s=4e-4,
                            p2p_call_s=1e-5, transport=transport)
    flat = cluster_preset("local", nprocs=2, device=device, local_link=link, call_overhead_s=4e-4, p2p_call_s=1e-5)
    n = 1e5
    beta = 1e-10 + (4e-10 - 1e-10) * n / (1e5 + n)  # 2.5e-10 s/byte: half in cache
    a, g = 5e-6, 2e-10
    # p = 2: direct / recursive doubling (a + n b + n g) or ring / halving-doubling (2a + n b + n g / 2)
    expected = 3e-5 + min(a + n * beta + n * g, 2 * a + n * beta + n * g / 2)
    assert fitted.collective_time_s("all_reduce", n, 2, 1)[0] == pytest.approx(expected, rel=1e-12)
    assert fitted.p2p_time_s(n, False) == pytest.approx(1e-5 + n * beta, rel=1e-12)
    # no transport: the flat link, alpha 1e-5 and 1 ns/byte, the mean call cost
    flat_expected = 4e-4 + min(1e-5 + n * 1e-9, 2e-5 + n * 1e-9)
    assert flat.collective_time_s("all_reduce", n, 2, 1)[0] == pytest.approx(flat_expected, rel=1e-12)
    with pytest.raises(ValueError, match=r"transport= is for cluster 'local'"):
        cluster_preset("dgx-h100", gpus=8, transport=transport)
    with pytest.raises(TypeError, match=r"transport=.* must be a plait.cost.transport_model.TransportModel"):
        cluster_preset("local", nprocs=2, device=device, local_link=link, transport={"alpha_s": 1e-6})
