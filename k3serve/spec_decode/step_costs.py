"""The draft-length policy's cost table: seconds of a decode / verify step by (sequence bucket,
rows), measured (spec_decode/adaptive.py; seeded by runner/spec_profile.py, refreshed by the
steps the engine runs). Pure Python."""

from __future__ import annotations

import bisect
from collections import deque
from statistics import median


def seq_bucket(n: int) -> int:
    """The sequence-count bucket a step's cost is kept under: the power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


class StepCosts:
    """Step seconds by (sequence bucket, rows), each point the median of its last WINDOW
    samples (a compile, a GC pause or a noisy second moves one sample, not the estimate).
    Between measured rows: linear; past them: the nearest segment's slope (at least 0); a bucket
    with one point: linear in rows (the CPU's shape, the cautious guess); an unmeasured bucket:
    the nearest measured one's curve."""

    WINDOW = 9
    REBUILD = 16

    def __init__(self):
        self._samples: dict[int, dict[int, deque]] = {}
        self._curves: dict[int, tuple[list[int], list[float]]] = {}  # bucket -> (rows, seconds) sorted
        self._dense: dict[int, tuple[int, list[float]]] = {}  # bucket -> (samples when built, dense())
        self._recorded = 0  # samples so far

    def record(self, seqs: int, rows: int, seconds: float) -> None:
        b = seq_bucket(seqs)
        self._recorded += 1
        if b not in self._curves:  # a new bucket: the nearest-bucket stand-ins are stale
            self._dense.clear()
        pts = self._samples.setdefault(b, {})
        window = pts.get(rows)
        if window is None:
            window = pts[rows] = deque(maxlen=self.WINDOW)
        window.append(seconds)
        xs, ys = self._curves.setdefault(b, ([], []))
        i = bisect.bisect_left(xs, rows)  # one point moves: its median, in place
        if i == len(xs) or xs[i] != rows:
            xs.insert(i, rows)
            ys.insert(i, 0.0)
            self._dense.pop(b, None)
        ys[i] = median(window)

    @property
    def measured(self) -> bool:
        return bool(self._curves)

    def table(self) -> dict[int, dict[int, float]]:
        """{sequence bucket: {rows: seconds}} (what the bench prints)."""
        return {b: dict(zip(*c)) for b, c in sorted(self._curves.items())}

    def curve(self, seqs: int) -> tuple[list[int], list[float]] | None:
        """The (rows, seconds) of `seqs`' bucket. A bucket measured at fewer than two rows counts
        takes the shape of the nearest bucket that has two, through its own point (or that
        bucket's curve as it is, when it has none)."""
        b = seq_bucket(seqs)
        c = self._curves.get(b)
        if c is not None and len(c[0]) > 1:
            return c
        shaped = [x for x, v in self._curves.items() if len(v[0]) > 1]
        if not shaped:  # every bucket one point: its own, else the nearest one's
            return c if c is not None or not self._curves else self._curves[nearest(b, self._curves)]
        near = self._curves[nearest(b, shaped)]
        if c is None:
            return near
        scale = c[1][0] / interpolate(near, c[0][0])
        return near[0], [y * scale for y in near[1]]

    def estimate(self, seqs: int, rows: int) -> float | None:
        c = self.curve(seqs)
        return None if c is None else interpolate(c, rows)

    def dense(self, seqs: int, rows: int) -> list[float]:
        """[r] = the estimate at r rows for r in 0..rows, made non-decreasing: one list a bucket,
        rebuilt when it is too short or REBUILD samples came since, anywhere (a bucket may read
        another's curve); the per-step choice reads it, never searches."""
        b = seq_bucket(seqs)
        held = self._dense.get(b)
        if held is None or len(held[1]) <= rows or self._recorded - held[0] >= self.REBUILD:
            c = monotone(self.curve(seqs))
            held = self._dense[b] = (self._recorded, [interpolate(c, r) for r in range(max(rows + 1, 2 * rows))])
        return held[1]


def monotone(curve: tuple[list[int], list[float]]) -> tuple[list[int], list[float]]:
    """The curve made non-decreasing in rows (pool adjacent violators, equal weights): a step
    of more rows never costs less, and a noisy point must not make a longer draft look free."""
    xs, ys = curve
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return xs, [m for m, n in blocks for _ in range(int(n))]


def nearest(bucket: int, buckets) -> int:
    """The bucket of `buckets` fewest doublings away (the smaller on a tie)."""
    return min(buckets, key=lambda x: (abs(x.bit_length() - bucket.bit_length()), x))


def interpolate(curve: tuple[list[int], list[float]], rows: int) -> float:
    xs, ys = curve
    if len(xs) == 1:
        return ys[0] * rows / xs[0]
    i = bisect.bisect_left(xs, rows)
    if i < len(xs) and xs[i] == rows:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)  # the segment [i - 1, i] holding rows, or the nearest one
    slope = max(0.0, (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))
    return max(1e-9, ys[i - 1] + slope * (rows - xs[i - 1]))
