"""Videos -> 4-frame chunks of NaViT patches for MoonViT3d (k3-model-spec.md §9.2-9.3).

References: transformers' kimi_k25 video processor and processor (frame sampling by
`default_sample_indices_fn`, 4-frame chunks, the per-chunk prompt block with its timestamp).

- Decoding: PyAV (FFmpeg), the container / codec FFmpeg recognises (MP4, WebM, MKV, animated
  GIF...), first video stream. Refused with a MediaError naming the problem: undecodable bytes,
  no video stream, frames over the pixel limit, more frames than `max_decoded_frames`.
- Sampling at `sample_fps` (2 per second): n = max(1, int(total / fps * sample_fps)), at most
  `max_frames`; indices i * total // n; a frame's timestamp is index / fps (seconds).
- Each frame goes through the image path (multimodal/image.py: resize keeping aspect, pad to
  28 px, normalise) with the per-frame patch limit `in_patch_limit_each_frame` (4096).
- Chunks of `temporal_merge` (4) frames, the last may be shorter: pixel_values
  [t * h * w, 3, p, p] (frame-major), grid (t, h, w). The tower averages each 2x2 group over
  the chunk's frames (sd2_tpool), so a chunk costs one frame's tokens: (h / 2) * (w / 2).
- A chunk's prompt block: `HH:MM:SS.fff<|media_begin|>video<|media_content|>` + pads +
  `<|media_end|>`, the time of its first frame (chat/k3_xtml.py writes it).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass

import torch

from k3serve.multimodal.image import ImageSpec, MediaError, preprocess


@dataclass(frozen=True)
class VideoSpec:
    patch_size: int = 14
    sample_fps: float = 2.0
    temporal_merge: int = 4  # frames per chunk (temporal_merge_kernel_size; the tower's time table)
    in_patch_limit_each_frame: int = 4096
    patch_limit_on_one_side: int = 512
    max_frames: int = 64  # sampled frames per video (uniform over the whole video above this)
    max_decoded_frames: int = 20_000  # frames FFmpeg may decode to reach them
    max_pixels: int = 8_294_400  # per frame (3840 x 2160)

    def frame_spec(self) -> ImageSpec:
        return ImageSpec(
            patch_size=self.patch_size,
            in_patch_limit=self.in_patch_limit_each_frame,
            patch_limit_on_one_side=self.patch_limit_on_one_side,
            max_pixels=self.max_pixels,
        )


@dataclass(frozen=True)
class VideoChunk:
    """One media item for the tower: up to 4 frames of one size."""

    pixel_values: torch.Tensor  # [t * h * w, 3, p, p] float32
    grid: tuple[int, int, int]  # (t, h, w)
    timestamp: float  # seconds, of the chunk's first frame
    digest: str  # sha256 of the chunk's resized pixels: encoder-cache / prefix-cache key

    @property
    def num_tokens(self) -> int:
        return (self.grid[1] // 2) * (self.grid[2] // 2)

    @property
    def label(self) -> str:
        """The chunk's time as the prompt writes it: HH:MM:SS.fff."""
        t = self.timestamp
        return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}"


@dataclass(frozen=True)
class ProcessedVideo:
    chunks: tuple[VideoChunk, ...]
    size: tuple[int, int]  # original (width, height)
    fps: float
    total_frames: int
    indices: tuple[int, ...]  # the sampled frame indices

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def sample_indices(total: int, fps: float, spec: VideoSpec = VideoSpec()) -> list[int]:
    n = min(spec.max_frames, total, max(1, int(total / fps * spec.sample_fps)))
    return [i * total // n for i in range(n)]


def decode(data: bytes, spec: VideoSpec = VideoSpec()) -> tuple[list, float, int, tuple[int, int]]:
    """(sampled frames as RGB PIL images, fps, total frames, (width, height))."""
    import av

    try:
        fps, size, total = _probe(av, data, spec)
        wanted = sample_indices(total, fps, spec)
        frames = _sampled(av, data, set(wanted))
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OSError) as e:
        raise MediaError(f"video cannot be decoded ({type(e).__name__}: {e})") from None
    if len(frames) != len(wanted):
        raise MediaError(f"video decoded {total} frames, then only {len(frames)} of the {len(wanted)} sampled")
    return frames, fps, total, size


def _probe(av, data: bytes, spec: VideoSpec) -> tuple[float, tuple[int, int], int]:
    """Frame rate, size and the decoded frame count (container headers may not state it, or
    state it wrongly). Frames are dropped as they come: only the sampled ones are kept, by a
    second pass, so a long video of small frames never sits in memory."""
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise MediaError("the file has no video stream")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w * h > spec.max_pixels:
            raise MediaError(f"video frames of {w}x{h} pixels are over the {spec.max_pixels:,}-pixel limit")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not fps > 0:
            raise MediaError("the video stream states no frame rate")
        total = 0
        for frame in container.decode(stream):
            if frame.width * frame.height > spec.max_pixels:
                raise MediaError(f"a video frame of {frame.width}x{frame.height} pixels is over the pixel limit")
            total += 1
            if total > spec.max_decoded_frames:
                raise MediaError(f"video has more than {spec.max_decoded_frames:,} frames")
    if total == 0:
        raise MediaError("video has no decodable frames")
    return fps, (w, h), total


def _sampled(av, data: bytes, wanted: set[int]) -> list:
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        return [f.to_image() for i, f in enumerate(container.decode(stream)) if i in wanted]


def load_video(data: bytes, spec: VideoSpec = VideoSpec()) -> ProcessedVideo:
    images, fps, total, size = decode(data, spec)
    indices = sample_indices(total, fps, spec)
    frames = [preprocess(im, spec.frame_spec()) for im in images]
    chunks = []
    for start in range(0, len(frames), spec.temporal_merge):
        group = frames[start : start + spec.temporal_merge]
        _, h, w = group[0].grid
        if any(f.grid != group[0].grid for f in group):
            raise MediaError(f"video frames change size within the chunk at {indices[start] / fps:.3f} s")
        pixels = torch.cat([f.pixel_values for f in group])  # frame-major: [t * h * w, 3, p, p]
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        chunks.append(VideoChunk(pixels, (len(group), h, w), indices[start] / fps, digest))
    return ProcessedVideo(tuple(chunks), size, fps, total, tuple(indices))
