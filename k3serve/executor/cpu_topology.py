"""CPU ranks placed by NUMA node and physical core (issue 64 item 3): decode on a CPU is
bandwidth-bound, so a rank that reads another socket's memory, or two threads sharing one
core's SMT siblings, halve it.

- `read_topology(root)`: NUMA nodes and their physical cores (each a tuple of its logical CPUs,
  SMT siblings together) from sysfs (`root` defaults to /sys; tests pass recorded trees).
- `place(topo, ranks, numa)`: each rank's CPUs and node. `distribute` (llama.cpp's `--numa
  distribute`, the default with several nodes): ranks spread over the nodes, each taking a
  whole number of nodes when it can, else its node's cores split; `isolate`: every rank on
  node 0; `none`: the cores in order whatever their node. One thread per physical core (its
  first sibling) in every mode.
- `pin(rank)`: this process onto its CPUs (sched_setaffinity), torch's threads to their count.
  A rank pins before it loads anything, so Linux's first-touch policy puts its weights and
  cache pools on its own node.

`--cpu-threads-bind "0-31|32-63"` (vLLM's VLLM_CPU_OMP_THREADS_BIND, one CPU list per rank)
overrides the plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NUMA_MODES = ("distribute", "isolate", "none")


@dataclass(frozen=True)
class Topology:
    nodes: dict[int, list[tuple[int, ...]]]  # node -> its physical cores, each (logical CPUs, sorted)

    @property
    def cores(self) -> int:
        return sum(len(c) for c in self.nodes.values())

    @property
    def cpus(self) -> int:
        return sum(len(core) for cores in self.nodes.values() for core in cores)


@dataclass(frozen=True)
class RankCPUs:
    rank: int
    node: int | None  # the NUMA node of its CPUs (None: they span several)
    cpus: tuple[int, ...]  # one per physical core

    @property
    def threads(self) -> int:
        return len(self.cpus)


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    cpus, runs = sorted(cpus), []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def read_topology(root: str | Path = "/sys") -> Topology:
    """Nodes and physical cores from sysfs: node*/cpulist, cpu*/topology/thread_siblings_list.
    Without node directories (no NUMA support) every CPU is on node 0."""
    root = Path(root)
    node_dirs = sorted((root / "devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    online = parse_cpulist((root / "devices/system/cpu/online").read_text())
    members = {
        int(d.name[4:]): [c for c in parse_cpulist((d / "cpulist").read_text()) if c in online] for d in node_dirs
    }
    if not members:
        members = {0: online}
    nodes = {}
    for node, cpus in members.items():
        cores: dict[tuple[int, ...], None] = {}
        for c in cpus:
            siblings = root / f"devices/system/cpu/cpu{c}/topology/thread_siblings_list"
            group = parse_cpulist(siblings.read_text()) if siblings.is_file() else [c]
            cores[tuple(sorted(x for x in group if x in online))] = None
        if cores:
            nodes[node] = list(cores)
    return Topology(nodes)


def place(topo: Topology, ranks: int, numa: str = "distribute") -> list[RankCPUs]:
    """Each rank's CPUs: one per physical core, as evenly as the cores divide."""
    if numa not in NUMA_MODES:
        raise ValueError(f"--numa must be one of {NUMA_MODES}, got {numa!r}")
    nodes = sorted(topo.nodes)
    if numa == "isolate":
        nodes = nodes[:1]
    if numa == "none":  # every core in order, as one pool
        return _split([(None, [core for n in nodes for core in topo.nodes[n]])], ranks)
    if ranks <= len(nodes):  # whole nodes per rank (a rank's nodes are consecutive)
        per = len(nodes) // ranks
        groups = [nodes[r * per : (r + 1) * per] for r in range(ranks)]
        return [
            RankCPUs(r, g[0] if len(g) == 1 else None, tuple(core[0] for n in g for core in topo.nodes[n]))
            for r, g in enumerate(groups)
        ]
    if ranks % len(nodes):
        raise ValueError(
            f"{ranks} ranks do not divide over {len(nodes)} NUMA nodes: use a multiple of them, "
            f"--numa none, or --cpu-threads-bind"
        )
    return _split([(n, topo.nodes[n]) for n in nodes], ranks)


def _split(pools: list[tuple[int | None, list[tuple[int, ...]]]], ranks: int) -> list[RankCPUs]:
    """`ranks` / len(pools) ranks per pool, its cores split evenly (the first ranks one more)."""
    per, out = ranks // len(pools), []
    for node, cores in pools:
        if len(cores) < per:
            raise ValueError(f"{per} ranks on {len(cores)} physical cores: fewer ranks, or --cpu-threads-bind")
        q, extra = divmod(len(cores), per)
        at = 0
        for i in range(per):
            n = q + (i < extra)
            out.append(RankCPUs(len(out), node, tuple(core[0] for core in cores[at : at + n])))
            at += n
    return out


def bind_list(text: str, ranks: int) -> list[RankCPUs]:
    """--cpu-threads-bind '0-31|32-63': rank r's CPUs, as given."""
    parts = text.split("|")
    if len(parts) != ranks:
        raise ValueError(
            f"--cpu-threads-bind gives {len(parts)} CPU lists for {ranks} ranks: one per rank, '|' between"
        )
    return [RankCPUs(r, None, tuple(parse_cpulist(p))) for r, p in enumerate(parts)]


def describe(plan: list[RankCPUs]) -> list[str]:
    return [
        f"rank {p.rank}: {p.threads} threads on CPUs {format_cpulist(p.cpus)}"
        + (f" (NUMA node {p.node})" if p.node is not None else "")
        for p in plan
    ]


def cpu_plan(ranks: int, numa: str | None = None, bind: str | None = None, root: str | Path = "/sys"):
    """Each of this host's `ranks` CPU ranks' CPUs (rank order), or () to leave them unpinned.
    `bind` (--cpu-threads-bind, "auto" = none given) wins; else `numa` (--numa); neither: spread
    over the nodes of a multi-node host (distribute), a one-node host's ranks left to the OS
    scheduler as before. A default plan that cannot be made (more ranks than cores) leaves the
    ranks unpinned; an asked-for one raises."""
    if bind not in (None, "auto"):
        return tuple(p.cpus for p in bind_list(bind, ranks))
    try:
        topo = read_topology(root)
    except OSError:
        if numa is not None:
            raise
        return ()
    if numa is None and len(topo.nodes) < 2:
        return ()
    mode = numa or "distribute"
    try:
        return tuple(p.cpus for p in place(topo, ranks, mode))
    except ValueError:
        if numa is not None:
            raise
        return ()


def pin(rank: RankCPUs) -> None:
    """This process onto the rank's CPUs, torch's thread pool to their count."""
    import torch

    os.sched_setaffinity(0, rank.cpus)
    torch.set_num_threads(rank.threads)
