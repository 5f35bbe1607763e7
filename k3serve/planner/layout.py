"""A parallel layout and the links its collectives cross.

GPUs = TP x DP x PP: attention tensor parallel (heads split) x attention data parallel
(DP-attention groups) inside one pipeline stage, times pipeline stages. Each stage holds a
contiguous run of layers; its routed experts are split over the stage's TP x DP GPUs (EP).
GPUs are numbered so that a TP group, then a stage, fills scale-up domains first: a
collective stays on NVLink / Infinity Fabric while its group fits in one domain and crosses
the NIC once it does not (planner-data.md §2, §6.5).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.config.model_config import ModelConfig

NVLINK, NIC = "scale-up", "NIC"


@dataclass(frozen=True)
class Layout:
    num_gpus: int
    tp: int  # attention tensor parallel (heads split)
    dp: int  # attention data parallel (DP-attention groups) inside one stage
    ep: int  # expert parallel: the GPUs of one stage
    pp: int = 1  # pipeline stages
    dcp: int = 1  # decode context parallelism: the latent cache sharded by token over this many TP ranks

    @property
    def dp_attention(self) -> bool:
        return self.dp > 1

    @property
    def stage_gpus(self) -> int:
        return self.tp * self.dp

    @property
    def label(self) -> str:
        attn = f"TP{self.tp}" if self.dp == 1 else (f"DP{self.dp}" if self.tp == 1 else f"TP{self.tp}xDP{self.dp}")
        return (
            f"{attn}/EP{self.ep}"
            + (f"/PP{self.pp}" if self.pp > 1 else "")
            + (f"/DCP{self.dcp}" if self.dcp > 1 else "")
        )

    def nodes(self, scaleup_domain: int) -> int:
        return -(-self.num_gpus // scaleup_domain)

    def problems(self, cfg: ModelConfig, scaleup_domain: int) -> list[str]:
        """Why this layout cannot run the model (empty when it can)."""
        out = []
        if self.tp * self.dp * self.pp != self.num_gpus:
            out.append(f"TP {self.tp} x DP {self.dp} x PP {self.pp} != {self.num_gpus} GPUs")
        heads = {"KDA": cfg.kda.num_heads if cfg.kda_layers else 0, "MLA": cfg.mla.num_heads if cfg.mla_layers else 0}
        for kind, h in heads.items():
            if h and h % self.tp:
                out.append(f"{kind} heads {h} do not divide by TP {self.tp}")
        E = cfg.moe.num_experts
        if E and E % self.ep:
            out.append(f"{E} routed experts do not divide by EP {self.ep}")
        if self.tp % self.dcp:
            out.append(f"DCP {self.dcp} does not divide TP {self.tp}")
        if self.pp > cfg.num_layers:
            out.append(f"PP {self.pp} exceeds the {cfg.num_layers} layers")
        elif cfg.use_attnres and self.pp > len(cfg.attnres_block_starts):
            out.append(f"PP {self.pp} exceeds the {len(cfg.attnres_block_starts)} AttnRes blocks a stage starts at")
        return out

    def links(self, scaleup_domain: int) -> dict[str, str]:
        """The link each collective crosses: TP all-reduce, EP all-to-all, PP send/recv."""
        out = {}
        if self.tp > 1:
            out["tp_allreduce"] = NVLINK if self.tp <= scaleup_domain else NIC
        if self.ep > 1:
            out["ep_alltoall"] = NVLINK if self.ep <= scaleup_domain else NIC
        if self.pp > 1:
            # Stages are consecutive GPU ranges: a boundary crosses the NIC unless both stages
            # share one domain (stage size < domain and the domain holds several stages).
            out["pp_send"] = NVLINK if self.num_gpus <= scaleup_domain else NIC
        return out

    def warnings(self, scaleup_domain: int) -> list[str]:
        out = []
        links = self.links(scaleup_domain)
        if links.get("tp_allreduce") == NIC:
            out.append(f"TP {self.tp} crosses the {scaleup_domain}-GPU scale-up domain: all-reduce over the NIC")
        if links.get("ep_alltoall") == NIC:
            out.append(
                f"EP {self.ep} spans {-(-self.ep // scaleup_domain)} scale-up domains: expert all-to-all over the NIC"
            )
        return out

    def links_label(self, scaleup_domain: int) -> str:
        """Compact: which collectives leave the scale-up domain ("NIC: EP, PP")."""
        names = {"tp_allreduce": "TP", "ep_alltoall": "EP", "pp_send": "PP"}
        links = self.links(scaleup_domain)
        nic = [names[k] for k, v in links.items() if v == NIC]
        if nic:
            return "NIC: " + ", ".join(nic)
        return "scale-up" if links else "-"


def candidate_layouts(num_gpus: int, max_pp: int = 8) -> list[Layout]:
    """Every TP x DP split of every stage size, PP over power-of-two stage counts."""
    out = []
    pp = 1
    while pp <= min(num_gpus, max_pp):
        stage = num_gpus // pp
        out += [Layout(num_gpus, t, stage // t, stage, pp) for t in range(1, stage + 1) if stage % t == 0]
        pp *= 2
    return out
