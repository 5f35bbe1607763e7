import json

from k3serve.cli import main
from k3serve.weights.inspect import inspect_model


def test_inspect_bundled_k3_matches_spec_numbers():
    r = inspect_model("moonshotai/Kimi-K3")
    assert abs(r.total_params / 2.7795e12 - 1) < 1e-3
    assert abs(r.active_params / 1.0419e11 - 1) < 1e-3
    assert r.routed_expert_bytes_per_expert == 17_547_264
    assert r.mla_cache_bytes_per_token == 27_648 and r.mla_cache_bytes_per_token_fp8 == 13_824
    assert r.kda_state_bytes_per_request == 464_633_856
    assert abs(r.weight_bytes / 1_560_936_091_448 - 1) < 0.005
    assert abs(r.vision_params / (401.2e6 + 46.1e6) - 1) < 1e-3


def test_inspect_bundled_kimi_linear():
    r = inspect_model("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert abs(r.total_params / 49.1e9 - 1) < 5e-3
    assert r.mla_cache_bytes_per_token == 8_064 and r.kda_state_bytes_per_request == 44_892_160


def test_inspect_cli_json_on_tiny_checkpoint(tiny_k3_dir, capsys):
    assert main(["inspect", str(tiny_k3_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "total_params",
        "active_params",
        "mla_cache_bytes_per_token",
        "kda_state_bytes_per_request",
        "weight_bytes",
    ):
        assert isinstance(out[key], int) and out[key] > 0
    assert out["source"] == "checkpoint headers"
    assert out["layer_schedule"] == "kKKMKKMM"
    # header bytes equal the bytes the safetensors files actually hold for tensor data
    assert (
        out["weight_bytes"]
        == json.loads((tiny_k3_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    )


def test_inspect_cli_reports_errors(capsys):
    assert main(["inspect", "no/such-model"]) == 2
    assert "error" in capsys.readouterr().err


def test_generate_cli_json(tiny_k3_dir, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_k3_dir),
                "--prompt-token-ids",
                "1,2,3",
                "--max-tokens",
                "6",
                "--ignore-eos",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == [1, 2, 3] and len(out["token_ids"]) == 6
    assert isinstance(out["text"], str) and out["finish_reason"] == "length"
    assert main(["generate", "--model", str(tiny_k3_dir), "--prompt-token-ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
