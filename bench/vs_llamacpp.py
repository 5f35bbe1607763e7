"""Benchmark: k3serve vs llama.cpp on the same checkpoint, same run, same threads (issue 15).

    .venv/bin/python bench/vs_llamacpp.py [--threads 2] [--only k3-mxfp4,kl-bf16,kl-400m]

First use builds llama.cpp from the `llama-cpp-python` sdist on PyPI (it vendors the whole tree,
with its kimi-k3 / kimi-linear models and converter) into ~/.cache/k3serve/llamacpp (about 8
minutes on 2 cores); nothing of llama.cpp is kept in this repository. Each checkpoint is
converted with llama.cpp's own `convert_hf_to_gguf.py` (its compressed-tensors path keeps K3's
MXFP4 experts MXFP4; the rest bf16). The tiny checkpoints' tokenizer is Kimi's tiktoken format
with small ranks, so the converter is handed an adapter for it (the hash check that names the
pre-tokenizer cannot know a tiny vocabulary; the regex is Kimi's, `kimi-k2`).

Measured, alternating the two engines, best of `--repeats`: prefill 512 (llama-bench pp512;
k3serve: a 512-token prompt to its first token, after one warm-up prompt, best of two), decode 1 stream (tg64; k3serve: 64 greedy
tokens after a 32-token prompt), and 8 / 16 concurrent streams (llama-batched-bench, 32-token
prompts, 64 tokens each; k3serve: the same through continuous batching, median of three), as aggregate tok/s.
Prints the ratios k3serve / llama.cpp and writes bench/results/vs_llamacpp.json.
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
TARGETS = ("llama-bench", "llama-batched-bench")
PROMPT, NEW = 32, 64


# ---- llama.cpp: fetch, build, convert ---------------------------------------------------------
def llama_tree() -> Path:
    found = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                    "-d", str(CACHE)], check=True)
    with tarfile.open(next(CACHE.glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(CACHE, filter="data")
    return sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def llama_bin(name: str) -> Path:
    build = CACHE / "build"
    exe = build / "bin" / name
    if not all((build / "bin" / t).exists() for t in TARGETS):
        tree = llama_tree()
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
                       check=True)
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
        subprocess.run([sys.executable, "-c", _CONVERT, str(llama_tree()), str(ckpt), str(out)], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def llama_prefill_decode(gguf: Path, threads: int) -> tuple[float, float]:
    r = subprocess.run([str(llama_bin("llama-bench")), "-m", str(gguf), "-p", "512", "-n", str(NEW),
                        "-t", str(threads), "-r", "3", "-o", "json"], check=True, capture_output=True, text=True)
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
    r = subprocess.run([str(llama_bin("llama-batched-bench")), "-m", str(gguf), "-c", str(streams * (PROMPT + NEW)),
                        "-b", "2048", "-ub", "512", "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(streams),
                        "-t", str(threads), "--output-format", "jsonl"], check=True, capture_output=True, text=True)
    rows = [json.loads(line[line.index("{"):]) for line in (r.stdout + "\n" + r.stderr).splitlines()
            if '"speed_tg"' in line]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return rows[-1]["speed_tg"]


# ---- k3serve ----------------------------------------------------------------------------------
def k3serve_numbers(ckpt: Path, streams: tuple[int, ...]) -> dict[str, float]:
    from k3serve import LLM, SamplingParams

    llm = LLM(str(ckpt), dtype="bfloat16", cache_memory="256MiB", max_num_seqs=max(streams), max_model_len=1024,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    def run(n: int) -> float:
        """Median of three runs: one 64-token run on this VM varies by up to 2x (llama-bench
        reports its runs' mean)."""
        prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(PROMPT)]} for i in range(n)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))  # prompt-only warm-up
        speeds = []
        for _ in range(3):
            t = time.perf_counter()
            outs = llm.generate(prompts, greedy)
            speeds.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        return sorted(speeds)[1]

    def prefill(offset: int) -> float:  # a fresh 512-token prompt each time (no prefix caching anyway)
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": [(j + offset) % 500 + 1 for j in range(512)]},
                     SamplingParams(temperature=0, max_tokens=1))
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
    if "kl-400m" in only:  # ~410 M params, 102 M active: where weight traffic sets decode speed
        from k3serve.testing.tiny_configs import kimi_linear_400m_config

        d = CACHE / "ckpt-kimi-linear-400m"
        if not (d / "config.json").exists():
            build_tiny_checkpoint(d, kind="kimi_linear", seed=0, config=kimi_linear_400m_config())
        out["kl-400m"] = d
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="k3-mxfp4,kl-bf16", help="comma list of k3-mxfp4, kl-bf16, kl-400m")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    streams = (8, 16)
    result = {}
    for name, ckpt in checkpoints(set(args.only.split(","))).items():
        gguf = convert(ckpt, CACHE / f"{name}.gguf")
        best: dict[str, dict[str, float]] = {"k3serve": {}, "llama.cpp": {}}
        for _ in range(args.repeats):  # alternate the engines: this machine is noisy
            pp, tg = llama_prefill_decode(gguf, args.threads)
            ll = {"prefill_512": pp, "decode_1": tg, **{f"streams_{n}": llama_parallel(gguf, args.threads, n)
                                                        for n in streams}}
            ks = k3serve_numbers(ckpt, streams)
            for who, nums in (("k3serve", ks), ("llama.cpp", ll)):
                for k, v in nums.items():
                    if v == v:  # NaN: no result this round
                        best[who][k] = max(best[who].get(k, 0.0), v)
                    else:
                        best[who].setdefault(k, 0.0)
        ratios = {k: best["k3serve"][k] / best["llama.cpp"][k] if best["llama.cpp"][k] else None
                  for k in best["k3serve"]}
        result[name] = {**best, "ratio": ratios, "checkpoint": str(ckpt)}
        print(f"\n{name} ({ckpt.name}), {args.threads} threads, tok/s (best of {args.repeats})")
        for k in best["k3serve"]:
            print(f"  {k:12s} k3serve {best['k3serve'][k]:9.1f}   llama.cpp {best['llama.cpp'][k]:9.1f}   "
                  + (f"ratio {ratios[k]:.2f}x" if ratios[k] is not None else "ratio n/a"))
    path = Path(__file__).parent / "results" / "vs_llamacpp.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
