"""Standard and block verification keep the target distribution exactly (chi-square on a toy
vocabulary) for accept-all, reject-all and random drafts; block accepts at least as much."""

from __future__ import annotations

import math

import pytest
import torch


from k3serve.spec_decode.rejection import block_thresholds, verify_block, verify_greedy, verify_standard

V, K, N = 5, 3, 6000


def chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square test; the survival function in closed form for even degrees of
    freedom (df = V - 1 = 4): sf(x) = exp(-x/2) * sum_{j < df/2} (x/2)^j / j!."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with zero target probability was emitted"
    x = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    if df % 2:  # odd df: use the next even df (a slightly conservative test)
        df += 1
    term, total = 1.0, 1.0
    for j in range(1, df // 2):
        term *= (x / 2) / j
        total += term
    return math.exp(-x / 2) * total


def dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1).double()
    return p, q


def run(verify, p, q, draft_mode: str, seed: int):
    """Emitted-token histograms at output positions 0 and 1 (when reached), and mean tau."""
    gen = torch.Generator().manual_seed(seed)
    first, second, taus = torch.zeros(V), torch.zeros(V), []
    n_second = 0
    for _ in range(N):
        if draft_mode == "accept_all":
            qq = p[:K].clone()
            drafts = [int(torch.multinomial(qq[i], 1, generator=gen)) for i in range(K)]
        elif draft_mode == "reject_all":
            qq = torch.zeros(K, V, dtype=torch.float64)
            qq[:, V - 1] = 1.0  # drafts always the token the target never picks
            drafts = [V - 1] * K
        else:
            qq = q
            drafts = [int(torch.multinomial(qq[i], 1, generator=gen)) for i in range(K)]
        out, tau = verify(p, qq, drafts, gen)
        taus.append(tau)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            n_second += 1
    return first, second, n_second, sum(taus) / N


@pytest.mark.parametrize("verify", [verify_standard, verify_block], ids=["standard", "block"])
@pytest.mark.parametrize("mode", ["accept_all", "reject_all", "random"])
def test_first_emitted_token_follows_p(verify, mode):
    p, q = dists(1)
    if mode == "reject_all":
        p[:, V - 1] = 0
        p = p / p.sum(-1, keepdim=True)
    first, _, _, tau = run(verify, p, q, mode, seed=7)
    assert chisquare_pvalue(first, (p[0] * N).float()) > 1e-3
    if mode == "accept_all":
        assert tau == K
    if mode == "reject_all":
        assert tau == 0


def test_block_accepts_at_least_as_much_as_standard_on_the_same_draws():
    for seed in range(3):
        p, q = dists(10 + seed)
        std = run(verify_standard, p, q, "random", seed=seed)[3]
        blk = run(verify_block, p, q, "random", seed=seed)[3]
        assert blk >= std - 0.01, (seed, std, blk)


def test_block_second_token_follows_p_given_context_free_targets():
    """With the same p at every position, every emitted token is an iid draw from p."""
    p1, q = dists(3)
    p = p1[:1].repeat(K + 1, 1)
    _, second, n2, _ = run(verify_block, p, q, "random", seed=11)
    assert n2 > 1000 and chisquare_pvalue(second, (p[0] * n2).float()) > 1e-3


def test_block_thresholds_reduce_to_token_wise_at_k1():
    p, q = dists(5)
    rho, h = block_thresholds(p[:2], q[:1], [2])
    assert h == [rho[1]] and rho[1] == min(1.0, float(p[0, 2] / q[0, 2]))


def test_greedy_rule():
    assert verify_greedy([4, 1, 2, 3], [4, 1, 0]) == ([4, 1, 2], 2)
    assert verify_greedy([4, 1, 2, 3], [4, 1, 2]) == ([4, 1, 2, 3], 3)
    assert verify_greedy([4, 1], [0]) == ([4], 0)
