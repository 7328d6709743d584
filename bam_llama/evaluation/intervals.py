"""How sure a retrieval rate is: the exact (Clopper-Pearson) binomial interval of `successes` out of `trials`,
without SciPy.

The interval's ends are the success probabilities at which observing `successes` becomes just unlikely enough:
the lower end p solves P(X >= successes | p) = (1 - confidence) / 2, the upper end P(X <= successes | p) = the same,
X ~ Binomial(trials, p). Both tails are monotone in p, so each end is found by bisection on the binomial CDF
(summed in log space, so that thousands of trials neither overflow nor underflow).
"""

from __future__ import annotations

import math

BISECTION_STEPS = 60  # halves [0, 1] to below 1e-18, past a double's precision near the ends


def binomial_cdf(successes: int, trials: int, probability: float) -> float:
    """P(X <= successes) for X ~ Binomial(trials, probability)."""
    if successes < 0:
        return 0.0
    if successes >= trials or probability <= 0.0:
        return 1.0
    if probability >= 1.0:
        return 0.0
    log_p, log_q = math.log(probability), math.log1p(-probability)
    terms = [
        math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1) + k * log_p + (trials - k) * log_q
        for k in range(successes + 1)
    ]
    largest = max(terms)
    return min(1.0, math.exp(largest) * sum(math.exp(term - largest) for term in terms))


def _bisect(decreasing_in_p, target: float) -> float:
    """The p in [0, 1] where `decreasing_in_p(p)` falls through `target`."""
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if decreasing_in_p(middle) > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact two-sided `confidence` interval (low, high) of a rate of `successes` in `trials`; 0 successes
    give low = 0, all successes high = 1."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2
    # P(X >= successes | p) = 1 - cdf(successes - 1) rises with p: the lower end is where it reaches `tail`
    low = 0.0 if successes == 0 else _bisect(lambda p: binomial_cdf(successes - 1, trials, p), 1.0 - tail)
    # P(X <= successes | p) falls with p: the upper end is where it drops to `tail`
    high = 1.0 if successes == trials else _bisect(lambda p: binomial_cdf(successes, trials, p), tail)
    return low, high


def interval_text(successes: int, trials: int) -> str:
    """"23-69": the 95% Clopper-Pearson interval in whole percent, rounded outwards (the printed interval holds the
    exact one)."""
    low, high = clopper_pearson(successes, trials)
    return f"{math.floor(100 * low + 1e-9)}-{math.ceil(100 * high - 1e-9)}"


def rate_with_interval(successes: int, trials: int) -> str:
    """"45% (23-69)": the rate in whole percent and its 95% interval (`interval_text`)."""
    return f"{100 * successes / trials:.0f}% ({interval_text(successes, trials)})"


# Student's t quantile at 0.975 by degrees of freedom: the two-sided 95% interval of a mean of a few seeds' rates.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval_over_seeds(rates: list[float]) -> tuple[float, float] | None:
    """The 95% t-interval of the mean of per-seed rates, clipped to [0, 1]: the seed-to-seed spread, which a pooled
    count's interval leaves out. None with fewer than two seeds (or more than T_975 knows)."""
    count = len(rates)
    if count < 2 or count - 1 not in T_975:
        return None
    mean = sum(rates) / count
    spread = math.sqrt(sum((rate - mean) ** 2 for rate in rates) / (count - 1))
    half = T_975[count - 1] * spread / math.sqrt(count)
    return max(0.0, mean - half), min(1.0, mean + half)
