"""Always-valid tests: p-values that stay valid however often they are looked at.

Each test computes an e-value M from the sample at hand: under its null hypothesis M is a
nonnegative supermartingale in the number of samples, starting at 1, so by Ville's inequality
the chance that it *ever* reaches 1/alpha is at most alpha. `p = min(1, 1/M)` is then an
always-valid p-value: rejecting at any look where p <= alpha rejects a true null with
probability at most alpha over every look together, however many there are and whenever they
are taken (Howard, Ramdas, McAuliffe and Sekhon 2021, "Time-uniform, nonparametric,
nonasymptotic confidence sequences"; Ramdas, Grünwald, Vovk and Shafer 2023, "Game-theoretic
statistics and safe anytime-valid inference"). Looks need no correction; several tests still
share alpha out between them.

What would surprise a reader: M is a mixture over alternatives (a prior on the effect, a grid of
rate ratios or of bets), which is what makes it computable from the current sample alone, with
no state carried from one look to the next. The price of unlimited looks is a larger p-value
than a fixed-sample test gives on the same data: at alpha 0.0025 a one-sided z has to reach
about 3.8 to 4.1 (for 50 to 10 000 effective samples) instead of 2.8.

- `rate_ratio_p`, `label_split_p`: events (failures, low-confidence answers) or labels in two
  samples. Exact given the samples' sizes: when the two do not differ, each event, or each
  sample with a given label, falls in the first sample with probability equal to its share.
- `normal_mixture_p`: a statistic that is asymptotically normal (a rank test's z), treated as
  Brownian motion in information time (the effective sample size) with a normal prior on the
  drift. Valid as far as the normal approximation is.
- `bounded_mean_p`: values in [0, 1] against a bar, by betting. Exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from scipy.special import betaln, log_ndtr

# Where the normal-mixture boundary is tightest: the prior's variance, in effective samples.
# 20 keeps the one-sided z threshold within 3.8-4.1 from 50 to 10 000 effective samples at
# alpha 0.0025.
MIXTURE_SAMPLES = 20.0
# How far the label test's prior lets a label's share of the canary move, relative to its share.
LABEL_SPREAD = 0.5
# Rate ratios (first sample's rate / second's) the event test mixes over, equally weighted: from
# a small rise of a common event to a rare failure becoming common.
RATE_RATIOS = (1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
# Fractions of the most a bet can lose that the bounded-mean test stakes per value.
BET_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)


def p_value(log_e: float) -> float:
    """The always-valid p-value of an e-value given as its logarithm."""
    return 1.0 if log_e <= 0 else math.exp(-log_e)


def _log_mean_exp(logs: Sequence[float]) -> float:
    """The logarithm of an equally weighted mixture of e-values given as logarithms."""
    top = max(logs)
    return top + math.log(sum(math.exp(v - top) for v in logs) / len(logs))


def effective_samples(n1: float, n2: float) -> float:
    """The information of a two-sample comparison in samples: n1 n2 / (n1 + n2), which is the
    smaller sample's size when the other is much larger (a canary against stable)."""
    return n1 * n2 / (n1 + n2) if n1 > 0 and n2 > 0 else 0.0


def rate_ratio_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """Evidence that events are more frequent in the first sample (x1 of n1) than in the second.

    Conditional on the events, each is in the first sample with probability s = n1 / (n1 + n2)
    when the rates are equal (or less when the first rate is lower), and with s psi / (1 - s + s
    psi) when the first rate is psi times the second. M averages the likelihood ratios
    psi^x1 / (1 + s (psi - 1))^(x1 + x2) over `RATE_RATIOS`."""
    events = x1 + x2
    if n1 <= 0 or n2 <= 0 or events == 0:
        return 1.0
    share = n1 / (n1 + n2)
    logs = [x1 * math.log(psi) - events * math.log1p(share * (psi - 1)) for psi in RATE_RATIOS]
    return p_value(_log_mean_exp(logs))


def normal_mixture_p(z: float | None, n_eff: float) -> float:
    """Evidence that a standardized statistic's mean is above 0 (one-sided).

    With S = z sqrt(I) and a half-normal prior on the drift of scale 1/rho (I and rho in
    effective samples, r = I / rho), M = 2 (1 + r)^(-1/2) exp(z^2 r / (2 (1 + r)))
    Phi(z sqrt(r / (1 + r)))."""
    if z is None or n_eff <= 0 or not math.isfinite(z):
        return 1.0
    r = n_eff / MIXTURE_SAMPLES
    shrink = r / (1 + r)
    log_e = math.log(2.0) - 0.5 * math.log1p(r) + z * z * shrink / 2 + float(log_ndtr(z * math.sqrt(shrink)))
    return p_value(log_e)


def label_split_p(x: Sequence[int], y: Sequence[int]) -> float:
    """Evidence that two samples' label distributions differ, from their counts per label (x in
    the first sample, y in the second, label by label).

    Conditional on the labels, each sample is in the first with probability s = sum(x) /
    (sum(x) + sum(y)) under homogeneity, whatever its label. For each label M mixes the chance
    theta that a sample with it is in the first over a Beta prior of mean s and standard
    deviation `LABEL_SPREAD` s (a label's share moving by about half), and multiplies the labels'
    Beta-binomial likelihood ratios: one martingale per label, each over its own samples."""
    counts_x, counts_y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n1, n2 = float(counts_x.sum()), float(counts_y.sum())
    if n1 <= 0 or n2 <= 0:
        return 1.0
    share = n1 / (n1 + n2)
    concentration = max(1.0, (1 - share) / (LABEL_SPREAD**2 * share) - 1)
    a, b = share * concentration, (1 - share) * concentration
    log_e = np.sum(
        betaln(a + counts_x, b + counts_y) - betaln(a, b) - counts_x * math.log(share) - counts_y * math.log1p(-share)
    )
    return p_value(float(log_e))


def bounded_mean_p(values: Sequence[float] | npt.NDArray[np.float64], bar: float, *, below: bool) -> float:
    """Evidence that the mean of values in [0, 1] is below `bar` (`below`) or above it.

    A bettor stakes a fixed fraction c of what each value could lose: wealth is the product of
    1 + c (bar - x) / (1 - bar) (below) or 1 + c (x - bar) / bar (above), a nonnegative
    supermartingale while the null holds. M averages the wealth over `BET_FRACTIONS`; being a
    product, it does not depend on the order of the values."""
    x = np.clip(np.asarray(values, dtype=float), 0.0, 1.0)
    if len(x) == 0:
        return 1.0
    gain = (bar - x) / max(1.0 - bar, 1e-12) if below else (x - bar) / max(bar, 1e-12)
    logs = [float(np.sum(np.log1p(c * gain))) for c in BET_FRACTIONS]
    return p_value(_log_mean_exp(logs))
