"""Ready-made topologies: DGX A100 / H100 clusters, a leaf-spine fat tree, a ring and
this machine.

    preset("dgx-a100", nodes=128)                     # 1,024 GPUs
    preset("fat-tree", nodes=64, nodes_per_leaf=8, spines=2, uplink_bandwidth_bytes_per_s=25e9)
    preset("local", devices_per_node=4, link=calibrated_link_model)

Bandwidths are per direction (links are full duplex). Vendors quote NVLink
bidirectionally: an A100's "600 GB/s" is 300 GB/s each way, an H100's "900 GB/s" is
450 GB/s each way, and that is what the presets use. Latencies are one-way hardware
latencies (no software overhead: a calibrated profile adds that); each is cited where
it is set. A device's reduction throughput is its memory bandwidth / 3: reducing one
byte reads the local and the incoming byte and writes the result.
"""

from __future__ import annotations

import inspect

from plait.cost.link import LinkModel
from plait.cost.topology import Link, Node, Topology

__all__ = ["PRESETS", "preset", "dgx_a100", "dgx_h100", "fat_tree", "ring", "local", "PLACEHOLDER_LOCAL_LINK"]

# NVLink through NVSwitch: about 1 us GPU to GPU (vendor and benchmark tables list 1-2 us
# including software), so 0.5 us on each of the two GPU-NVSwitch hops.
NVLINK_HOP_LATENCY_S = 0.5e-6
# GPU to NIC over PCIe plus the adapter: ConnectX-6/7 are specified at "sub-600 ns"
# end to end (NVIDIA ConnectX-6 user manual), split over the sending and receiving side.
NIC_HOP_LATENCY_S = 0.3e-6
# A non-blocking fat tree is leaf -> spine -> leaf, three switch hops of ~130 ns each on
# HDR Quantum (QM87xx) and under 150 ns on NDR Quantum-2 (QM97xx), plus cables:
# ~0.4 us, split over the two NIC-fabric links of a path.
FABRIC_HALF_LATENCY_S = 0.2e-6
SWITCH_HOP_LATENCY_S = 0.13e-6

# Placeholder for the `local` preset when no calibrated LinkModel is given: guesses of
# the order of gloo over loopback on a CPU host (20 us per message, 5 GB/s, reductions
# at 10 GB/s). NOT measured; `plait calibrate` produces the real numbers.
PLACEHOLDER_LOCAL_LINK = LinkModel(alpha_s=20e-6, beta_s_per_byte=1 / 5e9, gamma_s_per_byte=1 / 10e9)


def _nvswitch_cluster(name: str, nodes: int, *, nvlink_bytes_per_s: float, pcie_bytes_per_s: float,
                      nic_bytes_per_s: float, reduce_bytes_per_s: float, allocation) -> Topology:
    """``nodes`` DGX-style nodes: 8 GPUs on one NVSwitch crossbar (the 6/4 physical
    NVSwitch chips act as one non-blocking switch), one NIC per GPU over PCIe, every NIC
    into one non-blocking InfiniBand fabric. A non-blocking (full-bisection) fat tree is
    modelled as a single crossbar "fabric": with full bisection only the NIC links
    contend, and its latency is the leaf-spine-leaf latency."""
    _check_count("nodes", nodes)
    node_list = [Node(name="fabric", kind="switch")]
    links = []
    for i in range(nodes):
        host = f"n{i}"
        node_list.append(Node(name=f"{host}.nvswitch", kind="switch", host=host))
        for j in range(8):
            gpu, nic = f"{host}.gpu{j}", f"{host}.nic{j}"
            node_list += [Node(name=gpu, kind="device", host=host, reduce_bytes_per_s=reduce_bytes_per_s),
                          Node(name=nic, kind="nic", host=host)]
            links += [Link(endpoints=(gpu, f"{host}.nvswitch"), bandwidth_bytes_per_s=nvlink_bytes_per_s,
                           latency_s=NVLINK_HOP_LATENCY_S),
                      Link(endpoints=(gpu, nic), bandwidth_bytes_per_s=pcie_bytes_per_s,
                           latency_s=NIC_HOP_LATENCY_S),
                      Link(endpoints=(nic, "fabric"), bandwidth_bytes_per_s=nic_bytes_per_s,
                           latency_s=FABRIC_HALF_LATENCY_S)]
    return Topology(nodes=node_list, links=links, allocation=allocation, name=f"{name}x{nodes}")


def dgx_a100(*, nodes: int = 1, allocation=None) -> Topology:
    """DGX A100 nodes: NVLink3 12 x 25 GB/s = 300 GB/s per direction per GPU (the quoted
    600 GB/s counts both directions); 8 ConnectX-6 HDR 200 Gb/s = 25 GB/s per direction,
    one per GPU over PCIe 4.0 x16 (16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s); A100
    80 GB HBM2e 2,039 GB/s -> reductions at 680 GB/s."""
    return _nvswitch_cluster("dgx-a100", nodes, nvlink_bytes_per_s=300e9, pcie_bytes_per_s=31.5e9,
                             nic_bytes_per_s=25e9, reduce_bytes_per_s=2039e9 / 3, allocation=allocation)


def dgx_h100(*, nodes: int = 1, allocation=None) -> Topology:
    """DGX H100 nodes: NVLink4 18 x 25 GB/s = 450 GB/s per direction per GPU (the quoted
    900 GB/s counts both directions); 8 ConnectX-7 NDR 400 Gb/s = 50 GB/s per direction
    over PCIe 5.0 x16 (63 GB/s); H100 SXM HBM3 3.35 TB/s -> reductions at 1.12 TB/s."""
    return _nvswitch_cluster("dgx-h100", nodes, nvlink_bytes_per_s=450e9, pcie_bytes_per_s=63e9,
                             nic_bytes_per_s=50e9, reduce_bytes_per_s=3350e9 / 3, allocation=allocation)


def fat_tree(*, nodes: int = 4, devices_per_node: int = 8, nodes_per_leaf: int = 2, spines: int = 2,
             intra_bandwidth_bytes_per_s: float = 300e9, nic_bandwidth_bytes_per_s: float = 25e9,
             uplink_bandwidth_bytes_per_s: float | None = None, reduce_bytes_per_s: float | None = None,
             allocation=None) -> Topology:
    """Leaf-spine: each node's devices share a crossbar (``intra``) and have one NIC each
    into their node's leaf; ``nodes_per_leaf`` nodes per leaf; every leaf has one uplink
    to each of ``spines`` spines.

    Oversubscription of a leaf = nodes_per_leaf * devices_per_node * nic_bandwidth /
    (spines * uplink_bandwidth); the default uplink bandwidth makes it 1 (non-blocking).
    Paths between leaves spread over the spines by ECMP.
    """
    for key, value in (("nodes", nodes), ("devices_per_node", devices_per_node),
                       ("nodes_per_leaf", nodes_per_leaf), ("spines", spines)):
        _check_count(key, value)
    if uplink_bandwidth_bytes_per_s is None:
        uplink_bandwidth_bytes_per_s = nodes_per_leaf * devices_per_node * nic_bandwidth_bytes_per_s / spines
    leaves = -(-nodes // nodes_per_leaf)
    node_list = [Node(name=f"spine{s}", kind="switch") for s in range(spines)]
    node_list += [Node(name=f"leaf{l}", kind="switch") for l in range(leaves)]
    links = [Link(endpoints=(f"leaf{l}", f"spine{s}"), bandwidth_bytes_per_s=uplink_bandwidth_bytes_per_s,
                  latency_s=SWITCH_HOP_LATENCY_S) for l in range(leaves) for s in range(spines)] if leaves > 1 else []
    for i in range(nodes):
        host = f"n{i}"
        if devices_per_node > 1:
            node_list.append(Node(name=f"{host}.switch", kind="switch", host=host))
        for j in range(devices_per_node):
            dev, nic = f"{host}.dev{j}", f"{host}.nic{j}"
            node_list += [Node(name=dev, kind="device", host=host, reduce_bytes_per_s=reduce_bytes_per_s),
                          Node(name=nic, kind="nic", host=host)]
            if devices_per_node > 1:
                links.append(Link(endpoints=(dev, f"{host}.switch"), bandwidth_bytes_per_s=intra_bandwidth_bytes_per_s,
                                  latency_s=NVLINK_HOP_LATENCY_S))
            links += [Link(endpoints=(dev, nic), bandwidth_bytes_per_s=nic_bandwidth_bytes_per_s,
                           latency_s=NIC_HOP_LATENCY_S),
                      Link(endpoints=(nic, f"leaf{i // nodes_per_leaf}"), bandwidth_bytes_per_s=nic_bandwidth_bytes_per_s,
                           latency_s=SWITCH_HOP_LATENCY_S)]
    return Topology(nodes=node_list, links=links, allocation=allocation, name=f"fat-tree{nodes}x{devices_per_node}")


def ring(*, nodes: int = 1, devices_per_node: int = 8, bandwidth_bytes_per_s: float = 50e9,
         latency_s: float = 1e-6, reduce_bytes_per_s: float | None = None, allocation=None) -> Topology:
    """``nodes * devices_per_node`` devices in a ring, device k linked to k-1 and k+1
    (mod the count); a message to a far device is forwarded by those in between, on
    the shorter way round (ECMP between the two when opposite)."""
    _check_count("nodes", nodes)
    _check_count("devices_per_node", devices_per_node)
    names = [f"n{i}.dev{j}" for i in range(nodes) for j in range(devices_per_node)]
    node_list = [Node(name=n, kind="device", host=n.split(".")[0], reduce_bytes_per_s=reduce_bytes_per_s)
                 for n in names]
    count = len(names)
    pairs = [(k, (k + 1) % count) for k in range(count if count > 2 else count - 1)]
    links = [Link(endpoints=(names[a], names[b]), bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)
             for a, b in pairs]
    return Topology(nodes=node_list, links=links, allocation=allocation, name=f"ring{count}")


def local(*, nodes: int = 1, devices_per_node: int = 4, link: LinkModel | None = None, allocation=None) -> Topology:
    """This machine: ``devices_per_node`` ranks on one host joined by a crossbar, each
    with one port of bandwidth 1/beta and alpha/2 latency each way (so a message costs
    alpha + n beta) and reductions at 1/gamma. ``link`` is the calibrated LinkModel
    (``plait.cost.profile`` passes it); without one the module's
    ``PLACEHOLDER_LOCAL_LINK`` is used: a guess, not a measurement."""
    if nodes != 1:
        raise ValueError(f"preset 'local' is one host; nodes={nodes!r} must be 1 (use devices_per_node for ranks)")
    _check_count("devices_per_node", devices_per_node)
    link = PLACEHOLDER_LOCAL_LINK if link is None else link
    if not isinstance(link, LinkModel):
        raise TypeError(f"link must be a LinkModel, got {type(link).__name__}")
    reduce = None if link.gamma_s_per_byte == 0 else 1.0 / link.gamma_s_per_byte
    node_list = [Node(name="local.crossbar", kind="switch", host="local")]
    node_list += [Node(name=f"local.rank{i}", kind="device", host="local", reduce_bytes_per_s=reduce)
                  for i in range(devices_per_node)]
    links = [Link(endpoints=(f"local.rank{i}", "local.crossbar"), bandwidth_bytes_per_s=1.0 / link.beta_s_per_byte,
                  latency_s=link.alpha_s / 2) for i in range(devices_per_node)]
    return Topology(nodes=node_list, links=links, allocation=allocation, name=f"local{devices_per_node}")


PRESETS = {"dgx-a100": dgx_a100, "dgx-h100": dgx_h100, "fat-tree": fat_tree, "ring": ring, "local": local}


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")


def preset(name: str, **params) -> Topology:
    """The preset ``name`` built with ``params`` (see each builder for its keywords)."""
    builder = PRESETS.get(name)
    if builder is None:
        raise ValueError(f"unknown topology preset {name!r}; valid: {', '.join(PRESETS)} "
                         "(or load a topology file)")
    accepted = list(inspect.signature(builder).parameters)
    unknown = [key for key in params if key not in accepted]
    if unknown:
        raise ValueError(f"preset {name!r} does not take {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(accepted)}")
    return builder(**params)
