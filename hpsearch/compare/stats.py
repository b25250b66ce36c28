"""Mean and confidence interval over seeds, and paired differences between two methods seed by seed.

    iv = interval([71.2, 73.0, 70.4])                        # Student-t, 95 %
    iv = interval(values, Stats(interval="bootstrap"))       # scipy.stats.bootstrap, seeded
    d = paired({0: 71.2, 1: 73.0}, {0: 70.0, 1: 72.5})       # a - b on the seeds both have

Student-t: mean +- t_{(1+c)/2, n-1} * s / sqrt(n), s the sample standard deviation (ddof=1). Bootstrap: scipy's
interval for the mean (BCa by default), `resamples` resamples from a seeded generator. With one value there is no
interval (low = high = nan); with identical values it is the point itself.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from hpsearch.compare.spec import BOOTSTRAP_MIN_SEEDS, Stats


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    kind: str                          # t | bootstrap

    @property
    def defined(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    def text(self, digits: int = 1) -> str:
        """`72.3 ± 4.1` (t: symmetric), `72.3 [68.1, 75.0]` (bootstrap), `72.3` (one value), `–` (none)."""
        if self.n == 0 or not math.isfinite(self.mean):
            return "–"
        mean = f"{self.mean:.{digits}f}"
        if not self.defined:
            return mean
        if self.kind == "t":
            return f"{mean} ± {(self.high - self.low) / 2:.{digits}f}"
        return f"{mean} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


@dataclass(frozen=True)
class Paired:
    diff: Interval                     # of a - b over the common seeds
    seeds: list[int]
    wins: int                          # seeds where a > b
    losses: int                        # seeds where a < b


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    from scipy.stats import t

    x = [float(v) for v in values]
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "t")
    mean = sum(x) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, "t")
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / (n - 1))
    half = float(t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t")


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 9999, seed: int = 0,
                       method: str = "BCa") -> Interval:
    import numpy as np
    from scipy.stats import bootstrap

    x = np.asarray([float(v) for v in values])
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "bootstrap")
    mean = float(x.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, "bootstrap")
    if np.all(x == x[0]):  # scipy calls this degenerate (nan); every resample has this mean
        return Interval(mean, mean, mean, n, "bootstrap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DegenerateDataWarning for tiny samples: the nan says it
        res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=resamples, method=method,
                        random_state=np.random.default_rng(seed), vectorized=True)
    return Interval(mean, float(res.confidence_interval.low), float(res.confidence_interval.high), n, "bootstrap")


def interval(values: Sequence[float], stats: Stats | None = None) -> Interval:
    """The interval the spec asks for (`stats.interval`), finite values only. A bootstrap over fewer than
    `BOOTSTRAP_MIN_SEEDS` values (a spec needs that many seeds for it; failed runs can leave fewer) is a t interval
    instead (shown as `±`, not `[low, high]`): over few values a bootstrap is about their range."""
    stats = stats or Stats()
    x = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if stats.interval == "bootstrap" and len(x) >= BOOTSTRAP_MIN_SEEDS:
        return bootstrap_interval(x, stats.confidence, stats.resamples, stats.seed, stats.bootstrap_method)
    return t_interval(x, stats.confidence)


def paired(a: dict[int, float], b: dict[int, float], stats: Stats | None = None) -> Paired:
    """a - b seed by seed, over the seeds where both have a finite value."""
    ok = lambda v: v is not None and math.isfinite(float(v))
    seeds = sorted(s for s in a if s in b and ok(a[s]) and ok(b[s]))
    diffs = [float(a[s]) - float(b[s]) for s in seeds]
    return Paired(interval(diffs, stats), seeds, sum(d > 0 for d in diffs), sum(d < 0 for d in diffs))
