"""Images through the chat API on a tiny vision K3: the image changes the answer, greedy output
is the same with prefix caching on and off and with chunked prefill cutting inside the media
block, a shared image reuses the cached prefix while a different image behind the same text
does not, and bad media is a 400 naming the part while the server keeps serving."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from k3serve.multimodal.image import ImageSpec, load_image, target_size
from tests.live import serving
from tests.server.conftest import make_app


def png(seed: int, size=(40, 36)) -> bytes:
    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def messages(*images: bytes, text: str = "Describe the picture, please.") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": data_url(im)}} for im in images
    ]
    return [{"role": "user", "content": parts}]


GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def servers(tiny_k3_dir):
    """A: prefix caching on, 32-token prefill chunks (the 90-token media block is cut three
    times); B: prefix caching off, one chunk."""
    a, _ = make_app(tiny_k3_dir, "--max-num-batched-tokens", "32")
    b, _ = make_app(tiny_k3_dir, "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048")
    with serving(a) as base_a, serving(b) as base_b:
        yield base_a, base_b


def chat(base: str, msgs, **kw) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={"messages": msgs, **GREEDY, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_same_answer_with_and_without_caching_and_chunking(servers):
    base_a, base_b = servers
    img = png(1)
    a, b = chat(base_a, messages(img)), chat(base_b, messages(img))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    again = chat(base_a, messages(img))  # the cached prefix, media block included, is reused
    assert again["choices"][0]["message"] == a["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 90


def test_a_different_image_behind_the_same_text_misses_the_cache(servers):
    base_a, _ = servers
    first, other = chat(base_a, messages(png(2))), chat(base_a, messages(png(3)))
    tokens_before_image = 40  # the system-free prompt up to the image is well under this
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= tokens_before_image + 16
    assert other["choices"][0]["message"] != first["choices"][0]["message"]  # the image changes the answer


def test_the_openai_client_sends_an_image(servers):
    from openai import OpenAI

    client = OpenAI(base_url=servers[0] + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny-k3", messages=messages(png(4), png(5)), max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 180  # two 90-row images


@pytest.mark.parametrize(
    "part, says",
    [
        ({"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}, "cannot be decoded"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "fetching media from 'example.com' is off",
        ),
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "data: or http(s)"),
        ({"type": "input_audio", "input_audio": {}}, "not supported"),
    ],
)
def test_bad_media_is_a_400_naming_the_part(servers, part, says):
    base_a, _ = servers
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    r = httpx.post(base_a + "/v1/chat/completions", timeout=60, json={"messages": msgs, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and "messages[0].content[1]" in err["message"] and says in err["message"], err
    assert chat(base_a, messages(png(1)))["choices"]  # still serving


def test_too_many_images_and_animated_images(tiny_k3_dir):
    app, _ = make_app(tiny_k3_dir, "--limit-mm-per-prompt", '{"image": 1}')
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    with serving(app) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": messages(png(1), png(2)), "max_tokens": 2})
        assert r.status_code == 400 and "more than 1 images" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/chat/completions", json={"messages": messages(buf.getvalue()), "max_tokens": 2})
        assert r.status_code == 400 and "animated" in r.json()["error"]["message"]


@pytest.mark.parametrize("size", [(640, 480), (4000, 3000), (28, 28), (10, 1000), (448, 448), (1, 1)])
def test_resize_grid_and_token_counts_follow_the_reference_rule(size):
    """transformers' kimi_k25 navit_resize (patch 14, 16384 patches, 512 per side), padded to 28."""
    w, h = size
    n_h, n_w = max(1, h // 14), max(1, w // 14)
    scale = min(1.0, (16384 / (n_h * n_w)) ** 0.5, 512 * 14 / h, 512 * 14 / w)
    want = (min(7168, max(1, int(w * scale))), min(7168, max(1, int(h * scale))))
    assert target_size(w, h) == want
    if w * h <= 640 * 480:
        im = load_image(png(0, size), ImageSpec())
        pw, ph = -(-want[0] // 28) * 28, -(-want[1] // 28) * 28
        assert im.grid == (1, ph // 14, pw // 14) and im.num_tokens == (ph // 28) * (pw // 28)
        assert im.pixel_values.shape == (im.grid[1] * im.grid[2], 3, 14, 14) and im.size == size
    assert {(640, 480): 414, (4000, 3000): 4200}.get(size, None) in (None, (-(-want[0] // 28)) * (-(-want[1] // 28)))


def test_pixels_are_normalised_and_padded_like_the_reference():
    arr = (np.random.default_rng(9).random((20, 30, 3)) * 255).astype("uint8")  # H 20, W 30
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    im = load_image(buf.getvalue(), ImageSpec(patch_size=2, merge=2))
    assert im.grid == (1, 10, 16)  # 20 x 32 after padding the width to a multiple of 4
    full = np.full((20, 32, 3), -1.0, dtype=np.float32)
    full[:, :30] = (arr / 255.0 - 0.5) / 0.5
    patch = lambda r, c: full[2 * r : 2 * r + 2, 2 * c : 2 * c + 2].transpose(2, 0, 1)  # noqa: E731  [3, 2, 2]
    for r, c in [(0, 0), (3, 7), (9, 15)]:
        np.testing.assert_allclose(im.pixel_values[r * 16 + c].numpy(), patch(r, c), rtol=1e-6, atol=1e-6)


def test_bench_random_mm_sends_images(servers, tmp_path):
    from k3serve.cli import main

    out = tmp_path / "mm.json"
    rc = main(
        [
            "bench",
            "--base-url",
            servers[0],
            "--endpoint",
            "/v1/chat/completions",
            "--dataset-name",
            "random-mm",
            "--random-mm-image-size",
            "16x12",
            "--random-mm-images-per-request",
            "2",
            "--num-prompts",
            "3",
            "--random-input-len",
            "8",
            "--random-output-len",
            "3",
            "--ignore-eos",
            "--save-result",
            "--save-detailed",
            "--result-filename",
            str(out),
            "--no-progress",
        ]
    )
    import json

    r = json.loads(out.read_text())
    # two 16x12 images are 2 x (4 x 3 groups of 2x2 patches) = 24 media tokens per request
    assert rc == 0 and r["completed"] == 3 and min(r["input_lens"]) > 24 and r["output_lens"] == [3, 3, 3]


def test_responses_api_takes_input_image(servers):
    r = httpx.post(
        servers[0] + "/v1/responses",
        timeout=120,
        json={
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": data_url(png(1))},
                    ],
                }
            ],
            "max_output_tokens": 3,
            "reasoning": {"effort": "none"},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 90  # the 90-token image is in the prompt
    bad = httpx.post(
        servers[0] + "/v1/responses",
        json={
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "and this?"},
                        {"type": "input_image", "image_url": data_url(b"junk")},
                    ],
                },
            ],
        },
    )
    err = bad.json()["error"]  # named as the client sent it: the third input item, not messages[3]
    assert bad.status_code == 400 and err["param"] == "input", err
    assert (
        err["message"].startswith("input[2].content[1]: image cannot be decoded") and "messages" not in err["message"]
    )


def test_encoder_cache_size_is_stated_and_zero_turns_it_off(tiny_k3_dir):
    from k3serve import LLM, SamplingParams
    from k3serve.chat.k3_xtml import Seg, encode_segments, media_block, message

    llm = LLM(
        str(tiny_k3_dir), cache_memory="16MiB", max_model_len=512, mm_encoder_cache=0, enable_prefix_caching=False
    )
    assert any("vision encoder cache: 0 B" in line for line in llm.engine.startup_log)
    img = load_image(png(7), ImageSpec(patch_size=llm.engine.model.cfg.vision.patch_size))
    ids = encode_segments(llm.engine.tokenizer, message("user", [Seg("look")] + media_block(img)))
    for _ in range(2):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}], SamplingParams(max_tokens=1))
    assert (llm.engine.media.hits, llm.engine.media.misses) == (0, 2)  # no cache: encoded both times
    cached = LLM(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=512, enable_prefix_caching=False)
    for _ in range(2):
        cached.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}], SamplingParams(max_tokens=1))
    assert (cached.engine.media.hits, cached.engine.media.misses) == (1, 1)
    bad = [{"prompt_token_ids": ids}]  # pads without the image they stand for
    with pytest.raises(ValueError, match="media pad tokens but its images need 0"):
        cached.generate(bad, SamplingParams(max_tokens=1))


def test_image_urls_are_fetched_only_from_allowed_hosts(tiny_k3_dir):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    body = png(11)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_port}"
    app, _ = make_app(tiny_k3_dir, "--allowed-media-domains", "127.0.0.1")
    try:
        with serving(app) as base:

            def ask(link):
                msgs = [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": link}},
                        ],
                    }
                ]
                return httpx.post(base + "/v1/chat/completions", timeout=60, json={"messages": msgs, **GREEDY})

            fetched, inline = ask(url + "/cat.png"), ask(data_url(body))
            assert fetched.status_code == 200 and fetched.json()["choices"] == inline.json()["choices"]
            missing = ask(url + "/nope.png")
            assert missing.status_code == 400 and "fetching" in missing.json()["error"]["message"]
    finally:
        http.shutdown()
