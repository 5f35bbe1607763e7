"""Where a model comes from: a local directory, or a Hugging Face repo id (issue 50).

`resolve_model("moonshotai/Kimi-K3")` returns a local directory: a snapshot in the hub cache
(`HF_HUB_CACHE`, or `download_dir`) holding only the files the engine reads: config and
generation config, tokenizer and chat template, the safetensors index and the shards it names
(the DSpark draft's folder when asked). A snapshot already cached is used without a network
call; `HF_HUB_OFFLINE=1` never calls the network (nothing cached: one error naming the repo and
the variable); a repo that is not a K3-class model (config.json's model_type) is refused before
anything large is fetched. `HF_TOKEN` (or `--hf-token`) for gated repos, `HF_ENDPOINT` for a
mirror. A bundled config name (config/bundled.py) stays what `plan` and `inspect` read offline.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from k3serve.config.bundled import load_model_config
from k3serve.config.model_config import ModelConfig
from k3serve.config.parse import ConfigError

KINDS = ("kimi_k3", "kimi_linear")  # config.json model_type values the engine serves
# what the engine reads besides the shards (missing ones are simply absent from the repo)
ENGINE_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
TIMEOUT_S = 10.0  # huggingface_hub's default for HF_HUB_ETAG_TIMEOUT


class ModelSourceError(ValueError):
    pass


def is_repo_id(model: str) -> bool:
    return bool(REPO_ID.fullmatch(model)) and not Path(model).exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
    draft: bool = False,
    config_only: bool = False,
) -> str:
    """A local directory for `model` (a path is returned as it is)."""
    if Path(model).exists():
        return str(model)
    if not is_repo_id(model):
        raise ModelSourceError(f"model {model!r}: no such directory, and not a Hugging Face repo id (org/name)")
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kw = _hub_kw(revision, token, download_dir)
    cache = kw["cache_dir"]
    try:
        return _fetch(model, kw, draft, config_only, local=True)  # a cached snapshot: no network
    except (LocalEntryNotFoundError, _Incomplete, EntryNotFoundError) as e:
        if offline():
            where = cache or "the Hugging Face cache"
            raise ModelSourceError(
                f"model {model!r} is not in {where} and HF_HUB_OFFLINE is set: fetch it once "
                f"online, or pass a local directory ({type(e).__name__})"
            ) from None
    check_endpoint(model, revision)
    try:
        return _fetch(model, kw, draft, config_only, local=False)
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {model!r}: no such repository (or a gated one: set HF_TOKEN or --hf-token)"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {model!r}: no revision {revision!r}") from None
    except EntryNotFoundError as e:
        raise ModelSourceError(f"model {model!r}: {e}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelSourceError(
            f"model {model!r}: download failed ({type(e).__name__}: {e}); HF_HUB_OFFLINE=1 reads the cache only"
        ) from None


def load_config(path_or_name: str | Path) -> ModelConfig:
    """A checkpoint dir, a config.json file, a bundled model name, or a Hugging Face repo id (its
    config.json alone, fetched or from the hub cache) -> its ModelConfig: what `plan`, `inspect`
    and a draft model name read."""
    try:
        return load_model_config(path_or_name)
    except ConfigError as e:
        if e.field != "model" or not is_repo_id(str(path_or_name)):
            raise
        try:
            path = Path(resolve_model(str(path_or_name), config_only=True)) / "config.json"
        except ModelSourceError as hub:
            raise ConfigError("model", f"{e.reason}; as a Hugging Face repo: {hub}") from None
    return load_model_config(path)


def _hub_kw(revision: str | None, token: str | None, download_dir: str | None = None) -> dict:
    """huggingface_hub's arguments; its variables read per call (it reads them once, at import)."""
    cache = download_dir or os.environ.get("HF_HUB_CACHE") or None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    return dict(revision=revision, cache_dir=cache, token=token, endpoint=endpoint, etag_timeout=hub_timeout())


def hub_timeout() -> float:
    """HF_HUB_ETAG_TIMEOUT, read per call: huggingface_hub reads it once, at its import."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or TIMEOUT_S)
    except ValueError:
        return TIMEOUT_S


def check_endpoint(repo: str, revision: str | None, what: str = "model") -> None:
    """One HEAD of the repo's config.json, bounded by HF_HUB_ETAG_TIMEOUT, before huggingface_hub's
    calls: it retries a request that times out five times with backoff (over a minute for
    config.json alone, then again for the index and the snapshot), so an endpoint that accepted
    connections and never answered held `serve` for many minutes without saying where."""
    from huggingface_hub import constants

    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    url = f"{endpoint}/{repo}/resolve/{quote(revision or 'main', safe='')}/config.json"
    timeout = hub_timeout()
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered (gated, no such repo ...): huggingface_hub says what that means
    except OSError as e:  # urllib's URLError wraps the socket's error in .reason
        why = getattr(e, "reason", e)
        hint = "HF_ENDPOINT names the endpoint; HF_HUB_OFFLINE=1 reads the cache only"
        if isinstance(why, TimeoutError):
            raise ModelSourceError(
                f"{what} {repo!r}: the hub endpoint {endpoint} did not answer within {timeout:g} s "
                f"(HF_HUB_ETAG_TIMEOUT); {hint}"
            ) from None
        if isinstance(why, OSError) and not isinstance(why, ssl.SSLError):  # TLS and the rest: the hub's client says
            raise ModelSourceError(
                f"{what} {repo!r}: cannot reach the hub endpoint {endpoint} ({why}); {hint}"
            ) from None


class _Incomplete(Exception):
    """A cached snapshot lacks some of the files the engine reads."""


def _fetch(repo: str, kw: dict, draft: bool, config_only: bool, local: bool) -> str:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    from k3serve.weights.checkpoint import check_shard_name

    config = Path(hf_hub_download(repo, "config.json", local_files_only=local, **kw))
    kind = json.loads(config.read_text()).get("model_type")
    if kind not in KINDS:
        raise ModelSourceError(f"model {repo!r} is a {kind!r} model; k3serve serves {' and '.join(KINDS)} checkpoints")
    if config_only:
        return str(config.parent)
    try:
        index = Path(hf_hub_download(repo, "model.safetensors.index.json", local_files_only=local, **kw))
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:  # before any is fetched, or looked for beside the snapshot
            check_shard_name(shard, f"{repo}: {index}")
    except EntryNotFoundError:
        shards = ["model.safetensors"]
    patterns = [*ENGINE_FILES, *shards] + (["dspark/*"] if draft else [])
    path = Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=local, **kw))
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise _Incomplete(f"{len(missing)} shards not cached, first {missing[0]}")
    if draft and not (path / "dspark").is_dir():
        raise _Incomplete("the DSpark draft is not cached")
    return str(path)


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "tiktoken.model")


def resolve_tokenizer(repo: str, revision: str | None = None, token: str | None = None) -> str:
    """A hub repo's tokenizer files only (what a client such as `k3serve bench --tokenizer ORG/NAME`
    counts and decodes with), from the cache when there (offline included); any model family."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    kw = dict(_hub_kw(revision, token), allow_patterns=list(TOKENIZER_FILES))
    try:
        return snapshot_download(repo, local_files_only=True, **kw)
    except LocalEntryNotFoundError:
        if offline():
            raise ModelSourceError(f"tokenizer {repo!r} is not in the hub cache and HF_HUB_OFFLINE is set") from None
    check_endpoint(repo, revision, "tokenizer")
    try:
        return snapshot_download(repo, **kw)
    except (HfHubHTTPError, OSError) as e:
        raise ModelSourceError(f"cannot fetch the tokenizer of {repo!r}: {e}") from None
