"""CPU rank placement (issue 64 item 3) from recorded sysfs layouts: a two-socket EPYC 9654 in
NPS4 (8 NUMA nodes of 24 cores, SMT siblings numbered +192) and a dual Xeon 8480+ with SNC2
(4 nodes of 28 cores, siblings +112), and this machine's own. One thread per physical core, ranks
spread over the nodes, each rank's plan printed; a TP2 engine pinned one rank per core answers
as one process (tests/distributed/test_tp_engine.py holds that run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.executor.cpu_topology import (
    bind_list,
    cpu_plan,
    describe,
    format_cpulist,
    parse_cpulist,
    place,
    read_topology,
)


def fake_sysfs(root: Path, nodes: int, cores_per_node: int) -> Path:
    """A sysfs tree as Linux numbers a two-thread-per-core machine: CPU c and its sibling c + N
    (N physical cores), node n holding cores n*k .. n*k + k - 1 and their siblings."""
    n = nodes * cores_per_node
    cpu = root / "devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(f"0-{2 * n - 1}\n")
    for c in range(2 * n):
        t = cpu / f"cpu{c}/topology"
        t.mkdir(parents=True)
        first = c % n
        t.joinpath("thread_siblings_list").write_text(f"{first},{first + n}\n")
    for node in range(nodes):
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        a, b = node * cores_per_node, (node + 1) * cores_per_node - 1
        d.joinpath("cpulist").write_text(f"{a}-{b},{a + n}-{b + n}\n")
    return root


def test_cpulists_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_epyc_nps4_one_thread_per_physical_core_spread_over_the_nodes(tmp_path):
    topo = read_topology(fake_sysfs(tmp_path, nodes=8, cores_per_node=24))
    assert len(topo.nodes) == 8 and topo.cores == 192 and topo.cpus == 384
    eight = place(topo, 8)
    assert [p.node for p in eight] == list(range(8)) and all(p.threads == 24 for p in eight)
    assert eight[3].cpus == tuple(range(72, 96))  # node 3's cores, no SMT sibling (192+)
    two = place(topo, 2)  # a rank per socket: four nodes each
    assert [p.cpus for p in two] == [tuple(range(96)), tuple(range(96, 192))] and two[0].node is None
    sixteen = place(topo, 16)
    assert [p.node for p in sixteen] == [n for n in range(8) for _ in range(2)] and sixteen[1].cpus == tuple(
        range(12, 24)
    )
    assert all(p.node == 0 for p in place(topo, 4, "isolate")) and place(topo, 4, "isolate")[3].cpus == (
        18,
        19,
        20,
        21,
        22,
        23,
    )
    with pytest.raises(ValueError, match="12 ranks do not divide over 8 NUMA nodes"):
        place(topo, 12)
    print("\n".join(describe(eight)))


def test_xeon_snc2_and_explicit_lists(tmp_path):
    topo = read_topology(fake_sysfs(tmp_path, nodes=4, cores_per_node=28))
    two = place(topo, 2)
    assert [p.cpus for p in two] == [tuple(range(56)), tuple(range(56, 112))]
    assert [p.node for p in place(topo, 4)] == [0, 1, 2, 3]
    assert [p.threads for p in place(topo, 3, "none")] == [38, 37, 37]
    assert cpu_plan(2, bind="0-3|8-11", root=tmp_path) == ((0, 1, 2, 3), (8, 9, 10, 11))
    assert cpu_plan(2, root=tmp_path) == (tuple(range(56)), tuple(range(56, 112)))  # default: distribute
    with pytest.raises(ValueError, match="2 CPU lists for 3 ranks"):
        bind_list("0-3|4-7", 3)
    print("\n".join(describe(place(topo, 4))))


def test_this_machine(capsys):
    topo = read_topology()
    plan = place(topo, 1)
    assert plan[0].threads == topo.cores
    assert cpu_plan(topo.cores + 1) == ()  # by default a one-node host (or too many ranks): unpinned
    with pytest.raises(ValueError):
        cpu_plan(topo.cores + 1, numa="none")
