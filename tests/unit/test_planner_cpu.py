"""`k3serve plan --cpu` (issue 64 item 4): fit in RAM with the engine's own cache sizing, decode
tok/s from the host's bandwidth, and a launch line the CLI parses (a convert first when the
experts are to be packed)."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from k3serve.cache.sizing import full_request_bytes
from k3serve.config.bundled import load_model_config
from k3serve.planner.cli import experts_as
from k3serve.planner.cpu import HOSTS, OVERHEAD, decode_tok_s, host, plan_cpu
from k3serve.planner.weights import weight_split

KL = "moonshotai/Kimi-Linear-48B-A3B-Instruct"


def _plan(experts: str, name="desktop-64g", seqs=4, context=32768):
    cfg = experts_as(load_model_config(KL), experts)
    w = weight_split(cfg)
    return cfg, w, plan_cpu(cfg, KL, w, HOSTS[name], context, seqs, experts=experts)


def test_kimi_linear_48b_fits_a_64_gib_desktop_only_with_packed_experts():
    _, bf16_w, bf16 = _plan("checkpoint")
    cfg, w, mx = _plan("mxfp4")
    assert not bf16.fits and mx.fits
    assert 97e9 < bf16.weights < 99e9 and 27e9 < mx.weights < 31e9  # 98.2 GB -> ~29 GB
    assert mx.cache == 4 * full_request_bytes(cfg, 32768, 16, "bfloat16")  # the engine's sizing
    assert mx.needs == w.total + mx.cache + OVERHEAD
    assert mx.launch.startswith(f"k3serve convert {KL} Kimi-Linear-48B-A3B-Instruct-mxfp4 && k3serve serve ")


def test_decode_is_bandwidth_bound_and_more_streams_share_the_weights():
    cfg, w, _ = _plan("mxfp4")
    h = HOSTS["desktop-64g"]
    one = decode_tok_s(cfg, w, h, 1, 4096, "bfloat16")
    assert decode_tok_s(cfg, w, replace(h, peak_bw=2 * h.peak_bw), 1, 4096, "bfloat16") == pytest.approx(2 * one)
    assert one < decode_tok_s(cfg, w, h, 8, 4096, "bfloat16") < 8 * one  # experts and weights shared, cache not
    # packed experts read fewer bytes: faster than bf16 at one stream
    bf16_cfg = experts_as(load_model_config(KL), "checkpoint")
    assert one > decode_tok_s(bf16_cfg, weight_split(bf16_cfg), h, 1, 4096, "bfloat16")


def test_the_launch_line_parses_and_the_cli_says_whether_it_fits(capsys):
    from k3serve.cli import build_parser, main

    _, _, p = _plan("mxfp4", name="epyc-9654-2s", seqs=16)
    serve = p.launch.split(" && ", 1)[1]
    assert serve.startswith("numactl --interleave=all ")  # two NUMA nodes
    args = build_parser().parse_args(shlex.split(serve.split("  #")[0])[3:])  # after "numactl ... k3serve"
    assert (args.max_model_len, args.max_num_seqs) == (32768, 16)
    assert main(["plan", "--model", KL, "--cpu", "desktop-64g", "--experts", "mxfp4", "--concurrency", "4"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "--model", KL, "--cpu", "desktop-64g", "--concurrency", "4"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="custom needs"):
        host("custom", ram_gib=64)
    assert host("custom", 64, 40, 8).bandwidth == pytest.approx(40e9)  # a measured figure taken as it is
