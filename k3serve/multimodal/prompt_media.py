"""Media in prompts: the vision tower's rows for a prompt's `<|media_pad|>` positions, an encoder
cache keyed by image content, and the ids prefix caching hashes instead of the pads.

A prompt carries media as `multi_modal_data={"image": [ProcessedImage, ...], "video":
[ProcessedVideo, ...]}` (vLLM's keys); its token ids already hold each item's pad runs (the chat
renderer writes `<|media_begin|>image WxH<|media_content|>` + N pads + `<|media_end|>` per
image, `HH:MM:SS.fff<|media_begin|>video<|media_content|>` + pads + `<|media_end|>` per 4-frame
chunk of a video), and the i-th pad of the prompt takes the i-th projector row
(k3-model-spec.md §9.3). Images and videos are matched to the blocks in prompt order by each
block's header ("image ..." or "video"). For prefix caching every pad id is replaced by a
negative pseudo-id derived from (item digest, index): the same image or video chunk reuses the
cached prefix, a different one behind the same text does not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3serve.sampling_params import ParamError


@dataclass
class PromptMedia:
    positions: torch.Tensor  # [N] int64 prompt positions of the pads
    embeds: torch.Tensor  # [N, hidden] rows injected there
    hash_ids: list[int]  # the prompt ids with pads replaced (prefix-cache keys)


def pseudo_id(digest: str, index: int) -> int:
    return -1 - int.from_bytes(hashlib.blake2b(f"{digest}:{index}".encode(), digest_size=7).digest(), "little")


class MediaEncoder:
    def __init__(self, model_path: str, cfg, dtype: torch.dtype, device: torch.device, cache_bytes: int = 256 << 20):
        self.model_path, self.cfg, self.dtype, self.device = model_path, cfg, dtype, device
        self.pad_id = cfg.media_placeholder_token_id
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest -> [n, hidden]
        self.cache_bytes, self.used = cache_bytes, 0
        self.hits = self.misses = 0
        self._model = None

    @property
    def model(self):
        if self._model is None:
            from k3serve.models.vision import load_vision

            self._model = load_vision(self.model_path, self.cfg, self.dtype).to(self.device)
        return self._model

    def encode(self, image) -> torch.Tensor:
        rows = self.cache.get(image.digest)
        if rows is not None:
            self.cache.move_to_end(image.digest)
            self.hits += 1
            return rows
        self.misses += 1
        rows = self.model.encode(image.pixel_values.to(self.device), [image.grid])
        if self.cache_bytes <= 0:  # caching off
            return rows
        self.cache[image.digest] = rows
        self.used += rows.numel() * rows.element_size()
        while self.used > self.cache_bytes and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        return rows

    def needs_images(self, ids: list[int]) -> bool:
        """Media pads in a prompt that brings no images would embed as the pad token itself."""
        return self.cfg.vision is not None and self.pad_id is not None and self.pad_id in ids

    def prepare(self, ids: list[int], images: list, videos: list = (), tokenizer=None) -> PromptMedia:
        """`tokenizer` reads the block headers; needed only when a prompt has both kinds."""
        items, positions, hash_ids = self._keyed(ids, images, videos, tokenizer)
        embeds = torch.cat([self.encode(im) for im in items]) if items else torch.empty(0)
        return PromptMedia(torch.tensor(positions, dtype=torch.long), embeds, hash_ids)

    def cache_ids(self, ids: list[int], images: list, videos: list = (), tokenizer=None) -> list[int]:
        """The prefix-cache keys alone (a decode engine taking a hand-off encodes nothing)."""
        return self._keyed(ids, images, videos, tokenizer)[2]

    def _keyed(self, ids: list[int], images: list, videos: list, tokenizer) -> tuple[list, list[int], list[int]]:
        """(tower items in prompt order, pad positions, ids with each pad replaced by its key)."""
        if self.cfg.vision is None or self.pad_id is None:
            raise ParamError("messages", "this model has no vision tower: send text only")
        items = self.in_prompt_order(ids, list(images), list(videos), tokenizer) if videos else list(images)
        positions = [i for i, t in enumerate(ids) if t == self.pad_id]
        want = sum(im.num_tokens for im in items)
        if len(positions) != want:
            raise ParamError("messages", f"the prompt has {len(positions)} media pad tokens but its images need {want}")
        hash_ids, k = list(ids), 0
        for im in items:
            for j in range(im.num_tokens):
                hash_ids[positions[k]] = pseudo_id(im.digest, j)
                k += 1
        return items, positions, hash_ids

    def in_prompt_order(self, ids: list[int], images: list, videos: list, tokenizer) -> list:
        """The tower items (images, video chunks) in the order of the prompt's media blocks."""
        chunks = [c for v in videos for c in v.chunks]
        begin, content = (tokenizer.special_tokens.get(s) for s in ("<|media_begin|>", "<|media_content|>"))
        starts = [i for i, t in enumerate(ids) if t == begin]
        kinds = []
        for i in starts:
            try:
                j = ids.index(content, i)
            except ValueError:
                j = len(ids)
            kinds.append("video" if tokenizer.decode(ids[i + 1 : j]).strip().startswith("video") else "image")
        if kinds.count("image") != len(images) or kinds.count("video") != len(chunks):
            raise ParamError(
                "messages",
                f"the prompt has {kinds.count('image')} image and {kinds.count('video')} "
                f"video blocks; the request brings {len(images)} images and "
                f"{len(chunks)} video chunks",
            )
        it_img, it_vid = iter(images), iter(chunks)
        return [next(it_img) if k == "image" else next(it_vid) for k in kinds]
