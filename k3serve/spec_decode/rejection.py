"""Lossless verification of drafted tokens (serving-notes.md §3.3).

Shapes for one request: p [k+1, V] target distributions at the k draft positions plus the bonus
position; q [k, V] the draft distributions the tokens were sampled from (one-hot for greedy or
ngram drafting); drafts [k]. Each returns (emitted tokens, tau accepted drafts); emitted =
drafts[:tau] + one residual/bonus token. Randomness comes only from the request's generator.

standard: accept x_i iff u_i <= min(1, p_i(x_i)/q_i(x_i)); at the first rejection sample
          norm(max(0, p_i - q_i)); all accepted -> bonus from p_{k+1}.
block:    Sun et al. 2024 (vLLM PR #46781): rho_i = min(1, rho_{i-1} p_i(x_i)/q_i(x_i));
          h_i = Z_{i+1}/(Z_{i+1} + 1 - rho_i), Z_{i+1} = sum max(0, rho_i p_{i+1} - q_{i+1}),
          h_k = rho_k; tau = the LARGEST i with eta_i <= h_i; then bonus from p_{k+1} or
          residual norm(max(0, rho_tau p_{tau+1} - q_{tau+1})).
greedy:   accept while x_i == argmax p_i; emit argmax at the first mismatch (or the bonus).
"""

from __future__ import annotations

import torch


def _sample(dist: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(dist, 1, generator=gen)[0])


def _residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    r = (scale * p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p  # p == q (up to scale): any draw from p is exact


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[list[int], int]:
    tau = 0
    while tau < len(drafts) and drafts[tau] == target_argmax[tau]:
        tau += 1
    return drafts[:tau] + [target_argmax[tau]], tau


def verify_standard(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    for i, x in enumerate(drafts):
        u = float(torch.rand(1, generator=gen))
        px, qx = float(p[i, x]), float(q[i, x])
        if not (qx > 0 and u * qx <= px):  # u <= p/q without dividing
            return drafts[:i] + [_sample(_residual(p[i], q[i]), gen)], i
    return drafts + [_sample(p[len(drafts)], gen)], len(drafts)


def block_thresholds(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> tuple[list[float], list[float]]:
    """(rho_0..rho_k, h_1..h_k) of block verification."""
    k, rho, h = len(drafts), [1.0], []
    for i, x in enumerate(drafts):
        qx = float(q[i, x])
        rho.append(min(1.0, rho[-1] * float(p[i, x]) / qx) if qx > 0 else 0.0)
    for i in range(1, k + 1):
        if i == k:
            h.append(rho[k])
            break
        z = float((rho[i] * p[i] - q[i]).clamp_min(0).sum())
        den = z + 1.0 - rho[i]
        h.append(z / den if den > 0 else 1.0)
    return rho, h


def verify_block(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    k = len(drafts)
    rho, h = block_thresholds(p, q, drafts)
    eta = torch.rand(k, generator=gen).tolist()
    tau = max((i for i in range(1, k + 1) if eta[i - 1] <= h[i - 1]), default=0)
    if tau == k:
        return drafts + [_sample(p[k], gen)], k
    return drafts[:tau] + [_sample(_residual(p[tau], q[tau], rho[tau]), gen)], tau
