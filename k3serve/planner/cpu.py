"""`k3serve plan --cpu HOST` (issue 64 item 4): whether a model in a weight format fits a CPU
host's RAM with its cache, what decode speed the host's memory bandwidth allows at 1 / 8 / 16
streams, and the launch line. The same byte counts as the GPU planner (planner/weights.py, the
engine's cache/sizing.py); `--experts mxfp4` prices a bf16 checkpoint as `k3serve convert`
leaves it.

Decode is bandwidth-bound on a CPU: a step of B streams reads every non-expert weight once,
the experts its tokens touch (E (1 - (1 - k/E)^B) per MoE layer), and each stream's latent
rows and KDA state; step time = max(bytes / (sustained bandwidth), FLOPs / (cores x per-core
peak x MFU)). Host figures are vendor peaks (channels x MT/s x 8 B) times SUSTAINED, the share a
STREAM-like read reaches (an assumption, printed); `--mem-bw-gbs` overrides with a measured
figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3serve.cache.sizing import full_request_bytes, kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.perf import distinct_experts
from k3serve.planner.weights import WeightSplit

GB, GiB = 10**9, 2**30
SUSTAINED = 0.7  # of the peak memory bandwidth a streaming read reaches (assumption)
MFU = 0.5  # of the cores' FMA peak a decode GEMV reaches when compute-bound (assumption)
RAM_FRACTION = 0.9  # of RAM the engine may take (the OS, the page cache, the server keep the rest)
OVERHEAD = 2 * GiB  # interpreter, torch, kernels, activations


@dataclass(frozen=True)
class CPUHost:
    name: str
    ram_bytes: int
    peak_bw: float  # bytes/s, every memory channel together
    cores: int  # physical cores
    numa_nodes: int
    gflops_per_core: float  # fp32 FMA peak: 2 x FMA units x lanes x 2 x GHz

    @property
    def bandwidth(self) -> float:
        return self.peak_bw * SUSTAINED


def _ddr(channels: int, mts: int) -> float:
    return channels * mts * 1e6 * 8


# vendor figures; RAM as commonly fitted (override with --ram-gib)
HOSTS = {
    "epyc-9654-2s": CPUHost("2x EPYC 9654 (Genoa, 12ch DDR5-4800 each)", 768 * GiB, _ddr(24, 4800), 192, 2, 76.8),
    "epyc-9755-2s": CPUHost("2x EPYC 9755 (Turin, 12ch DDR5-6000 each)", 1536 * GiB, _ddr(24, 6000), 256, 2, 83.2),
    "xeon-8480-2s": CPUHost("2x Xeon 8480+ (SPR, 8ch DDR5-4800 each)", 512 * GiB, _ddr(16, 4800), 112, 2, 128.0),
    "threadripper-7980x": CPUHost("Threadripper 7980X (4ch DDR5-5200)", 256 * GiB, _ddr(4, 5200), 64, 1, 64.0),
    "ryzen-9950x": CPUHost("Ryzen 9 9950X (2ch DDR5-5600)", 128 * GiB, _ddr(2, 5600), 16, 1, 139.2),
    "desktop-64g": CPUHost("8-core desktop (2ch DDR5-4800, 64 GiB)", 64 * GiB, _ddr(2, 4800), 8, 1, 67.2),
}


@dataclass(frozen=True)
class CPUPlan:
    host: CPUHost
    weights: int
    cache: int  # max_num_seqs requests at `context`
    needs: int
    usable: int
    streams: dict[int, float]  # concurrent streams -> decode tok/s (all streams together)
    launch: str

    @property
    def fits(self) -> bool:
        return self.needs <= self.usable


def host(name: str, ram_gib: float | None = None, mem_bw_gbs: float | None = None, cores: int | None = None) -> CPUHost:
    if name not in HOSTS and name != "custom":
        raise SystemExit(f"plan: --cpu {name!r} is not a known host ({', '.join(HOSTS)}, or custom with the figures)")
    if name == "custom" and not (ram_gib and mem_bw_gbs and cores):
        raise SystemExit("plan: --cpu custom needs --ram-gib, --mem-bw-gbs and --cpu-cores")
    h = HOSTS.get(name) or CPUHost("custom", 0, 0.0, 0, 1, 64.0)
    if ram_gib:
        h = replace(h, ram_bytes=int(ram_gib * GiB))
    if mem_bw_gbs:  # a measured sustained figure: no SUSTAINED factor on top
        h = replace(h, peak_bw=mem_bw_gbs * GB / SUSTAINED)
    if cores:
        h = replace(h, cores=cores)
    return h


def decode_tok_s(cfg: ModelConfig, w: WeightSplit, h: CPUHost, streams: int, context: int, kv_dtype: str) -> float:
    """Decode tokens/s of `streams` concurrent requests at `context` tokens (all of them together)."""
    m = cfg.moe
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert_each = w.expert / max(1, moe_layers * m.num_experts) if m.num_experts else 0
    touched = distinct_experts(m.num_experts, m.top_k, streams) if m.num_experts else 0
    cache = streams * (context * mla_cache_bytes_per_token(cfg, kv_dtype) + 2 * kda_state_bytes_per_request(cfg))
    nbytes = w.non_expert + moe_layers * touched * expert_each + cache
    flops = streams * 2 * w.active_params
    step = max(nbytes / h.bandwidth, flops / (h.cores * h.gflops_per_core * 1e9 * MFU))
    return streams / step


def plan_cpu(
    cfg: ModelConfig,
    model: str,
    w: WeightSplit,
    h: CPUHost,
    context: int,
    max_num_seqs: int,
    kv_dtype: str = "bfloat16",
    experts: str = "checkpoint",
    streams: tuple[int, ...] = (1, 8, 16),
) -> CPUPlan:
    """`experts` other than "checkpoint": the model as `k3serve convert` packs it (or, for bf16,
    as shipped): the launch line converts first."""
    cache = max_num_seqs * full_request_bytes(cfg, context, 16, kv_dtype)  # the engine's own sizing
    usable = int(h.ram_bytes * RAM_FRACTION)
    needs = w.total + cache + OVERHEAD
    rates = {b: decode_tok_s(cfg, w, h, b, context, kv_dtype) for b in streams}
    served = model
    convert = ""
    if experts in ("mxfp4", "nvfp4"):
        served = f"{model.rstrip('/').rsplit('/', 1)[-1]}-{experts}"
        convert = f"k3serve convert {model} {served}" + (" --experts nvfp4" if experts == "nvfp4" else "") + " && "
    serve = (
        f"k3serve serve {served} --max-model-len {context} --max-num-seqs {max_num_seqs} "
        f"--cache-memory {max(1, -(-cache // GiB))}GiB"
    )
    if kv_dtype == "fp8":
        serve += " --kv-cache-dtype fp8"
    if h.numa_nodes > 1:  # one process reading both sockets' memory crosses the link for half of it
        serve = f"numactl --interleave=all {serve}  # {h.numa_nodes} NUMA nodes: per-node ranks are not built yet"
    return CPUPlan(h, w.total, cache, needs, usable, rates, convert + serve)


def format_cpu_plan(p: CPUPlan, model: str, fmt: str, context: int, max_num_seqs: int) -> str:
    h = p.host
    out = [
        f"model {model}, experts {fmt}: weights {p.weights / GB:,.1f} GB",
        f"host {h.name}: {h.ram_bytes / GiB:,.0f} GiB RAM, {h.cores} cores, {h.numa_nodes} NUMA node(s), "
        f"{h.bandwidth / GB:,.0f} GB/s sustained ({SUSTAINED:.0%} of {h.peak_bw / GB:,.0f} peak)",
        f"cache for {max_num_seqs} requests of {context:,} tokens: {p.cache / GB:,.1f} GB; "
        f"needs {p.needs / GB:,.1f} GB of {p.usable / GB:,.1f} usable ({RAM_FRACTION:.0%} of RAM): "
        + ("fits" if p.fits else "does NOT fit"),
        "decode (the bandwidth roofline: an upper bound): "
        + ", ".join(f"{b} stream{'s' if b > 1 else ''} {r:,.1f} tok/s" for b, r in p.streams.items()),
        f"launch: {p.launch}" if p.fits else "launch: none (lower --context / --max-num-seqs, or --experts mxfp4)",
        f"assumptions: {SUSTAINED:.0%} of peak bandwidth sustained, {MFU:.0%} of FMA peak when compute-bound, "
        f"{OVERHEAD / GiB:.0f} GiB runtime overhead",
    ]
    return "\n".join(out)
