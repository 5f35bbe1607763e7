"""Benchmark: each Triton kernel (issue 52) against the bytes it must read, as a fraction of
the device's measured copy bandwidth.

    python bench/triton_kernels.py [--shapes kl-48b,k3] [--batches 1,16,64] [--context 4096] [--device cuda]

Per layer shape (Kimi-Linear-48B: KDA 32x128 heads, MLA 32 heads, 256 bf16 experts top-8, 2304
-> 1024; K3: KDA 96x128, MLA 96 heads, MXFP4 experts top-16 of 896, latent 3584 -> 3072, of
which only the experts a batch touches are allocated) and batch size, side by side in one run:
  KDA decode   (short conv + fla's fused recurrent kernel + gated norm): fp32 state read and
               written, [B, H, 128, 128];
  MLA decode   (the paged split-KV kernel, absorption GEMMs around it): B x context x 576 latent
               rows in bf16;
  MoE experts  (align + two grouped GEMMs): the touched experts' three matrices, MXFP4 at
               0.53125 B/param or bf16.
Time is the median of CUDA-event-timed calls after warm-up; the bandwidth is a device-to-device
copy measured in the same run. Issue 52's target: the MoE kernel >= 60% of bandwidth at one
stream. On a CPU (`--device cpu`), `--shapes tiny` runs under the interpreter as the script's
own check, two timed calls each (the figures mean nothing there). Writes --json (default
bench/results/triton_kernels.json); prints last each shape's MoE fraction at the smallest batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # H, D: KDA heads x dim; mh: MLA heads; c, r, nope, v; d_in, inter, E, k, mxfp4
    "tiny": dict(H=2, D=16, mh=2, c=32, r=16, nope=16, v=16, d_in=64, inter=64, E=8, k=2, mxfp4=True),
    "kl-48b": dict(H=32, D=128, mh=32, c=512, r=64, nope=128, v=128, d_in=2304, inter=1024, E=256, k=8, mxfp4=False),
    "k3": dict(H=96, D=128, mh=96, c=512, r=64, nope=128, v=128, d_in=3584, inter=3072, E=896, k=16, mxfp4=True),
}


def timed(fn, device, reps=None):
    reps = reps or (20 if device.type == "cuda" else 2)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / timed(lambda: dst.copy_(src), device, reps=10)  # read + write


def kda_case(s, B, device):
    from k3serve.kernels.triton import kda

    H, D = s["H"], s["D"]
    P = H * D
    S = B + 1
    r = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    args = (r(B, 3 * P), r(B, P), r(B, H), r(B, P), r(3 * P, 4), r(H) * 0.1, r(P) * 0.1, r(D).abs())
    rec, conv = r(S, H, D, D) * 0.01, r(S, 3, 3 * P)
    slots = torch.arange(B, device=device)
    nbytes = 2 * B * H * D * D * 4 + 2 * B * 3 * 3 * P * 4  # states read and written
    return lambda: kda.kda_decode(*args, rec, conv, slots, D, -5.0, 1e-5), nbytes


def mla_case(s, B, device, context):
    from k3serve.kernels.triton import mla

    H, c, r_, bs = s["mh"], s["c"], s["r"], 64
    W = (context + bs - 1) // bs
    store = torch.randn(B * W * bs + bs, c + r_, device=device, dtype=torch.bfloat16)
    table = torch.arange(B * W, device=device).view(B, W)
    lens = torch.full((B,), context, device=device)
    q_lat, q_pe = torch.randn(B, H, c, device=device), torch.randn(B, H, r_, device=device)
    return lambda: mla.paged_attention(q_lat, q_pe, store, table, lens, bs, 0.05), B * context * (c + r_) * 2


def moe_case(s, B, device):
    from k3serve.kernels.triton import moe

    k, d, inter = s["k"], s["d_in"], s["inter"]
    E = min(s["E"], max(2 * k, B * k))  # allocate only what a batch can touch
    ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(B)])
    touched = int(torch.unique(ids).numel())
    w = torch.ones(B, k, device=device) / k
    z = torch.randn(B, d, device=device, dtype=torch.bfloat16)
    if s["mxfp4"]:
        mats = [
            torch.randint(0, 256, (E, o, i // 2), dtype=torch.uint8, device=device)
            for o, i in ((inter, d), (d, inter), (inter, d))
        ]
        scales = [torch.full((E, m.shape[1], m.shape[2] // 16), 120, dtype=torch.uint8, device=device) for m in mats]
        per_param = 0.53125
    else:
        mats = [
            torch.randn(E, o, i, device=device, dtype=torch.bfloat16) * 0.02
            for o, i in ((inter, d), (d, inter), (inter, d))
        ]
        scales, per_param = [None] * 3, 2.0
    nbytes = int(touched * 3 * inter * d * per_param)
    return lambda: moe.moe_experts(z, ids, w, *mats, *scales, True, 4.0, 25.0), nbytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", help="default kl-48b,k3 (cuda), tiny (cpu)")
    p.add_argument("--batches", help="default 1,16,64 (cuda), 1,4 (cpu)")
    p.add_argument("--context", type=int, help="default 4096 (cuda), 128 (cpu)")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "triton_kernels.json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.shapes = args.shapes or ("kl-48b,k3" if cuda else "tiny")
    args.batches = args.batches or ("1,16,64" if cuda else "1,4")
    args.context = args.context or (4096 if cuda else 128)
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    device = torch.device(args.device)
    bw = copy_bandwidth(device)
    out = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)",
        "copy_GBps": bw / 1e9,
        "results": {},
    }
    print(f"{out['device']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        s = SHAPES[name]
        for B in (int(b) for b in args.batches.split(",")):
            for kernel, (fn, nbytes) in (
                ("kda_decode", kda_case(s, B, device)),
                ("mla_decode", mla_case(s, B, device, args.context)),
                ("moe_experts", moe_case(s, B, device)),
            ):
                with torch.inference_mode():
                    t = timed(fn, device)
                row = {"us": t * 1e6, "MB": nbytes / 1e6, "GBps": nbytes / t / 1e9, "fraction": nbytes / t / bw}
                out["results"][f"{name}/{kernel}/B{B}"] = row
                print(
                    f"{name:7s} {kernel:12s} B={B:3d}: {row['us']:9.1f} us, {row['MB']:8.2f} MB, "
                    f"{row['GBps']:7.1f} GB/s = {row['fraction']:.0%} of copy",
                    flush=True,
                )
        args.json.write_text(json.dumps(out, indent=2))  # after each shape: a run cut short keeps it
    b = args.batches.split(",")[0]
    print(
        f"MoE experts at B={b}: "
        + ", ".join(f"{n} {out['results'][f'{n}/moe_experts/B{b}']['fraction']:.0%}" for n in args.shapes.split(","))
        + " of copy bandwidth (target 60%)"
    )


if __name__ == "__main__":
    main()
