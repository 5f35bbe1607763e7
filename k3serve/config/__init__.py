"""Model configuration: ModelConfig parsed from config.json, bundled real configs."""

from k3serve.config.bundled import BUNDLED_MODELS, load_model_config, resolve_config_path
from k3serve.config.model_config import KDAConfig, LayerKind, MLAConfig, MoEConfig, ModelConfig
from k3serve.config.parse import ConfigError

__all__ = [
    "BUNDLED_MODELS",
    "ConfigError",
    "KDAConfig",
    "LayerKind",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "load_model_config",
    "resolve_config_path",
]
