"""Benchmark: the prefix cache's host and disk tiers on a multi-turn chat workload (issue 49).

    python bench/prefix_tiers.py [--conversations 32] [--turns 5] [--history 2048] [--turn-tokens 256]

C conversations x T turns, round-robin (every conversation's turn t before any turn t + 1):
each starts from its own `--history`-token document, each turn adds `--turn-tokens` of user
text and the model's `--answer` tokens, so turn t's prompt is the conversation so far (2-4k
tokens with the defaults). The device pool is sized to a tenth of the conversations' working
set, so by the time a conversation comes back its prefix has left the device. Side by side in
one run, on tiny K3 (the CPU kernels), one request at a time:
  off        prefix caching on the device only (what k3serve did before the tiers);
  cpu        plus --kv-offloading-size (host memory holding the working set);
  cpu+disk   plus --kv-offloading-dir;
  cpu-wb     host memory written back (--kv-offloading-write-policy write_back: entries go
             down as the device pools evict them, not as they publish them);
  restart    a new engine on that directory replaying every conversation's last turn.
For each: TTFT p50 / p99 over turns >= 2 (restart: its replayed turns), prefill tokens a
second, cached tokens. Target on this machine (issue 49): TTFT p50 at turns >= 2 at least 3x
better with the tiers than without. Writes bench/results/prefix_tiers.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import build_tiny_checkpoint


def conversations(args):
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(1, 500, (n,), generator=g).tolist()  # noqa: E731
    return [rand(args.history) for _ in range(args.conversations)], [
        [rand(args.turn_tokens) for _ in range(args.turns)] for _ in range(args.conversations)
    ]


def serve(llm, docs, turns, answer, replay=None):
    """Run the workload; per request (turn, TTFT s, prompt tokens, cached tokens); the last
    turn's prompts (for the restart) or, with `replay`, those prompts once each."""
    sp = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    rows, last = [], []

    def one(prompt, turn):
        out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
        m = out.metrics
        rows.append((turn, m["first_token_time"] - m["arrival_time"], len(prompt), out.num_cached_tokens))
        return out.outputs[0].token_ids

    if replay is not None:
        for p in replay:
            one(p, len(turns[0]))
        return rows, replay
    history = [list(d) for d in docs]
    for t in range(len(turns[0])):
        for c in range(len(docs)):
            prompt = history[c] + turns[c][t]
            if t == len(turns[0]) - 1:
                last.append(prompt)
            # the answer joins the history, less any special id (a media pad would ask for an image)
            history[c] = prompt + [tok for tok in one(prompt, t + 1) if tok < 500]
    return rows, last


def summary(rows, seconds):
    later = [r for r in rows if r[0] >= 2]
    ttft = sorted(r[1] for r in later)
    computed = sum(r[2] - r[3] for r in rows)
    return {
        "requests": len(rows),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "cached_tokens": sum(r[3] for r in later),
        "prompt_tokens": sum(r[2] for r in later),
        "prefill_tok_s": computed / max(1e-9, sum(r[1] for r in rows)),
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--kernels", default="auto")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3serve-tiers-"))
    ckpt = build_tiny_checkpoint(work / "tiny_k3", kind="k3", seed=0)
    docs, turns = conversations(args)
    final = args.history + args.turns * (args.turn_tokens + args.answer)
    probe = LLM(str(ckpt), kernels="torch", cache_memory="64MiB", max_model_len=final + 64)
    token_bytes, slot_bytes = probe.engine.plan.token_bytes, probe.engine.plan.slot_bytes
    del probe
    working_set = args.conversations * (final - args.answer) * token_bytes
    # a tenth of the working set, at least one whole request plus its checkpoints
    device = max(working_set // 10, 2 * (final + 64) * token_bytes + 8 * slot_bytes)
    host_gib = 2 * (working_set + args.conversations * args.turns * 2 * slot_bytes) / 2**30
    base = dict(
        kernels=args.kernels,
        cache_memory=int(device),
        max_model_len=final + 64,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        seed=0,
    )
    disk = work / "tiers"
    modes = {
        "off": {},
        "cpu": dict(kv_offloading_size=host_gib),
        "cpu+disk": dict(kv_offloading_size=host_gib, kv_offloading_dir=str(disk)),
        "cpu-wb": dict(kv_offloading_size=host_gib, kv_offloading_write_policy="write_back"),
    }
    out = {
        "args": vars(args),
        "working_set_MiB": working_set / 2**20,
        "device_pool_MiB": device / 2**20,
        "host_GiB": host_gib,
        "results": {},
    }
    print(
        f"working set {working_set / 2**20:.1f} MiB, device pool {device / 2**20:.1f} MiB "
        f"({working_set / device:.1f}x), host tier {host_gib * 1024:.0f} MiB",
        flush=True,
    )
    last = None
    for name, kw in modes.items():
        llm = LLM(str(ckpt), **base, **kw)
        t0 = time.perf_counter()
        rows, last = serve(llm, docs, turns, args.answer)
        out["results"][name] = summary(rows, time.perf_counter() - t0)
        if llm.engine.tiers is not None:  # what went down to host memory (write-through vs write-back)
            out["results"][name]["host_bytes_written"] = llm.engine.tiers.index.stats["cpu"].bytes_written
        llm.engine.shutdown()
        del llm
        print(f"{name:9s} {out['results'][name]}", flush=True)
    llm = LLM(str(ckpt), **base, **modes["cpu+disk"])
    t0 = time.perf_counter()
    rows, _ = serve(llm, docs, turns, args.answer, replay=last)
    out["results"]["restart"] = summary(rows, time.perf_counter() - t0)
    print(f"{'restart':9s} {out['results']['restart']}", flush=True)
    off = out["results"]["off"]["ttft_p50_ms"]
    out["ttft_p50_speedup"] = {k: off / v["ttft_p50_ms"] for k, v in out["results"].items()}
    print("TTFT p50 speed-up over off, turns >= 2:", {k: round(v, 2) for k, v in out["ttft_p50_speedup"].items()})
    path = Path(__file__).parent / "results" / "prefix_tiers.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
