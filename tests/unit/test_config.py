import copy
import json

import pytest

from k3serve.config import ConfigError, LayerKind, ModelConfig, load_model_config
from k3serve.config.bundled import BUNDLED_MODELS
from k3serve.config.engine_config import EngineConfig


def k3_raw():
    return json.loads(BUNDLED_MODELS["moonshotai/Kimi-K3"].read_text())


def kl_raw():
    return json.loads(BUNDLED_MODELS["moonshotai/Kimi-Linear-48B-A3B-Instruct"].read_text())


def test_bundled_k3_layer_schedule_and_features():
    cfg = load_model_config("moonshotai/Kimi-K3")
    assert cfg.mla_layers == tuple(range(3, 92, 4)) + (92,)
    assert len(cfg.mla_layers) == 24 and len(cfg.kda_layers) == 69
    assert cfg.layer_kinds[0] is LayerKind.KDA and cfg.layer_kinds[91] is LayerKind.MLA
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))
    assert cfg.attnres_block_starts == (0, 12, 24, 36, 48, 60, 72, 84)
    assert cfg.use_latent_moe and cfg.use_situ and cfg.use_bounded_decay and cfg.use_q_lora
    assert cfg.mla.use_output_gate and cfg.kda.use_full_rank_gate
    assert cfg.mla.cache_dim == 576 and cfg.kda.gate_lower_bound == -5.0
    assert cfg.moe.shared_intermediate_size == 6144 and cfg.moe.latent_size == 3584
    assert cfg.quant is not None and cfg.quant.group_size == 32
    assert cfg.vision is not None and cfg.vision.hidden_size == 1024
    assert cfg.tensor_prefix == "language_model." and cfg.eos_token_id == 163586


def test_bundled_kimi_linear():
    cfg = load_model_config("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26) and len(cfg.kda_layers) == 20
    assert not (cfg.use_attnres or cfg.use_latent_moe or cfg.use_situ or cfg.use_bounded_decay)
    assert not cfg.use_q_lora and not cfg.mla.use_output_gate and not cfg.kda.use_full_rank_gate
    assert cfg.moe.routed_scaling_factor == 2.446 and cfg.tensor_prefix == ""


def test_transformers_serialization_noise_is_ignored():
    raw = k3_raw()
    t = raw["text_config"]
    t.update(head_dim=74, rope_theta=10000.0, rope_parameters={"rope_type": "default"})
    raw["quantization_config"] = t.pop("quantization_config")  # transformers 5 moves it up
    cfg = ModelConfig.from_dict(raw)
    assert cfg.quant is not None and cfg.mla.qk_head_dim == 192 and cfg.kda.head_dim == 128


@pytest.mark.parametrize(
    "mutate, field",
    [
        (
            lambda r: r["text_config"]["linear_attn_config"].update(full_attn_layers=[0, 4]),
            "text_config.linear_attn_config.full_attn_layers",
        ),
        (
            lambda r: r["text_config"]["linear_attn_config"]["kda_layers"].append(4),
            "text_config.linear_attn_config.kda_layers",
        ),
        (
            lambda r: r["text_config"]["linear_attn_config"]["kda_layers"].remove(1),
            "text_config.linear_attn_config.kda_layers",
        ),
        (lambda r: r["text_config"].pop("hidden_size"), "text_config.hidden_size"),
        (lambda r: r["text_config"].update(hidden_size="7168"), "text_config.hidden_size"),
        (lambda r: r["text_config"].update(num_experts_per_token=1000), "text_config.num_experts_per_token"),
        (lambda r: r["text_config"].update(hidden_act="gelu"), "text_config.hidden_act"),
        (lambda r: r["text_config"].update(mla_use_nope=False), "text_config.mla_use_nope"),
        (lambda r: r["text_config"].update(routed_expert_hidden_size=3583), "text_config.routed_expert_hidden_size"),
        (lambda r: r.update(model_type="llama"), "model_type"),
        (lambda r: r["vision_config"].update(text_hidden_size=4096), "vision_config.text_hidden_size"),
        (
            lambda r: r["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8),
            "quantization_config.config_groups.group_0.weights.num_bits",
        ),
    ],
)
def test_bad_configs_name_the_field(mutate, field):
    raw = k3_raw()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert e.value.field == field and field in str(e.value)


def test_kimi_linear_missing_linear_attn_config():
    raw = kl_raw()
    del raw["linear_attn_config"]
    with pytest.raises(ConfigError, match="linear_attn_config"):
        ModelConfig.from_dict(raw)


def test_unknown_model_name():
    # a repo id goes to the hub (weights/hub.py); the suite runs offline (tests/conftest.py)
    from k3serve.weights.hub import load_config

    with pytest.raises(ConfigError, match="bundled model.*HF_HUB_OFFLINE"):
        load_config("moonshotai/Kimi-K9")
    # config/ takes paths and bundled names only: it never reaches for the hub
    with pytest.raises(ConfigError, match="bundled model") as e:
        load_model_config("moonshotai/Kimi-K9")
    assert "HF_HUB" not in str(e.value)


def test_config_is_frozen():
    cfg = load_model_config("moonshotai/Kimi-K3")
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert copy.deepcopy(cfg) == cfg


def test_compilation_config_spelled_as_vllm():
    from k3serve.config.compilation import CompilationConfig, default_capture_sizes

    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(6) == [1, 2, 4, 6]  # the largest batch always has its bucket
    cc = CompilationConfig.parse('{"cudagraph_capture_sizes": [8, 1, 4], "backend": "aot_eager", "level": 3}')
    assert cc.capture_sizes(64) == [1, 4, 8] and cc.backend == "aot_eager" and cc.extra == {"level": 3}
    assert CompilationConfig.parse({"max_cudagraph_capture_size": 16}).capture_sizes(64)[-1] == 16
    with pytest.raises(ValueError, match="backend must be one of"):
        CompilationConfig.parse({"backend": "tvm"})
    with pytest.raises(ValueError):
        CompilationConfig.parse("{not json")
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(kernels="cuda")
    cc = CompilationConfig.parse({"compile_in_background": False, "max_compiled_buckets": 4})
    assert (cc.compile_in_background, cc.max_compiled_buckets, cc.extra) == (False, 4, {})
    for bad in ({"compile_in_background": 0}, {"max_compiled_buckets": 0}, {"max_compiled_buckets": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CompilationConfig.parse(bad)


def test_auto_kernels_on_a_gpu_is_the_triton_backend_unless_eager():
    """Issue 52: the graph step with the Triton kernels; the graph backend where Triton or
    fla-core is missing; the torch reference under --enforce-eager."""
    import torch

    from k3serve.executor.placement import resolve_mode
    from k3serve.kernels.triton import unavailable

    cuda = torch.device("cuda", 0)
    compiled = "graph" if unavailable("cuda") else "triton"
    assert resolve_mode("auto", cuda) == compiled and resolve_mode("auto", cuda, enforce_eager=True) == "torch"
    assert resolve_mode("graph", torch.device("cpu")) == "graph" and resolve_mode("auto", torch.device("cpu")) == "auto"
