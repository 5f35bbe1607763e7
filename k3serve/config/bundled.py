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
    """A checkpoint dir, a config.json file or a bundled model name -> config.json path. A
    Hugging Face repo id is resolved where models come from (weights/hub.py `load_config`);
    config/ takes paths."""
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
    raise ConfigError(
        "model",
        f"{path_or_name!r} is neither a directory, a config file, nor a bundled model ({', '.join(BUNDLED_MODELS)})",
    )


def load_model_config(path_or_name: str | Path) -> ModelConfig:
    return ModelConfig.from_file(resolve_config_path(path_or_name))
