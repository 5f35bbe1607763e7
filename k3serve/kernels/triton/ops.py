"""The Triton kernels as `torch.library` custom ops (namespace `k3serve`, prefix `triton_`),
each with the graph op's fake implementation (kernels/graph_registry.py FAKES): one node to
torch.compile, nothing run at trace time, and what FakeTensorMode's sync audit sees
(tests/model/test_graph.py). The kernels' entry points carry the schemas' annotations; they
follow the graph backend's ops except where the kernel reads other inputs: KDA takes A_log per
head (the gate is computed inside fla's kernel), MLA the block table and block size (it pages
through the cache itself), MoE no decode tables (it decodes in registers).
"""

from __future__ import annotations

from types import SimpleNamespace

from k3serve.kernels.graph_registry import register
from k3serve.kernels.triton import kda, mla, moe

BODIES = SimpleNamespace(
    kda_decode=kda.kda_decode, kda_verify=kda.kda_verify, mla_decode=mla.mla_decode, moe_experts=moe.moe_experts
)
OPS = register("triton_", BODIES)
