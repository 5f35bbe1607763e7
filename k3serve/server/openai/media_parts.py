"""Media parts of chat messages -> processed images and videos, under the server's limits.

`image_url` / `video_url` parts (`{"url": ...}` or the URL itself) carry a `data:` URL (base64);
http(s) URLs are fetched only from `--allowed-media-domains` (off by default), with a size and
time limit. At most `--limit-mm-per-prompt` images and videos per request
(`{"image": 8, "video": 1}`). Every refusal names the part (`messages[0].content[1]: ...`) and
becomes a 400.
"""

from __future__ import annotations

import base64
import dataclasses
import binascii
import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from k3serve.chat.messages import ChatInputError
from k3serve.multimodal.image import ImageSpec, MediaError, load_image
from k3serve.multimodal.video import ProcessedVideo, VideoSpec, load_video


@dataclass(frozen=True)
class MediaLimits:
    images_per_prompt: int = 8
    videos_per_prompt: int = 1
    allowed_domains: tuple[str, ...] = ()  # fetch http(s) media only from these hosts
    max_bytes: int = 20 * 2**20  # an image
    max_video_bytes: int = 64 * 2**20
    fetch_timeout_s: float = 10.0
    spec: ImageSpec = field(default_factory=ImageSpec)
    video: VideoSpec = field(default_factory=VideoSpec)


class MediaLoader:
    """One request's loader: counts its images and videos against the per-prompt limits."""

    def __init__(self, limits: MediaLimits, patch_size: int):
        self.limits = limits
        self.spec = ImageSpec(patch_size=patch_size, max_pixels=limits.spec.max_pixels)
        self.video_spec = dataclasses.replace(limits.video, patch_size=patch_size)
        self.count = {"image": 0, "video": 0}
        self._lock = threading.Lock()

    def __call__(self, part: dict, where: str):
        kind = "video" if part.get("type") == "video_url" else "image"
        limit = self.limits.videos_per_prompt if kind == "video" else self.limits.images_per_prompt
        with self._lock:
            self.count[kind] += 1
            if self.count[kind] > limit:
                raise ChatInputError(f"{where}: more than {limit} {kind}s in one request (--limit-mm-per-prompt)")
        field_name = "video_url" if kind == "video" else "image_url"
        ref = part.get(field_name)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ChatInputError(f"{where}: {field_name}.url must be a data: or http(s) URL")
        max_bytes = self.limits.max_video_bytes if kind == "video" else self.limits.max_bytes
        try:
            data = self._bytes(url, where, kind, max_bytes)
            return load_video(data, self.video_spec) if kind == "video" else load_image(data, self.spec)
        except MediaError as e:
            raise ChatInputError(f"{where}: {e}") from None

    def _bytes(self, url: str, where: str, kind: str, max_bytes: int) -> bytes:
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or ";base64" not in head:
                raise ChatInputError(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ChatInputError(f"{where}: the data URL is not valid base64") from None
            if len(data) > max_bytes:
                raise ChatInputError(f"{where}: {kind} of {len(data):,} bytes is over the {max_bytes:,} limit")
            return data
        host = urlparse(url).hostname or ""
        if urlparse(url).scheme not in ("http", "https"):
            raise ChatInputError(f"{where}: {kind}_url must be a data: or http(s) URL")
        if host not in self.limits.allowed_domains:
            raise ChatInputError(
                f"{where}: fetching media from {host or url!r} is off; send a data: URL or start the "
                f"server with --allowed-media-domains {host}"
            )
        return self._fetch(url, where, kind, max_bytes)

    def _fetch(self, url: str, where: str, kind: str, max_bytes: int) -> bytes:
        import httpx

        try:
            with httpx.stream("GET", url, timeout=self.limits.fetch_timeout_s, follow_redirects=False) as r:
                r.raise_for_status()
                data = bytearray()
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise ChatInputError(f"{where}: the {kind} at {url} is over {max_bytes:,} bytes")
                return bytes(data)
        except httpx.HTTPError as e:
            raise ChatInputError(f"{where}: fetching {url} failed ({type(e).__name__})") from None


def engine_prompt(prompt_ids: list[int], media: tuple = ()) -> dict:
    """The engine's prompt input: ids, and the rendered images and videos (vLLM's keys)."""
    prompt: dict = {"prompt_token_ids": prompt_ids}
    if media:
        prompt["multi_modal_data"] = {
            "image": [m for m in media if not isinstance(m, ProcessedVideo)],
            "video": [m for m in media if isinstance(m, ProcessedVideo)],
        }
    return prompt
