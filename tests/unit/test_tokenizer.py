import json

import pytest

from k3serve.tokenizer import Tokenizer, TokenizerError
from k3serve.tokenizer.tiktoken_file import read_ranks
from k3serve.testing.tiny_configs import TINY_BASE_VOCAB


def test_tiktoken_round_trip_and_k3_specials(tiny_k3_dir):
    tk = Tokenizer.from_dir(tiny_k3_dir)
    text = "Hello world! The weather in Paris is 21 degrees. 你好世界 def add(a, b):"
    ids = tk.encode(text)
    assert tk.decode(ids) == text and max(ids) < TINY_BASE_VOCAB
    assert tk.vocab_size == TINY_BASE_VOCAB + 256
    base = TINY_BASE_VOCAB  # specials keep the real offsets from the end of the BPE ranks
    assert tk.token_to_id("[BOS]") == base and tk.token_to_id("<|end_of_msg|>") == base + 2
    assert tk.token_to_id("<|open|>") == base + 3 and tk.token_to_id("<|media_pad|>") == base + 21
    assert tk.token_to_id("[PAD]") == base + 255
    assert tk.token_to_id(f"<|reserved_token_{base + 8}|>") == base + 8


def test_special_names_in_text_stay_text(tiny_k3_dir):
    tk = Tokenizer.from_dir(tiny_k3_dir)
    ids = tk.encode("a <|open|> b")
    assert not any(tk.is_special(i) for i in ids)
    assert tk.token_to_id("<|open|>") in tk.encode("a <|open|> b", allow_special=True)


def test_pretokenizer_keeps_han_runs_and_digit_triples(tiny_k3_dir):
    tk = Tokenizer.from_dir(tiny_k3_dir)
    pieces = [tk.decode([i]) for i in tk.encode("12345")]
    assert "".join(pieces) == "12345" and all(len(p) <= 3 for p in pieces)


def test_kimi_linear_uses_k2_names(tiny_kl_dir):
    tk = Tokenizer.from_dir(tiny_kl_dir)
    assert tk.token_to_id("<|im_end|>") == TINY_BASE_VOCAB + 2
    assert tk.token_to_id("<|im_middle|>") == TINY_BASE_VOCAB + 17


def test_rank_file_is_dense(tiny_k3_dir):
    ranks = read_ranks(tiny_k3_dir / "tiktoken.model")
    assert sorted(ranks.values()) == list(range(TINY_BASE_VOCAB))


def test_hf_tokenizer_json(tmp_path):
    from k3serve.testing.builder import write_hf_tokenizer

    write_hf_tokenizer(tmp_path, ["hello world, hello tokenizer"], ["<|im_end|>", "[BOS]"])
    tk = Tokenizer.from_dir(tmp_path)
    text = "hello world <|im_end|>"
    assert tk.decode(tk.encode(text)) == text
    end = tk.token_to_id("<|im_end|>")
    assert end not in tk.encode(text) and end in tk.encode(text, allow_special=True)


def test_bad_tokenizer_dirs(tmp_path):
    with pytest.raises(TokenizerError, match="no tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("!!notbase64 0\n")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"0": {"content": "[BOS]", "special": True}}})
    )
    with pytest.raises(TokenizerError, match="collides"):
        Tokenizer.from_dir(tmp_path)


# ---- long texts are encoded in pieces (issue 18: a 30 MiB /tokenize froze the event loop) ----
from hypothesis import given, settings, strategies as st  # noqa: E402

from k3serve.tokenizer.tokenizer import split_long  # noqa: E402

_ALPHABET = st.sampled_from(list("ab Zé中 ,.!?'\n\t123") + [" ", "  ", "'s", "<|im_end|>", "\r\n"])


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_ALPHABET, min_size=1, max_size=400), size=st.integers(1, 40))
def test_piecewise_encoding_equals_one_shot(tiny_k3_dir, parts, size):
    from k3serve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_k3_dir)
    text = "".join(parts)
    pieces = split_long(text, size)
    assert "".join(pieces) == text
    for special in (False, True):
        whole = tok._tk.encode(text, allowed_special="all") if special else tok._tk.encode_ordinary(text)
        assert [
            t
            for p in pieces
            for t in (tok._tk.encode(p, allowed_special="all") if special else tok._tk.encode_ordinary(p))
        ] == whole


TEXTS = [
    "hello world",
    "What is 23 + 45?",
    "<|open|>think<|sep|>I should call get_weather.<|close|>",
    "naïve café 東京 🙂",
    "  spaces\n\ttabs",
]


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_transformers_autotokenizer_loads_without_asking_and_agrees(which, tiny_k3_dir, tmp_path):
    """A model directory k3serve writes (the bundled demo, the tiny builder's) loads in
    transformers.AutoTokenizer with its defaults, without the remote-code question (its config
    names no modeling code it does not ship), and encodes as k3serve does, specials included."""
    import subprocess
    import sys

    from k3serve.demo import default_model

    d = default_model() if which == "demo" else tiny_k3_dir
    code = (
        "import json, sys; from transformers import AutoTokenizer; "
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
        "print(json.dumps([t.encode(s, add_special_tokens=False) for s in json.loads(sys.argv[2])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(d), json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trust_remote_code" not in out.stdout + out.stderr
    ours = Tokenizer.from_dir(d)
    assert json.loads(out.stdout.splitlines()[-1]) == [ours.encode(s, allow_special=True) for s in TEXTS]
