"""Issue 63, round 4 (checkpoint and start-up reliability): an index whose weight_map leaves the
checkpoint's folder is refused, naming the index and the shard (a local folder and a hub repo);
a hub endpoint that accepts and never answers fails within its timeout, naming the endpoint;
`false` / 0 / "" in a --config file apply; an unreachable OTLP collector no longer holds up the
tracing provider's flush and shutdown."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from k3serve.weights.checkpoint import INDEX_NAME, CheckpointIndex
from k3serve.weights.errors import BadIndexError


# ---- shard paths outside the checkpoint ------------------------------------------------------
def _repoint(ckpt: Path, shard: str, to: str) -> None:
    """Point every tensor the index puts in `shard` at the name `to` instead."""
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["weight_map"] = {k: (to if v == shard else v) for k, v in index["weight_map"].items()}
    (ckpt / INDEX_NAME).write_text(json.dumps(index))


@pytest.fixture()
def outside(tiny_k3_dir, tmp_path):
    """A copy of the tiny checkpoint in tmp/ckpt/sub, and its first shard moved to tmp/ckpt."""
    ckpt = tmp_path / "ckpt" / "sub"
    shutil.copytree(tiny_k3_dir, ckpt)
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shutil.move(shard, ckpt.parent / shard.name)
    return ckpt, shard.name


@pytest.mark.parametrize("how", ["parent", "absolute", "dotdot_inside"])
def test_an_index_pointing_outside_the_checkpoint_is_refused(outside, how):
    ckpt, name = outside
    target = {
        "parent": f"../{name}",
        "absolute": str(ckpt.parent / name),
        "dotdot_inside": f"nested/../../{name}",  # normalises to ../name: still outside
    }[how]
    (ckpt / "nested").mkdir()
    _repoint(ckpt, name, target)
    with pytest.raises(BadIndexError) as e:
        CheckpointIndex.open(ckpt)
    msg = str(e.value)
    assert target in msg and str(ckpt / INDEX_NAME) in msg and "outside the checkpoint" in msg


def test_shard_names_inside_the_folder_still_load(tiny_k3_dir, tmp_path):
    """A subfolder and a harmless `./` stay allowed: only leaving the folder is refused."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_dir, ckpt)
    first, second = sorted(ckpt.glob("model-*.safetensors"))[:2]
    (ckpt / "shards").mkdir()
    shutil.move(first, ckpt / "shards" / first.name)
    _repoint(ckpt, first.name, f"shards/{first.name}")
    _repoint(ckpt, second.name, f"./{second.name}")
    index = CheckpointIndex.open(ckpt)
    assert set(index.tensors) == set(CheckpointIndex.open(tiny_k3_dir).tensors)
    assert ckpt / "shards" / first.name in index.files and ckpt / second.name in index.files


@pytest.fixture()
def hub_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the suite's default (tests/conftest.py)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    return monkeypatch


def test_a_hub_index_pointing_outside_the_repo_is_refused_before_download(tiny_k3_dir, tmp_path, hub_env):
    from k3serve.testing.hub_mirror import HubMirror
    from k3serve.weights.hub import resolve_model

    repo = tmp_path / "repo"
    shutil.copytree(tiny_k3_dir, repo)
    name = sorted(repo.glob("model-*.safetensors"))[0].name
    _repoint(repo, name, f"../{name}")
    mirror = HubMirror({"moonshotai/Evil-K3": repo})
    hub_env.setenv("HF_ENDPOINT", mirror.url)
    try:
        with pytest.raises(BadIndexError) as e:
            resolve_model("moonshotai/Evil-K3", download_dir=str(tmp_path / "cache"))
    finally:
        mirror.close()
    assert f"../{name}" in str(e.value) and "moonshotai/Evil-K3" in str(e.value) and INDEX_NAME in str(e.value)
    assert not any(f.endswith(".safetensors") for f in mirror.fetched())  # refused before any shard


def test_a_single_file_hub_repo_still_resolves(tmp_path, hub_env):
    """No index at all: nothing to check, model.safetensors is fetched as before."""
    from k3serve.testing.builder import build_tiny_checkpoint
    from k3serve.testing.hub_mirror import HubMirror
    from k3serve.weights.hub import resolve_model

    repo = build_tiny_checkpoint(tmp_path / "repo", kind="kimi_linear", seed=0, num_shards=1)
    mirror = HubMirror({"moonshotai/One-File": repo})
    hub_env.setenv("HF_ENDPOINT", mirror.url)
    try:
        path = Path(resolve_model("moonshotai/One-File", download_dir=str(tmp_path / "cache")))
    finally:
        mirror.close()
    assert (path / "model.safetensors").is_file() and not (path / INDEX_NAME).exists()


# ---- a hub endpoint that never answers --------------------------------------------------------
@pytest.fixture()
def silent_endpoint():
    """A TCP server that accepts connections and never sends a byte."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for s in held:
        s.close()
    srv.close()


def test_a_silent_hub_endpoint_fails_within_its_timeout_naming_it(silent_endpoint, tmp_path, hub_env):
    """Before: huggingface_hub retried the HEAD of config.json with backoff (10 s a try, five
    retries), then the snapshot's own calls, so `serve ORG/NAME` hung for minutes."""
    from k3serve.weights.hub import ModelSourceError, resolve_model

    hub_env.setenv("HF_ENDPOINT", silent_endpoint)
    hub_env.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(ModelSourceError) as e:
        resolve_model("moonshotai/Kimi-K3", download_dir=str(tmp_path / "cache"))
    assert time.monotonic() - t0 < 8
    assert silent_endpoint in str(e.value) and "HF_HUB_ETAG_TIMEOUT" in str(e.value)


def test_a_refused_hub_endpoint_fails_fast_naming_it(tmp_path, hub_env):
    from k3serve.weights.hub import ModelSourceError, resolve_model

    with socket.create_server(("127.0.0.1", 0)) as s:
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends
    hub_env.setenv("HF_ENDPOINT", url)
    t0 = time.monotonic()
    with pytest.raises(ModelSourceError) as e:
        resolve_model("moonshotai/Kimi-K3", download_dir=str(tmp_path / "cache"))
    assert time.monotonic() - t0 < 8 and url in str(e.value)


# ---- --config: false, 0 and "" apply ----------------------------------------------------------
def _parse_with_config(tmp_path, text: str, *cli: str):
    from k3serve.cli import build_parser
    from k3serve.server.config_file import apply_config_file

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    return build_parser().parse_args(apply_config_file(["serve", "--config", str(cfg), *cli]))


def test_config_file_false_turns_a_default_on_flag_off(tmp_path):
    args = _parse_with_config(tmp_path, "enable_prefix_caching: false\n")
    assert args.enable_prefix_caching is False
    args = _parse_with_config(tmp_path, "enable-prefix-caching: false\n", "--enable-prefix-caching")
    assert args.enable_prefix_caching is True  # the command line still wins
    args = _parse_with_config(tmp_path, "enable_prefix_caching: true\n", "--no-enable-prefix-caching")
    assert args.enable_prefix_caching is False


def test_config_file_zero_empty_and_lists_apply(tmp_path):
    text = (
        "prefix_cache_state_interval: 0\n"
        "stats_log_interval: 0\n"
        "root_path: ''\n"
        "enable_log_requests: false\n"
        "allow_credentials: true\n"
        "allowed_media_domains: [a.example, b.example]\n"
        "allowed_origins: ['*']\n"
        "limit_mm_per_prompt: {image: 2, video: 0}\n"
        "max_model_len: null\n"
    )
    args = _parse_with_config(tmp_path, text, "MODEL", "--port", "9")
    assert args.model == "MODEL" and args.port == 9  # not taken for a domain
    assert args.prefix_cache_state_interval == 0 and args.stats_log_interval == 0.0 and args.root_path == ""
    assert args.enable_log_requests is False and args.allow_credentials is True
    assert args.allowed_media_domains == ["a.example", "b.example"] and args.allowed_origins == ["*"]
    assert args.limit_mm_per_prompt == {"image": 2, "video": 0} and args.max_model_len is None


def test_config_file_boolean_flag_with_a_non_boolean_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match="enable_prefix_caching.*true or false"):
        _parse_with_config(tmp_path, "enable_prefix_caching: sometimes\n")
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments (a typo's false used to vanish)
        _parse_with_config(tmp_path, "enable_prefix_cachin: false\n")


# ---- an unreachable OTLP collector ------------------------------------------------------------
@pytest.mark.parametrize("where", ["closed_port", "blackhole"])
def test_tracing_flush_and_shutdown_are_bounded_with_an_unreachable_collector(where, silent_endpoint):
    """Before: the exporter retried for its 10 s timeout in the app's flush, then again in the
    provider's shutdown at exit (13-19 s on a 2-core VM)."""
    pytest.importorskip("opentelemetry.sdk", reason="tracing needs opentelemetry-sdk")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="tracing needs the OTLP/HTTP exporter")
    from k3serve.server.observability.tracing import Tracing

    if where == "closed_port":
        with socket.create_server(("127.0.0.1", 0)) as s:
            endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    else:
        endpoint = silent_endpoint
    t = Tracing(endpoint)
    t.tracer.start_span("llm_request").end()
    t0 = time.monotonic()
    t.flush()
    t.shutdown()
    assert time.monotonic() - t0 < 3.5
