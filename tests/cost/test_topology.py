"""Topologies: presets, routing (shortest, ECMP, deterministic), link models,
hierarchy, partial allocations, JSON/TOML files and every bad-input error."""

import json
import math
import random
from collections import deque

import pytest

from plait.cost.link import LinkModel
from plait.cost.presets import PLACEHOLDER_LOCAL_LINK, PRESETS, preset
from plait.cost.routing import Router
from plait.cost.topology import Link, Node, Topology
from plait.cost.topology_io import load_topology, save_topology, topology_from_dict, topology_to_dict


def _small(allocation=None, **link_overrides) -> Topology:
    """Two hosts of two devices, a switch per host, one cable between the switches."""
    nodes = [Node(name=f"h{h}.d{d}", kind="device", host=f"h{h}") for h in range(2) for d in range(2)]
    nodes += [Node(name=f"h{h}.sw", kind="switch", host=f"h{h}") for h in range(2)]
    links = [Link(endpoints=(f"h{h}.d{d}", f"h{h}.sw"), bandwidth_bytes_per_s=100e9, latency_s=1e-6)
             for h in range(2) for d in range(2)]
    links.append(Link(endpoints=("h0.sw", "h1.sw"), bandwidth_bytes_per_s=link_overrides.get("bw", 10e9),
                      latency_s=5e-6))
    return Topology(nodes=nodes, links=links, allocation=allocation, name="small")


# ----- presets ---------------------------------------------------------------------------------
def test_dgx_a100_links_hierarchy_and_levels():
    topo = preset("dgx-a100", nodes=2)
    assert topo.world_size == 16
    assert topo.hierarchy() == (tuple(range(8)), tuple(range(8, 16)))
    intra, inter = topo.link_model(0, 1), topo.link_model(3, 11)
    # NVLink 600 GB/s bidirectional = 300 GB/s per direction; NVSwitch hop 0.5 us each way
    assert intra.bandwidth_bytes_per_s == pytest.approx(300e9)
    assert intra.alpha_s == pytest.approx(1e-6)
    # HDR 200 Gb/s = 25 GB/s; PCIe 0.3 us + fabric 0.2 us per side
    assert inter.bandwidth_bytes_per_s == pytest.approx(25e9)
    assert inter.alpha_s == pytest.approx(1e-6)
    assert intra.gamma_s_per_byte == pytest.approx(3 / 2039e9)
    names = [topo.link_name(l) for l in topo.route(3, 11)]
    assert names == ["n0.gpu3 -> n0.nic3", "n0.nic3 -> fabric", "fabric -> n1.nic3", "n1.nic3 -> n1.gpu3"]
    assert topo.level_link_models() == (inter, intra)


def test_dgx_h100_per_direction_bandwidths():
    topo = preset("dgx-h100", nodes=2)
    assert topo.link_model(0, 7).bandwidth_bytes_per_s == pytest.approx(450e9)
    assert topo.link_model(0, 8).bandwidth_bytes_per_s == pytest.approx(50e9)


def test_presets_take_the_node_count_and_scale():
    topo = preset("dgx-a100", nodes=128)
    assert topo.world_size == 1024
    assert topo.hierarchy()[127] == tuple(range(1016, 1024))
    assert len(topo.route(0, 1023)) == 4 and len(topo.route(0, 7)) == 2


def test_fat_tree_spreads_over_spines_and_is_deterministic():
    params = dict(nodes=8, devices_per_node=2, nodes_per_leaf=2, spines=4)
    topo = preset("fat-tree", **params)
    pairs = [(a, b) for a in range(topo.world_size) for b in range(topo.world_size) if a // 4 != b // 4]
    spines = {topo.link_name(topo.route(a, b)[2]).split(" -> ")[1] for a, b in pairs}
    assert len(spines) == 4  # ECMP uses every spine
    for a, b in pairs:
        assert len(topo.route(a, b)) == 6  # dev, nic, leaf, spine, leaf, nic, dev
    # deterministic whatever the order of the questions
    again = preset("fat-tree", **params)
    assert [again.route(a, b) for a, b in reversed(pairs)][::-1] == [topo.route(a, b) for a, b in pairs]


def test_fat_tree_oversubscription_is_expressible():
    full = preset("fat-tree", nodes=4, devices_per_node=2, nodes_per_leaf=2, spines=1)
    assert full.link_model(0, 4).bandwidth_bytes_per_s == pytest.approx(25e9)
    thin = preset("fat-tree", nodes=4, devices_per_node=2, nodes_per_leaf=2, spines=1,
                  uplink_bandwidth_bytes_per_s=12.5e9)  # 4:1 at the leaf
    assert thin.link_model(0, 4).bandwidth_bytes_per_s == pytest.approx(12.5e9)
    assert thin.link_model(0, 2).bandwidth_bytes_per_s == pytest.approx(25e9)  # same leaf


def test_ring_preset_routes_the_short_way():
    topo = preset("ring", nodes=2, devices_per_node=4, bandwidth_bytes_per_s=10e9, latency_s=1e-6)
    for a in range(8):
        for b in range(8):
            if a != b:
                assert len(topo.route(a, b)) == min(abs(a - b), 8 - abs(a - b))
    assert topo.link_model(0, 3).alpha_s == pytest.approx(3e-6)
    assert topo.hierarchy() == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_local_preset_is_the_link_model():
    link = LinkModel(8e-6, 1 / 4e9, 1 / 16e9)
    topo = preset("local", devices_per_node=3, link=link)
    got = topo.link_model(0, 2)
    assert got.alpha_s == pytest.approx(link.alpha_s, rel=1e-12)
    assert got.beta_s_per_byte == pytest.approx(link.beta_s_per_byte, rel=1e-12)
    assert got.gamma_s_per_byte == pytest.approx(link.gamma_s_per_byte, rel=1e-12)
    placeholder = preset("local", devices_per_node=2).link_model(0, 1)
    assert placeholder.beta_s_per_byte == pytest.approx(PLACEHOLDER_LOCAL_LINK.beta_s_per_byte)


def test_preset_errors_list_the_valid_choices():
    with pytest.raises(ValueError, match="unknown topology preset 'dgx-b200'; valid: dgx-a100, dgx-h100, fat-tree"):
        preset("dgx-b200", nodes=2)
    with pytest.raises(ValueError, match="does not take 'devices_per_node'; it takes nodes, allocation"):
        preset("dgx-a100", nodes=2, devices_per_node=4)
    with pytest.raises(ValueError, match="nodes=0 must be a whole number >= 1"):
        preset("dgx-a100", nodes=0)
    with pytest.raises(ValueError, match="nodes=2 must be 1"):
        preset("local", nodes=2)
    assert set(PRESETS) == {"dgx-a100", "dgx-h100", "fat-tree", "ring", "local"}


# ----- routing -----------------------------------------------------------------------------------
def _bfs_hops(num_nodes, ends, src):
    adjacency = [[] for _ in range(num_nodes)]
    for a, b in ends:
        adjacency[a].append(b)
        adjacency[b].append(a)
    hops = {src: 0}
    queue = deque([src])
    while queue:
        node = queue.popleft()
        for n in adjacency[node]:
            if n not in hops:
                hops[n] = hops[node] + 1
                queue.append(n)
    return hops


@pytest.mark.parametrize("seed", range(5))
def test_router_paths_are_valid_and_shortest(seed):
    rng = random.Random(seed)
    num_nodes = 40
    ends = [(i, rng.randrange(i)) for i in range(1, num_nodes)]  # a random tree: connected
    ends += [tuple(rng.sample(range(num_nodes), 2)) for _ in range(30)]  # plus shortcuts and parallels
    router = Router(num_nodes, ends)
    for src in range(0, num_nodes, 3):
        hops = _bfs_hops(num_nodes, ends, src)
        for dst in range(num_nodes):
            path = router.path(src, dst)
            assert len(path) == hops[dst]
            node = src
            for link in path:
                a, b = ends[link // 2]
                tail, head = (a, b) if link % 2 == 0 else (b, a)
                assert tail == node
                node = head
            assert node == dst


def test_route_and_link_model_of_a_small_cluster():
    topo = _small()
    assert topo.route(0, 1) == (0, 3)  # h0.d0 -> h0.sw -> h0.d1
    model = topo.link_model(0, 3)
    assert model.alpha_s == pytest.approx(7e-6) and model.bandwidth_bytes_per_s == pytest.approx(10e9)
    assert model.gamma_s_per_byte == 0.0
    assert topo.hierarchy() == ((0, 1), (2, 3))
    inter, intra = topo.level_link_models()
    assert inter == model and intra.alpha_s == pytest.approx(2e-6)


# ----- allocations ---------------------------------------------------------------------------------
def test_partial_allocation_by_counts_and_names():
    topo = preset("dgx-a100", nodes=2, allocation="3+5")
    assert topo.world_size == 8
    assert topo.hierarchy() == ((0, 1, 2), (3, 4, 5, 6, 7))
    assert [topo.device(r).name for r in (0, 2, 3, 7)] == ["n0.gpu0", "n0.gpu2", "n1.gpu0", "n1.gpu4"]
    named = preset("dgx-a100", nodes=2).with_allocation(["n1.gpu7", "n0.gpu1", "n1.gpu0"])
    assert named.hierarchy() == ((0, 2), (1,))
    assert named.host_of(0) == "n1"
    assert preset("dgx-a100", nodes=2, allocation="n0.gpu0,n1.gpu0").world_size == 2
    assert preset("dgx-a100", nodes=2, allocation="0+2").hierarchy() == ((0, 1),)


@pytest.mark.parametrize("allocation, message", [
    ("3+9", "item 1 asks for 9 devices of host 'n1', which has 8"),
    ("1+1+1", "asks for 3 hosts but the topology has 2"),
    ("0+0", "allocates no device"),
    (["n0.gpu0", "n9.gpu0"], r"not devices of this topology: \['n9.gpu0'\]"),
    (["n0.gpu0", "n0.gpu0"], r"named more than once: \['n0.gpu0'\]"),
    (["fabric"], r"not devices of this topology: \['fabric'\]"),
])
def test_bad_allocations(allocation, message):
    with pytest.raises(ValueError, match=message):
        preset("dgx-a100", nodes=2, allocation=allocation)


def test_rank_outside_the_allocation():
    with pytest.raises(ValueError, match=r"rank 8 is outside \[0, 8\)"):
        preset("dgx-a100", nodes=1).route(0, 8)


# ----- files -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_file_round_trip(tmp_path, suffix):
    topo = preset("dgx-a100", nodes=2, allocation="3+5")
    path = save_topology(topo, tmp_path / f"cluster{suffix}")
    back = load_topology(path)
    assert back == topo
    assert back.route(2, 3) == topo.route(2, 3)
    assert load_topology(path, allocation="8+8").world_size == 16


def test_toml_file_is_readable(tmp_path):
    text = save_topology(_small(), tmp_path / "small.toml").read_text()
    assert 'kind = "device"' in text and "bandwidth_bytes_per_s = 10000000000.0" in text
    assert text.startswith("version = 1")


def _data() -> dict:
    return topology_to_dict(_small())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["links"][4].update(bandwidth_bytes_per_s=-1), r"links\[4\].bandwidth_bytes_per_s=-1 must be > 0"),
    (lambda d: d["links"][3].update(bandwidth_bytes_per_s=0), r"links\[3\].bandwidth_bytes_per_s=0 must be > 0"),
    (lambda d: d["links"][3].update(bandwidth_bytes_per_s=float("inf")), r"links\[3\].bandwidth_bytes_per_s=inf is not finite"),
    (lambda d: d["links"][3].update(bandwidth_bytes_per_s=float("nan")), r"links\[3\].bandwidth_bytes_per_s=nan is not finite"),
    (lambda d: d["links"][0].update(latency_s=-1e-6), r"links\[0\].latency_s=-1e-06 must be >= 0"),
    (lambda d: d["links"][2].update(bandwidth_bytes_per_s="fast"), r"links\[2\].bandwidth_bytes_per_s='fast' is not a number"),
    (lambda d: d["links"][1].pop("latency_s"), r"links\[1\] is missing 'latency_s'"),
    (lambda d: d["links"][1].update(bw=1), r"links\[1\] has unknown field\(s\) 'bw'; valid: endpoints"),
    (lambda d: d["links"][1].update(endpoints=["h0.d0"]), r"links\[1\].endpoints=\['h0.d0'\] must be two node names"),
    (lambda d: d["links"][1].update(endpoints=["h0.d0", "h0.d0"]), r"join a node to itself"),
    (lambda d: d["links"][4].update(endpoints=["h0.sw", "h7.sw"]), r"links\[4\].endpoints\[1\]='h7.sw'"),
    (lambda d: d["nodes"][2].update(kind="gpu"), r"nodes\[2\].kind='gpu' is not one of device, nic, host, switch"),
    (lambda d: d["nodes"][2].pop("name"), r"nodes\[2\] is missing 'name'"),
    (lambda d: d["nodes"][1].update(name="h0.d0"), r"nodes\[1\].name='h0.d0' \(also nodes\[0\]\)"),
    (lambda d: d["nodes"][0].update(reduce_bytes_per_s=0), r"nodes\[0\].reduce_bytes_per_s=0 must be > 0"),
    (lambda d: d["nodes"].__setitem__(0, "h0.d0"), r"nodes\[0\] must be a table"),
    (lambda d: d.update(links=[]), r"links must be a non-empty list"),
    (lambda d: d.update(colour="blue"), r"unknown top-level field\(s\) 'colour'"),
    (lambda d: d.update(version=7), r"version=7 is not supported"),
    (lambda d: d.update(allocation="2+5"), r"host 'h1', which has 2"),
])
def test_malformed_topology_data(edit, message):
    data = _data()
    edit(data)
    with pytest.raises(ValueError, match=message):
        topology_from_dict(data, source="cluster.json")


def test_errors_name_every_bad_value():
    data = _data()
    data["links"][0]["latency_s"] = -1
    data["links"][2]["bandwidth_bytes_per_s"] = 0
    with pytest.raises(ValueError, match=r"links\[0\].latency_s=-1 .*links\[2\].bandwidth_bytes_per_s=0"):
        topology_from_dict(data)


def test_disconnected_topology_names_the_devices():
    data = _data()
    data["links"].pop(4)  # the cable between the hosts
    with pytest.raises(ValueError, match=r"disconnected: devices 'h0.d0' and 'h1.d0' cannot reach each other"):
        topology_from_dict(data)


def test_bad_files(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"nodes": [}')
    with pytest.raises(ValueError, match="not valid JSON at line 1"):
        load_topology(bad_json)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("nodes = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_topology(bad_toml)
    with pytest.raises(ValueError, match="must end in .json or .toml"):
        load_topology(tmp_path / "cluster.yaml")
    with pytest.raises(ValueError, match="cannot read topology file"):
        load_topology(tmp_path / "missing.json")
    top_list = tmp_path / "list.json"
    top_list.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="top level must be a table"):
        load_topology(top_list)
    infinite = tmp_path / "inf.json"
    data = _data()
    text = json.dumps(data).replace("10000000000.0", "Infinity")
    infinite.write_text(text)
    with pytest.raises(ValueError, match=r"inf.json: malformed topology: links\[4\].bandwidth_bytes_per_s=inf"):
        load_topology(infinite)


def test_constructors_validate_too():
    with pytest.raises(ValueError, match=r"link \('a', 'b'\): bandwidth_bytes_per_s=0 must be > 0"):
        Link(endpoints=("a", "b"), bandwidth_bytes_per_s=0, latency_s=0)
    with pytest.raises(ValueError, match="reduce_bytes_per_s is set on a 'switch'"):
        Node(name="sw", kind="switch", reduce_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="no node of kind 'device'"):
        Topology(nodes=[Node(name="sw", kind="switch")], links=[])
    assert math.isclose(_small().capacity_bytes_per_s[8], 10e9)


def test_cost_layer_imports_neither_torch_distributed_nor_comm():
    import subprocess
    import sys

    code = ("import sys, plait.cost.topology, plait.cost.presets, plait.cost.topology_io, plait.cost.simulator; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed', 'plait.comm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_summary_line():
    assert preset("dgx-a100", nodes=2, allocation="3+5").summary() == (
        "dgx-a100x2: 8 ranks on 2 hosts (3+5); 16 devices, 16 nics, 3 switches, 48 links")
