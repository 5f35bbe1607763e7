"""Media parts of chat messages -> processed images, under the server's limits.

`image_url` parts (`{"url": ...}` or the URL itself) carry a `data:` URL (base64); http(s) URLs
are fetched only from `--allowed-media-domains` (off by default), with a size and time limit.
At most `--limit-mm-per-prompt` images per request. Every refusal names the part
(`messages[0].content[1]: ...`) and becomes a 400.
"""

from __future__ import annotations

import base64
import binascii
import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from k3serve.chat.messages import ChatInputError
from k3serve.multimodal.image import ImageSpec, MediaError, load_image


@dataclass(frozen=True)
class MediaLimits:
    images_per_prompt: int = 8
    allowed_domains: tuple[str, ...] = ()  # fetch http(s) media only from these hosts
    max_bytes: int = 20 * 2 ** 20
    fetch_timeout_s: float = 10.0
    spec: ImageSpec = field(default_factory=ImageSpec)


class MediaLoader:
    """One request's loader: counts its images against the per-prompt limit."""

    def __init__(self, limits: MediaLimits, patch_size: int):
        self.limits = limits
        self.spec = ImageSpec(patch_size=patch_size, max_pixels=limits.spec.max_pixels)
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, part: dict, where: str):
        with self._lock:
            self.count += 1
            if self.count > self.limits.images_per_prompt:
                raise ChatInputError(f"{where}: more than {self.limits.images_per_prompt} images in one request "
                                     f"(--limit-mm-per-prompt)")
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ChatInputError(f"{where}: image_url.url must be a data: or http(s) URL")
        try:
            return load_image(self._bytes(url, where), self.spec)
        except MediaError as e:
            raise ChatInputError(f"{where}: {e}") from None

    def _bytes(self, url: str, where: str) -> bytes:
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or ";base64" not in head:
                raise ChatInputError(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ChatInputError(f"{where}: the data URL is not valid base64") from None
            if len(data) > self.limits.max_bytes:
                raise ChatInputError(f"{where}: image of {len(data):,} bytes is over the {self.limits.max_bytes:,} limit")
            return data
        host = urlparse(url).hostname or ""
        if urlparse(url).scheme not in ("http", "https"):
            raise ChatInputError(f"{where}: image_url must be a data: or http(s) URL")
        if host not in self.limits.allowed_domains:
            raise ChatInputError(f"{where}: fetching media from {host or url!r} is off; send a data: URL or start the "
                                 f"server with --allowed-media-domains {host}")
        return self._fetch(url, where)

    def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        try:
            with httpx.stream("GET", url, timeout=self.limits.fetch_timeout_s, follow_redirects=False) as r:
                r.raise_for_status()
                data = bytearray()
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > self.limits.max_bytes:
                        raise ChatInputError(f"{where}: the image at {url} is over {self.limits.max_bytes:,} bytes")
                return bytes(data)
        except httpx.HTTPError as e:
            raise ChatInputError(f"{where}: fetching {url} failed ({type(e).__name__})") from None
