"""A parallel layout: attention TP x attention DP = GPUs, experts over all GPUs (EP = GPUs)."""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.config.model_config import ModelConfig


@dataclass(frozen=True)
class Layout:
    num_gpus: int
    tp: int  # attention tensor parallel (heads split)
    dp: int  # attention data parallel (DP-attention groups); tp * dp == num_gpus
    ep: int  # expert parallel

    @property
    def dp_attention(self) -> bool:
        return self.dp > 1

    @property
    def label(self) -> str:
        attn = f"TP{self.tp}" if self.dp == 1 else (f"DP{self.dp}" if self.tp == 1 else f"TP{self.tp}xDP{self.dp}")
        return f"{attn}/EP{self.ep}"

    def problems(self, cfg: ModelConfig, scaleup_domain: int) -> list[str]:
        """Why this layout cannot run the model (empty when it can)."""
        out = []
        if self.tp * self.dp != self.num_gpus:
            out.append(f"TP {self.tp} x DP {self.dp} != {self.num_gpus} GPUs")
        heads = {"KDA": cfg.kda.num_heads if cfg.kda_layers else 0, "MLA": cfg.mla.num_heads if cfg.mla_layers else 0}
        for kind, h in heads.items():
            if h and h % self.tp:
                out.append(f"{kind} heads {h} do not divide by TP {self.tp}")
        E = cfg.moe.num_experts
        if E and E % self.ep:
            out.append(f"{E} routed experts do not divide by EP {self.ep}")
        return out

    def warnings(self, scaleup_domain: int) -> list[str]:
        if self.tp > scaleup_domain:
            return [f"TP {self.tp} crosses the {scaleup_domain}-GPU scale-up domain: all-reduce over the NIC"]
        return []


def candidate_layouts(num_gpus: int) -> list[Layout]:
    """TP over every divisor of the GPU count, DP-attention for the rest, EP over all GPUs."""
    return [Layout(num_gpus, t, num_gpus // t, num_gpus) for t in range(1, num_gpus + 1) if num_gpus % t == 0]
