"""Benchmark: the vision path on the tiny vision K3 (issue 21 figures).

1. Vision encoder throughput: a 448x448 image (resized to the 16,384-patch limit) through
   MoonViT3d + the projector, tokens (projector rows) per second, best of 3.
2. TTFT of a prompt holding that image, sent again, encoder cache on vs off (prefix caching off
   in both, so only the encoder cache differs), best of 3. The tiny model's 4,096 positions
   hold the image at a 4,096-patch limit (1,024 tokens), not at the full 16,384.
3. A 5 s, 30 fps, 448x448 clip (MPEG-4): decode + 2 fps sampling + preprocessing time, and the
   encoder's time for its 4-frame chunks (a frame is 64 x 64 patches at the 4,096-per-frame
   limit; a chunk costs one frame's 1,024 tokens).
Writes bench/results/vision_encoder.json.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from k3serve import LLM, SamplingParams
from k3serve.chat.k3_xtml import Seg, encode_segments, media_block, message, open_tag
from k3serve.multimodal.image import ImageSpec, load_image
from k3serve.multimodal.video import VideoSpec, load_video
from k3serve.testing.sample_media import random_video
from k3serve.testing.builder import build_tiny_checkpoint

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def image_bytes(size: int = 448, seed: int = 0) -> bytes:
    arr = (np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def best(f, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    ckpt = build_tiny_checkpoint(Path.home() / ".cache" / "k3serve" / "bench-tiny-vision-k3", "k3")
    llm = LLM(
        str(ckpt), cache_memory="256MiB", max_model_len=4096, enable_prefix_caching=False, max_num_batched_tokens=4096
    )
    eng = llm.engine
    spec = ImageSpec(patch_size=eng.model.cfg.vision.patch_size)
    img = load_image(image_bytes(), spec)
    vm = eng.media.model
    encode_s = best(lambda: vm.encode(img.pixel_values, [img.grid]))
    small = load_image(image_bytes(), ImageSpec(patch_size=spec.patch_size, in_patch_limit=4096))
    segs = (
        message("user", [Seg("What is in this picture?")] + media_block(small))
        + open_tag("message", [("role", "assistant")])
        + open_tag("response")
    )
    ids = encode_segments(eng.tokenizer, segs)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [small]}}
    runs = {}
    for name, cache_bytes in (("encoder_cache_off", 0), ("encoder_cache_on", 256 << 20)):
        eng.media.cache_bytes = cache_bytes
        eng.media.cache.clear()
        eng.media.used = 0
        llm.generate([prompt], ONE)  # first sight of the image (fills the cache when on)
        runs[name] = best(lambda: llm.generate([prompt], ONE))
    result = {
        "image": "448x448 PNG",
        "patches": img.grid[1] * img.grid[2],
        "tokens": img.num_tokens,
        "encode_s": encode_s,
        "encoder_tokens_per_s": img.num_tokens / encode_s,
        "ttft_image_tokens": small.num_tokens,
        "prompt_tokens": len(ids),
        "ttft_s": runs,
        "ttft_ratio_off_over_on": runs["encoder_cache_off"] / runs["encoder_cache_on"],
    }
    print(
        f"vision encoder: {img.grid[1]}x{img.grid[2]} patches -> {img.num_tokens} tokens in {encode_s * 1000:.0f} ms "
        f"= {result['encoder_tokens_per_s']:,.0f} tokens/s"
    )
    print(
        f"TTFT, repeated image, {len(ids)}-token prompt: encoder cache off {runs['encoder_cache_off'] * 1000:.0f} ms, "
        f"on {runs['encoder_cache_on'] * 1000:.0f} ms ({result['ttft_ratio_off_over_on']:.2f}x)"
    )
    result["video"] = video_figures(vm, spec.patch_size)
    (out / "vision_encoder.json").write_text(json.dumps(result, indent=2))


def video_figures(vm, patch_size: int) -> dict:
    data = random_video(0, frames=150, fps=30, size=(448, 448))
    spec = VideoSpec(patch_size=patch_size)
    process_s = best(lambda: load_video(data, spec))
    v = load_video(data, spec)
    encode_s = best(lambda: [vm.encode(c.pixel_values, [c.grid]) for c in v.chunks])
    r = {
        "clip": "5 s, 30 fps, 448x448 MPEG-4",
        "bytes": len(data),
        "sampled_frames": len(v.indices),
        "chunks": [list(c.grid) for c in v.chunks],
        "tokens": v.num_tokens,
        "process_s": process_s,
        "encode_s": encode_s,
        "encoder_tokens_per_s": v.num_tokens / encode_s,
    }
    print(
        f"video: {len(v.indices)} frames sampled of 150, {len(v.chunks)} chunks {r['chunks']}, {v.num_tokens} "
        f"tokens; decode + preprocess {process_s * 1000:.0f} ms, encode {encode_s * 1000:.0f} ms"
    )
    return r


if __name__ == "__main__":
    main()
