"""Small media made on the spot for tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

import io

import numpy as np


def random_video(
    seed: int, frames: int = 12, fps: int = 4, size=(24, 20), codec: str = "mpeg4", fmt: str = "mp4"
) -> bytes:
    """A video encoded with PyAV: each frame a random field of 4x4-pixel cells (distinct per seed
    and frame, coarse enough that a lossy codec keeps it distinct)."""
    import av

    rng = np.random.default_rng(seed)
    w, h = size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for _ in range(frames):
            cells = (rng.random((-(-h // 4), -(-w // 4), 3)) * 255).astype("uint8")
            arr = np.ascontiguousarray(np.repeat(np.repeat(cells, 4, 0), 4, 1)[:h, :w])
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()
