"""Benchmark: k3serve vs llama.cpp on the same checkpoint, same run, same threads (issue 15).

    .venv/bin/python bench/vs_llamacpp.py [--threads 2] [--only k3-mxfp4,kl-bf16,kl-400m,kl-400m-mxfp4]

First use builds llama.cpp from the `llama-cpp-python` sdist on PyPI (it vendors the whole tree,
with its kimi-k3 / kimi-linear models and converter) into ~/.cache/k3serve/llamacpp (about 8
minutes on 2 cores); nothing of llama.cpp is kept in this repository. Each checkpoint is
converted with llama.cpp's own `convert_hf_to_gguf.py` (its compressed-tensors path keeps K3's
MXFP4 experts MXFP4; the rest bf16). The tiny checkpoints' tokenizer is Kimi's tiktoken format
with small ranks, so the converter is handed an adapter for it (the hash check that names the
pre-tokenizer cannot know a tiny vocabulary; the regex is Kimi's, `kimi-k2`).

Measured, alternating the two engines, best of `--repeats`: prefill 512 (llama-bench pp512;
k3serve: a 512-token prompt to its first token, after one warm-up prompt, best of two), decode 1 stream (tg64; k3serve: 64 greedy
tokens after a 32-token prompt, timed from the first token), and 8 / 16 concurrent streams
(llama-batched-bench, 32-token prompts, 64 tokens each, its S_TG; k3serve: the same through
continuous batching, median of three, timed from the last first token), as aggregate tok/s.
Both sides leave the prompts' prefill out of decode figures; before 2026-12-02 k3serve's
included it, which cost it 10-25% on the 400 M model.
Prints the ratios k3serve / llama.cpp, the machine's read and copy bandwidth (512 MB, so DRAM)
and the share of the read bandwidth 1-stream decode reaches (weight bytes read per token x
tok/s), and writes bench/results/vs_llamacpp.json. The MXFP4 400 M model's llama.cpp side is its
bf16 twin quantized MXFP4_MOE (llama.cpp's Kimi-Linear converter reads no MXFP4). Where a
llama.cpp tool dies of a signal with its default weight repacking (seen on an Intel Xeon with
AMX: the tiny K3 MXFP4 gguf segfaults in libggml-cpu), that gguf is rerun without repacking and
the JSON says `"llama_repack": false`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("K3SERVE_LLAMACPP_CACHE", Path.home() / ".cache" / "k3serve" / "llamacpp"))
SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
PROMPT, NEW = 32, 64


# ---- llama.cpp: fetch, build, convert ---------------------------------------------------------
def llama_tree() -> Path:
    found = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    # the source archive of llama-cpp-python alone: `--no-binary :all:` also built its build
    # requirements (CMake among them) from source to prepare its metadata, 20+ minutes before
    # the first figure; they come as wheels now, and llama.cpp builds below with the system cmake
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            SDIST.split("==")[0],
            SDIST,
            "-d",
            str(CACHE),
        ],
        check=True,
    )
    with tarfile.open(next(CACHE.glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(CACHE, filter="data")
    return sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def llama_bin(name: str) -> Path:
    build = CACHE / "build"
    exe = build / "bin" / name
    if not all((build / "bin" / t).exists() for t in TARGETS):
        tree = llama_tree()
        subprocess.run(
            [
                "cmake",
                "-S",
                str(tree),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ],
            check=True,
        )
        subprocess.run(
            ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TARGETS], check=True
        )
    return exe


_CONVERT = r'''
import sys, runpy
tree, ckpt, out = sys.argv[1:4]
sys.path[:0] = [tree, tree + "/gguf-py"]
import transformers
from k3serve.tokenizer import Tokenizer

class KimiTiktokenAdapter:
    """What the converter's kimi-k2 vocabulary path reads of Kimi's remote-code tokenizer."""
    def __init__(self, path):
        self._tok = Tokenizer.from_dir(path)
        self.model = self._tok._tk  # tiktoken.Encoding: _mergeable_ranks
        self.special_tokens = dict(self._tok.special_tokens)
        self.eos_id = self.special_tokens.get("[EOS]")
    def encode(self, text, **kw):
        return self._tok.encode(text)

transformers.AutoTokenizer.from_pretrained = staticmethod(lambda path, **kw: KimiTiktokenAdapter(path))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
base.TextModel._set_vocab_gpt2 = lambda self: (_ for _ in ()).throw(NotImplementedError())
sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", "bf16", "--outfile", out]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def convert(ckpt: Path, out: Path) -> Path:
    if not out.exists():
        subprocess.run(
            [sys.executable, "-c", _CONVERT, str(llama_tree()), str(ckpt), str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


def convert_mxfp4_moe(ckpt: Path, out: Path) -> Path:
    """llama.cpp's Kimi-Linear converter has no MXFP4 reader: convert the bf16 twin (the same
    weights, experts dequantized exactly), then `llama-quantize MXFP4_MOE` with every
    non-expert matrix kept bf16, as k3serve holds them. (MXFP4_MOE's own Q8_0 for the rest dies
    with SIGILL in llama.cpp's prefill on this VM, whose CPU flags claim AMX.)"""
    if not out.exists():
        from k3serve.testing.builder import write_bf16_twin

        twin = convert(write_bf16_twin(ckpt, ckpt.with_name(ckpt.name + "-bf16-twin")), out.with_suffix(".bf16.gguf"))
        keep = [
            a for pat in ("attn", "shexp", "ssm", r"ffn_(gate|up|down)\.") for a in ("--tensor-type", f"{pat}=bf16")
        ]
        subprocess.run(
            [
                str(llama_bin("llama-quantize")),
                *keep,
                "--output-tensor-type",
                "bf16",
                "--token-embedding-type",
                "bf16",
                str(twin),
                str(out),
                "MXFP4_MOE",
            ],
            check=True,
            capture_output=True,
        )
    return out


# ggufs on which llama.cpp's default weight repacking crashes (seen on a Xeon with AMX: the
# MXFP4 checkpoints segfault in libggml-cpu with repacking on): they run with it off, and the
# JSON says so. The default is tried first on every gguf.
NO_REPACK: set[str] = set()


def llama_run(tool: str, gguf: Path, args: list[str], no_repack: str) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool on `gguf`; if it dies of a signal with repacking on, again without."""

    def once() -> subprocess.CompletedProcess:
        extra = no_repack.split() if str(gguf) in NO_REPACK else []
        return subprocess.run([str(llama_bin(tool)), "-m", str(gguf), *args, *extra], capture_output=True, text=True)

    r = once()
    if r.returncode < 0 and str(gguf) not in NO_REPACK:
        print(f"{tool} died of signal {-r.returncode} on {gguf.name} with weight repacking: rerun without it")
        NO_REPACK.add(str(gguf))
        r = once()
    if r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
    return r


def llama_prefill_decode(gguf: Path, threads: int) -> tuple[float, float]:
    r = llama_run(
        "llama-bench", gguf, ["-p", "512", "-n", str(NEW), "-t", str(threads), "-r", "3", "-o", "json"], "--repack 0"
    )
    rows = json.loads(r.stdout)
    pp = next(x["avg_ts"] for x in rows if x["n_prompt"] == 512 and x["n_gen"] == 0)
    tg = next(x["avg_ts"] for x in rows if x["n_gen"] == NEW and x["n_prompt"] == 0)
    return pp, tg


def llama_parallel(gguf: Path, threads: int, streams: int, tries: int = 6) -> float:
    """Aggregate decode tok/s of `streams` sequences. Seen here: llama-batched-bench now and then
    exits 0 having printed nothing; such a run is repeated, and after `tries` the cell is NaN
    (reported as n/a) instead of losing the whole run."""
    for _ in range(tries):
        try:
            return _batched_once(gguf, threads, streams)
        except RuntimeError as e:
            last = e
    print(f"llama-batched-bench gave no result for {streams} streams in {tries} tries: {str(last)[-200:]}")
    return float("nan")


def _batched_once(gguf: Path, threads: int, streams: int) -> float:
    r = llama_run(
        "llama-batched-bench",
        gguf,
        [
            "-c",
            str(streams * (PROMPT + NEW)),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(PROMPT),
            "-ntg",
            str(NEW),
            "-npl",
            str(streams),
            "-t",
            str(threads),
            "--output-format",
            "jsonl",
        ],
        "-nr",
    )
    rows = [
        json.loads(line[line.index("{") :])
        for line in (r.stdout + "\n" + r.stderr).splitlines()
        if '"speed_tg"' in line
    ]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return rows[-1]["speed_tg"]


# ---- k3serve ----------------------------------------------------------------------------------
def k3serve_numbers(ckpt: Path, streams: tuple[int, ...]) -> dict[str, float]:
    from k3serve import LLM, SamplingParams

    llm = LLM(
        str(ckpt),
        dtype="bfloat16",
        cache_memory="256MiB",
        max_num_seqs=max(streams),
        max_model_len=1024,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    def run(n: int) -> float:
        """Decode tok/s of n streams, as llama.cpp counts it: llama-bench's tg64 decodes from an
        empty context and llama-batched-bench's S_TG times the generation after every prompt is
        processed, so the prompts' prefill is left out here too: the tokens after each stream's
        first over the time from the last first token to the last finish (every prompt prefills
        in the first step). Median of three runs: one 64-token run on this VM varies by up to 2x
        (llama-bench reports its runs' mean)."""
        prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(PROMPT)]} for i in range(n)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))  # prompt-only warm-up
        speeds = []
        for _ in range(3):
            outs = llm.generate(prompts, greedy)
            first = max(o.metrics["first_token_time"] for o in outs)
            last = max(o.metrics["finish_time"] for o in outs)
            speeds.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
        return sorted(speeds)[1]

    def prefill(offset: int) -> float:  # a fresh 512-token prompt each time (no prefix caching anyway)
        t = time.perf_counter()
        llm.generate(
            {"prompt_token_ids": [(j + offset) % 500 + 1 for j in range(512)]},
            SamplingParams(temperature=0, max_tokens=1),
        )
        return 512 / (time.perf_counter() - t)

    prefill(0)  # warm-up, as llama-bench warms up before pp512
    out = {"prefill_512": max(prefill(i) for i in (1, 2)), "decode_1": run(1)}
    out.update({f"streams_{n}": run(n) for n in streams})
    return out


def checkpoints(only: set[str]) -> dict[str, Path]:
    from k3serve.testing.builder import build_tiny_checkpoint, ensure_default_model

    out = {}
    if "k3-mxfp4" in only:
        out["k3-mxfp4"] = ensure_default_model()
    if "kl-bf16" in only:
        d = CACHE / "ckpt-tiny-kimi-linear"
        if not (d / "config.json").exists():
            build_tiny_checkpoint(d, kind="kimi_linear", seed=0)
        out["kl-bf16"] = d
    for name, mxfp4 in (("kl-400m", False), ("kl-400m-mxfp4", True)):
        if name in only:  # ~410 M params, 102 M active: where weight traffic sets decode speed
            from k3serve.testing.tiny_configs import kimi_linear_400m_config

            d = CACHE / f"ckpt-kimi-linear-400m{'-mxfp4' if mxfp4 else ''}"
            if not (d / "config.json").exists():
                build_tiny_checkpoint(d, kind="kimi_linear", seed=0, config=kimi_linear_400m_config(mxfp4))
            out[name] = d
    return out


# ---- the machine's bandwidth and what decode reads --------------------------------------------
def bandwidth(threads: int, nbytes: int = 512 << 20) -> dict[str, float]:
    """GB/s of a 512 MB fp32 read (sum) and copy (read + write counted), best of 5: far past any
    cache, so DRAM."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)

    def best(f) -> float:
        f()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    return {"read_GBps": nbytes / best(src.sum) / 1e9, "copy_GBps": 2 * nbytes / best(lambda: dst.copy_(src)) / 1e9}


def bytes_per_token(ckpt: Path) -> int:
    """Weight bytes one decode token reads: every tensor but the embedding table (one row of it)
    and the routed experts (top_k of num_experts per MoE layer), at their stored size (packed
    MXFP4 codes + scales for a 4-bit checkpoint). KV/state reads at these lengths are < 1%."""
    from k3serve.config.model_config import ModelConfig
    from k3serve.weights.checkpoint import CheckpointIndex

    cfg = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    total = 0
    for name, t in CheckpointIndex.open(ckpt).tensors.items():
        if name.endswith("embed_tokens.weight"):
            total += t.nbytes // cfg.vocab_size
        elif ".experts." in name and ".shared_experts." not in name:
            total += t.nbytes * cfg.moe.top_k // cfg.moe.num_experts
        else:
            total += t.nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--only", default="k3-mxfp4,kl-bf16", help="comma list of k3-mxfp4, kl-bf16, kl-400m, kl-400m-mxfp4"
    )
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    streams = (8, 16)
    from k3serve import kernels

    module = kernels.get("auto")
    result: dict = {"machine": {**bandwidth(args.threads), "kernels": module.simd() if module else "torch"}}
    print(
        f"memory bandwidth, {args.threads} threads: read {result['machine']['read_GBps']:.1f} GB/s, "
        f"copy {result['machine']['copy_GBps']:.1f} GB/s; k3serve kernels: {result['machine']['kernels']}"
    )
    for name, ckpt in checkpoints(set(args.only.split(","))).items():
        gguf = (convert_mxfp4_moe if name.endswith("-mxfp4") else convert)(ckpt, CACHE / f"{name}.gguf")
        best: dict[str, dict[str, float]] = {"k3serve": {}, "llama.cpp": {}}
        for _ in range(args.repeats):  # alternate the engines: this machine is noisy
            pp, tg = llama_prefill_decode(gguf, args.threads)
            ll = {
                "prefill_512": pp,
                "decode_1": tg,
                **{f"streams_{n}": llama_parallel(gguf, args.threads, n) for n in streams},
            }
            ks = k3serve_numbers(ckpt, streams)
            for who, nums in (("k3serve", ks), ("llama.cpp", ll)):
                for k, v in nums.items():
                    if v == v:  # NaN: no result this round
                        best[who][k] = max(best[who].get(k, 0.0), v)
                    else:
                        best[who].setdefault(k, 0.0)
        ratios = {
            k: best["k3serve"][k] / best["llama.cpp"][k] if best["llama.cpp"][k] else None for k in best["k3serve"]
        }
        result[name] = {**best, "ratio": ratios, "checkpoint": str(ckpt), "llama_repack": str(gguf) not in NO_REPACK}
        per_token = bytes_per_token(ckpt)
        share = {who: best[who]["decode_1"] * per_token / 1e9 / result["machine"]["read_GBps"] for who in best}
        result[name].update(bytes_per_token=per_token, decode_bandwidth_share=share)
        print(
            f"\n{name} ({ckpt.name}), {args.threads} threads, tok/s (best of {args.repeats})"
            + ("" if result[name]["llama_repack"] else "; llama.cpp without weight repacking (it crashed with)")
        )
        for k in best["k3serve"]:
            print(
                f"  {k:12s} k3serve {best['k3serve'][k]:9.1f}   llama.cpp {best['llama.cpp'][k]:9.1f}   "
                + (f"ratio {ratios[k]:.2f}x" if ratios[k] is not None else "ratio n/a")
            )
        print(
            f"  decode reads {per_token / 1e6:.1f} MB/token: k3serve {share['k3serve']:.0%}, llama.cpp "
            f"{share['llama.cpp']:.0%} of the read bandwidth"
        )
    path = Path(__file__).parent / "results" / "vs_llamacpp.json"
    path.parent.mkdir(exist_ok=True)
    kept = json.loads(path.read_text()) if path.exists() else {}  # checkpoints not rerun keep their figures
    path.write_text(json.dumps({**kept, **result}, indent=2))


if __name__ == "__main__":
    main()
