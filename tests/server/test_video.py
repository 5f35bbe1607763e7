"""Video through the chat API on a tiny vision K3. The processor is checked against transformers'
kimi_k25 pieces: frame sampling (`default_sample_indices_fn`), the per-chunk prompt block with
its timestamp (`Kimi_K25Processor.replace_video_token`), each frame through the image path that
test_multimodal checks against the image reference. End to end: greedy output is the same with
prefix caching on and off and with chunked prefill cutting inside the video, the same video
reuses the cached prefix, another video behind the same text does not, images and a video in
one message keep their order, and bad video is a 400 naming the part."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from k3serve.multimodal.image import ImageSpec, preprocess
from k3serve.multimodal.video import VideoSpec, load_video, sample_indices
from k3serve.testing.sample_media import random_video
from tests.live import serving
from tests.server.conftest import make_app
from tests.server.test_multimodal import chat, data_url, png


def video(seed: int, frames: int = 12, fps: int = 4, size=(24, 20)) -> bytes:
    return random_video(seed, frames, fps, size)


def decoded_frames(data: bytes) -> list:
    with av.open(io.BytesIO(data)) as c:
        return [f.to_image() for f in c.decode(c.streams.video[0])]


@pytest.mark.parametrize("total, fps", [(12, 4.0), (30, 10.0), (7, 30.0), (100, 25.0), (1000, 24.0)])
def test_frames_are_sampled_as_the_reference_samples_them(total, fps):
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    ref = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=fps), fps=2.0).tolist()
    ours = sample_indices(total, fps, VideoSpec(max_frames=10_000))
    assert ours == ref
    capped = sample_indices(total, fps, VideoSpec(max_frames=8))  # long videos: 8 frames over the whole span
    assert len(capped) == min(8, len(ref)) and capped[0] == 0 and capped[-1] >= total * (len(capped) - 1) // len(capped)


def test_chunks_and_prompt_blocks_match_the_reference_processor():
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.video_utils import VideoMetadata

    from k3serve.chat.k3_xtml import media_block, segments_text

    data = video(0, frames=30, fps=10, size=(24, 20))
    v = load_video(data, VideoSpec(patch_size=2))
    assert v.indices == (0, 5, 10, 15, 20, 25) and v.fps == 10.0 and v.total_frames == 30 and v.size == (24, 20)
    assert [c.grid for c in v.chunks] == [(4, 10, 12), (2, 10, 12)]  # 20 x 24 px is 10 x 12 patches of 2
    meta = VideoMetadata(total_num_frames=30, fps=10.0, frames_indices=list(v.indices))
    inputs = {
        "num_chunks_per_video": [2],
        "video_grid_thw": torch.tensor([c.grid for c in v.chunks]),
        "video_metadata": [meta],
    }
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=4), video_token="<|media_pad|>"
    )
    want = Kimi_K25Processor.replace_video_token(fake, inputs, 0)
    assert segments_text(media_block(v)) == want
    assert want.startswith("00:00:00.000<|media_begin|>video") and "00:00:02.000<|media_begin|>" in want
    assert v.num_tokens == 2 * 30 == want.count("<|media_pad|>")


def test_each_frame_goes_through_the_image_path():
    data = video(1, frames=12, fps=4, size=(40, 28))
    spec = VideoSpec(patch_size=2, in_patch_limit_each_frame=64)  # forces a resize: 20 x 14 patches > 64
    v = load_video(data, spec)
    frames = decoded_frames(data)
    want = [preprocess(frames[i], spec.frame_spec()) for i in v.indices]
    assert want[0].grid != (1, 14, 20)  # resized under the per-frame limit
    for k, chunk in enumerate(v.chunks):
        group = want[4 * k : 4 * k + 4]
        assert chunk.grid == (len(group),) + group[0].grid[1:]
        assert torch.equal(chunk.pixel_values, torch.cat([g.pixel_values for g in group]))
    assert len({c.digest for c in v.chunks}) == len(v.chunks)


def test_undecodable_video_is_a_media_error_and_a_still_image_is_one_frame():
    from k3serve.multimodal.image import MediaError, load_image

    with pytest.raises(MediaError, match="video cannot be decoded"):
        load_video(b"definitely not a video", VideoSpec(patch_size=2))
    v = load_video(png(3), VideoSpec(patch_size=2))  # FFmpeg reads a PNG as a one-frame stream
    im = load_image(png(3), ImageSpec(patch_size=2))
    assert v.indices == (0,) and [c.grid for c in v.chunks] == [im.grid]
    assert torch.equal(v.chunks[0].pixel_values, im.pixel_values)


def test_frames_over_the_pixel_limit_are_refused():
    from k3serve.multimodal.image import MediaError

    with pytest.raises(MediaError, match="over the 100-pixel limit"):
        load_video(video(0, frames=2, size=(24, 20)), VideoSpec(patch_size=2, max_pixels=100))
    with pytest.raises(MediaError, match="more than 5 frames"):
        load_video(video(0, frames=12), VideoSpec(patch_size=2, max_decoded_frames=5))


def vmessages(*media: tuple[str, bytes], text: str = "What happens in the clip?") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    for kind, data in media:
        if kind == "video":
            parts.append({"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}})
        else:
            parts.append({"type": "image_url", "image_url": {"url": data_url(data)}})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def servers(tiny_k3_dir):
    """A: prefix caching on, 16-token prefill chunks (each 30-token video chunk is cut);
    B: prefix caching off, one prefill chunk."""
    a, _ = make_app(tiny_k3_dir, "--max-num-batched-tokens", "16", "--limit-mm-per-prompt", '{"image": 2, "video": 1}')
    b, _ = make_app(tiny_k3_dir, "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048")
    with serving(a) as base_a, serving(b) as base_b:
        yield base_a, base_b


def test_video_answers_the_same_with_and_without_caching_and_chunking(servers):
    base_a, base_b = servers
    msgs = vmessages(("video", video(5)))
    a, b = chat(base_a, msgs), chat(base_b, msgs)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] > 60  # two chunks of 30 pads
    again = chat(base_a, msgs)  # the cached prefix, both video chunks included, is reused
    assert again["choices"][0]["message"] == a["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 60
    r = httpx.post(base_a + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"thinking": False}}).json()
    assert r["count"] == a["usage"]["prompt_tokens"]  # /tokenize counts the video's pads too


def test_another_video_behind_the_same_text_misses_the_cache(servers):
    base_a, _ = servers
    first, other = chat(base_a, vmessages(("video", video(6)))), chat(base_a, vmessages(("video", video(7))))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= 40 + 16
    assert other["choices"][0]["message"] != first["choices"][0]["message"]  # the video changes the answer


def test_images_and_a_video_in_one_message_keep_their_order(servers):
    base_a, base_b = servers
    img, clip = png(8, size=(16, 12)), video(9)
    one = vmessages(("image", img), ("video", clip), ("image", png(10, size=(16, 12))))
    a, b = chat(base_a, one), chat(base_b, one)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    swapped = vmessages(("video", clip), ("image", img), ("image", png(10, size=(16, 12))))
    assert chat(base_b, swapped)["choices"][0]["message"] != b["choices"][0]["message"]


@pytest.mark.parametrize(
    "media, says",
    [
        ([("video", b"junk bytes")], "cannot be decoded"),
        ([("video", video(1)), ("video", video(2))], "more than 1 videos"),
    ],
)
def test_bad_video_is_a_400_naming_the_part(servers, media, says):
    base_a, _ = servers
    r = httpx.post(base_a + "/v1/chat/completions", timeout=60, json={"messages": vmessages(*media), "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and "messages[0].content[" in err["message"] and says in err["message"], err
    assert chat(base_a, vmessages(("video", video(3))))["choices"]  # still serving


def test_video_url_fetching_is_off_by_default(servers):
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}]}]
    r = httpx.post(servers[0] + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and "fetching media from 'example.com' is off" in r.json()["error"]["message"]


def test_the_openai_client_sends_a_video(servers):
    from openai import OpenAI

    client = OpenAI(base_url=servers[0] + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="tiny-k3", messages=vmessages(("video", video(4, frames=20))), max_tokens=3
    )
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 90  # 5 s: 3 chunks


def test_an_engine_prompt_with_image_and_video_needs_both(tiny_k3_dir):
    from k3serve import LLM, SamplingParams
    from k3serve.chat.k3_xtml import Seg, encode_segments, media_block, message
    from k3serve.multimodal.image import load_image

    llm = LLM(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=512, enable_prefix_caching=False)
    p = llm.engine.model.cfg.vision.patch_size
    img, clip = load_image(png(7), ImageSpec(patch_size=p)), load_video(video(2), VideoSpec(patch_size=p))
    ids = encode_segments(llm.engine.tokenizer, message("user", [Seg("look")] + media_block(clip) + media_block(img)))
    out = llm.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": [img], "video": [clip]}}], SamplingParams(max_tokens=2)
    )
    assert len(out[0].outputs[0].token_ids) == 2 and llm.engine.media.misses == 3  # 2 video chunks + 1 image
    with pytest.raises(ValueError, match="1 image and 2 video blocks; the request brings 0 images and 2 video"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": [clip]}}], SamplingParams(max_tokens=1))


def test_gpu_memory_utilization_keeps_the_tower_and_its_encoder_cache_out_of_the_cache(tiny_k3_dir):
    from safetensors import safe_open

    from k3serve import LLM
    from k3serve.config.engine_config import EngineConfig
    from k3serve.engine.startup import cache_budget, vision_reserve

    model = LLM(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=256).engine.model_info
    tower = 0
    for f in tiny_k3_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tower += sum(
                int(np.prod(st.get_slice(k).get_shape()))
                for k in st.keys()
                if k.startswith(("vision_tower.", "mm_projector."))
            )
    cfg = {
        m: EngineConfig.from_kwargs(str(tiny_k3_dir), gpu_memory_utilization=0.05, mm_encoder_cache=m)
        for m in ("0", "8MiB")
    }
    assert vision_reserve(cfg["0"], model) == tower * model.dtype.itemsize > 0
    cpu = torch.device("cpu")
    assert cache_budget(cfg["0"], cpu, model) - cache_budget(cfg["8MiB"], cpu, model) == 8 << 20


def test_build_tiny_vision_flag(tmp_path, capsys):
    from k3serve.cli import main
    from k3serve.config.model_config import ModelConfig
    from k3serve.weights.checkpoint import CheckpointIndex

    assert main(["build-tiny", str(tmp_path / "v"), "--vision"]) == 0 and "MoonViT3d tower" in capsys.readouterr().out
    assert main(["build-tiny", str(tmp_path / "t"), "--no-vision"]) == 0
    names = {k: set(CheckpointIndex.open(tmp_path / k).tensors) for k in ("v", "t")}
    assert (
        any(n.startswith("vision_tower.encoder.blocks.0.") for n in names["v"])
        and "mm_projector.proj.0.weight" in names["v"]
    )
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in names["t"])
    read = lambda k: ModelConfig.from_dict(json.loads((tmp_path / k / "config.json").read_text()))  # noqa: E731
    assert read("t").vision is None and read("v").vision is not None
    with pytest.raises(SystemExit, match="no vision tower"):
        main(["build-tiny", str(tmp_path / "kl"), "--kind", "kimi_linear", "--vision"])


def reference_navit_resize():
    """transformers' kimi_k25 `navit_resize`, the function itself: its module imports torchvision
    (not installed here: its PyPI build needs CUDA torch), so the function's source is taken from
    the file and run on its own (it needs only `math`)."""
    import ast
    import importlib.util
    import math
    from pathlib import Path

    spec = importlib.util.find_spec("transformers.models.kimi_k25")
    src = (Path(spec.submodule_search_locations[0]) / "video_processing_kimi_k25.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": math}
    exec(compile(ast.Module([fn], []), "navit_resize", "exec"), scope)
    return scope["navit_resize"]


@pytest.mark.parametrize("size", [(640, 480), (1920, 1080), (28, 28), (10, 1000), (448, 448), (1, 1), (7000, 300)])
@pytest.mark.parametrize("limit", [4096, 16384])  # per video frame, per image
def test_resize_and_padding_equal_the_reference_navit_resize(size, limit):
    from k3serve.multimodal.image import target_size

    navit = reference_navit_resize()
    w, h = size
    (rh, rw), (ph, pw) = navit(h, w, patch_size=14, merge_kernel_size=2, max_patches=limit, max_size_per_side=512)
    assert target_size(w, h, ImageSpec(in_patch_limit=limit)) == (rw, rh)
    if w * h <= 640 * 480:  # the whole path: grid and tokens from the padded size
        im = preprocess(Image.new("RGB", size), ImageSpec(in_patch_limit=limit))
        assert im.grid == (1, ph // 14, pw // 14) and im.num_tokens == (ph // 28) * (pw // 28)
