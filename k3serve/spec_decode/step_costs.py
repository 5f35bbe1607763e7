"""The draft-length policy's cost model: seconds of a decode / verify step, measured
(spec_decode/adaptive.py; seeded by runner/spec_profile.py, refreshed by the steps the engine
runs). Pure Python.

A step of `rows` rows in which `verifying` sequences check drafts costs

    seconds = a + m * rows + h * verifying

per (sequence bucket, context bucket), least squares over the bucket's recent samples. `m` is a
row's share; `h` what a verifying sequence adds whatever its length (its KDA records and
rollback, its verification on the host), which is why one request drafting four tokens costs
less than four requests drafting one (a model in rows alone split drafts thinly and lost); the
context bucket because every verify row attends over its sequence's cache, so at 2,000 tokens a
row costs more than at 200.
"""

from __future__ import annotations

from collections import deque

Key = tuple[int, int]  # (sequence bucket, context bucket)
Fit = tuple[float, float, float]  # (a, m, h)


def seq_bucket(n: int) -> int:
    """The sequence-count bucket a step's cost is kept under: the power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def ctx_bucket(context: float) -> int:
    """The context bucket of a step whose sequences hold `context` cached tokens on average:
    0 below 256, then one a factor of four (256, 1,024, 4,096 ...)."""
    return max(0, (int(context).bit_length() - 7) // 2)


def nearest(key: Key, keys) -> Key:
    """The key of `keys` nearest `key`: the closest context first, then the fewest doublings of
    sequences (the smaller on a tie)."""
    b, c = key
    return min(keys, key=lambda k: (abs(k[1] - c), abs(k[0].bit_length() - b.bit_length()), k))


class StepCosts:
    """(a, m, h) per bucket from its last WINDOW samples, refitted once REFIT samples came. A
    bucket whose samples do not tell a term apart (every step a plain decode: no `h`; one row
    count: no `m`) takes that term from the nearest bucket that does; an unmeasured bucket takes
    the nearest one's fit."""

    WINDOW = 48
    REFIT = 4

    def __init__(self):
        self._samples: dict[Key, deque] = {}  # bucket -> (rows, verifying, seconds)
        self._fits: dict[Key, tuple[int, Fit]] = {}  # bucket -> (samples when fitted, fit)
        self._recorded: dict[Key, int] = {}

    def record(self, seqs: int, rows: int, seconds: float, context: float = 0, verifying: int = 0) -> None:
        b = (seq_bucket(seqs), ctx_bucket(context))
        self._samples.setdefault(b, deque(maxlen=self.WINDOW)).append((rows, verifying, seconds))
        self._recorded[b] = self._recorded.get(b, 0) + 1

    @property
    def measured(self) -> bool:
        return bool(self._samples)

    def samples(self, seqs: int, context: float = 0) -> int:
        """Samples in the step's own bucket."""
        return len(self._samples.get((seq_bucket(seqs), ctx_bucket(context)), ()))

    def fit(self, seqs: int, context: float = 0) -> Fit | None:
        """(a, m, h) of the step's bucket (the nearest measured one's when it has none)."""
        if not self._samples:
            return None
        b = (seq_bucket(seqs), ctx_bucket(context))
        if b not in self._samples:
            b = nearest(b, self._samples)
        return self._fit(b)

    def estimate(self, seqs: int, rows: int, context: float = 0, verifying: int = 0) -> float | None:
        f = self.fit(seqs, context)
        return None if f is None else max(1e-9, f[0] + f[1] * rows + f[2] * verifying)

    def _fit(self, b: Key, borrow: bool = True) -> Fit:
        held = self._fits.get(b)
        n = self._recorded[b]
        if held is not None and n - held[0] < (self.REFIT if n > self.WINDOW // 2 else 1):
            return held[1]  # refitted on every sample while the bucket is young
        pts = self._samples[b]
        spread_v = len({v for _, v, _ in pts}) > 1
        spread_x = len({(x, v) for x, v, _ in pts}) > 1 + spread_v
        m = h = None
        if borrow and not (spread_v and spread_x):
            other = [k for k in self._samples if k != b and self._identified(k)]
            if other:
                _, m0, h0 = self._fit(nearest(b, other), borrow=False)
                m = None if spread_x else m0
                h = None if spread_v else h0
        fit = least_squares(pts, m, h)
        self._fits[b] = (n, fit)
        return fit

    def _identified(self, b: Key) -> bool:
        pts = self._samples[b]
        return len({v for _, v, _ in pts}) > 1 and len({(x, v) for x, v, _ in pts}) > 2


def least_squares(pts, m: float | None = None, h: float | None = None) -> Fit:
    """(a, m, h) minimising the squared error over (rows, verifying, seconds) samples, m and h
    at least 0; a term given is held fixed. Terms the samples cannot tell apart are 0 (h) or
    make the line pass through the origin (m), the cautious reading of one point."""
    xs, vs, ys = zip(*pts)
    free_m = m is None and len(set(xs)) > 1
    free_h = h is None and len(set(vs)) > 1
    m = 0.0 if m is None else m
    h = 0.0 if h is None else h
    for _ in range(3):  # a negative term is held at 0 and the rest refitted
        cols = [c for c, free in ((xs, free_m), (vs, free_h)) if free]
        target = [y - (0.0 if free_m else m * x) - (0.0 if free_h else h * v) for x, v, y in zip(xs, vs, ys)]
        coef = _solve(cols, target)
        a = coef[0]
        i = 1
        if free_m:
            m, i = coef[i], i + 1
        if free_h:
            h = coef[i]
        if free_m and m < 0:
            free_m, m = False, 0.0
        elif free_h and h < 0:
            free_h, h = False, 0.0
        else:
            break
    if len(set(xs)) == 1 and m == 0.0 and not free_h and xs[0]:  # one row count: through the origin
        m, a = a / xs[0], 0.0
    return a, max(0.0, m), max(0.0, h)


def _solve(cols: list[tuple], y: list[float]) -> list[float]:
    """Least squares of y on [1, *cols] by the normal equations (at most 3 x 3: Gaussian
    elimination; a singular system keeps the intercept alone)."""
    n = len(y)
    X = [[1.0, *(c[i] for c in cols)] for i in range(n)]
    k = len(cols) + 1
    A = [[sum(X[r][i] * X[r][j] for r in range(n)) for j in range(k)] for i in range(k)]
    b = [sum(X[r][i] * y[r] for r in range(n)) for i in range(k)]
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(A[r][i]))
        if abs(A[p][i]) < 1e-12:
            return [sum(y) / n] + [0.0] * (k - 1)
        A[i], A[p], b[i], b[p] = A[p], A[i], b[p], b[i]
        for r in range(i + 1, k):
            f = A[r][i] / A[i][i]
            A[r] = [A[r][j] - f * A[i][j] for j in range(k)]
            b[r] -= f * b[i]
    out = [0.0] * k
    for i in range(k - 1, -1, -1):
        out[i] = (b[i] - sum(A[i][j] * out[j] for j in range(i + 1, k))) / A[i][i]
    return out
