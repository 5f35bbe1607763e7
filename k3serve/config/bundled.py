"""Real configs shipped inside the package, so `inspect` and `plan` work offline.

Both are reconstructed from k3-model-spec.md §1 (the raw `config.json` of each HF repo).
"""

from __future__ import annotations

from pathlib import Path

from k3serve.config.model_config import ModelConfig
from k3serve.config.parse import ConfigError

_DIR = Path(__file__).parent / "bundled"
BUNDLED_MODELS = {
    "moonshotai/Kimi-K3": _DIR / "moonshotai--Kimi-K3.json",
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": _DIR / "moonshotai--Kimi-Linear-48B-A3B-Instruct.json",
}


def resolve_config_path(path_or_name: str | Path) -> Path:
    """A checkpoint dir, a config.json file, a bundled model name, or a Hugging Face repo id (its
    config.json fetched, weights/hub.py) -> config.json path."""
    p = Path(path_or_name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError("config.json", f"no config.json in {p}")
        return p / "config.json"
    if p.is_file():
        return p
    for name, path in BUNDLED_MODELS.items():
        if str(path_or_name).lower() == name.lower():
            return path
    from k3serve.weights.hub import ModelSourceError, is_repo_id, resolve_model

    hub = ""
    if is_repo_id(str(path_or_name)):  # another repo: its config.json alone from the hub (or its cache)
        try:
            return Path(resolve_model(str(path_or_name), config_only=True)) / "config.json"
        except ModelSourceError as e:
            hub = f"; as a Hugging Face repo: {e}"
    raise ConfigError(
        "model",
        f"{path_or_name!r} is neither a directory, a config file, nor a bundled model "
        f"({', '.join(BUNDLED_MODELS)}){hub}",
    )


def load_model_config(path_or_name: str | Path) -> ModelConfig:
    return ModelConfig.from_file(resolve_config_path(path_or_name))
