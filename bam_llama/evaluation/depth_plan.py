"""How many depths each length is tested at (`DepthPlan`), the depths themselves spaced uniformly. Light on purpose:
`bam-eval --help` and `bam-demo --help` show plans as their defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def uniform_depths(num_depths: int) -> list[float]:
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if num_depths == 1:
        return [0.0]
    return [index / (num_depths - 1) for index in range(num_depths)]


@dataclass(frozen=True)
class DepthPlan:
    """How many depths (uniformly spaced from 0, the start of the context, to 1, its end) each length is tested
    at: `default` for every length, `by_length` for the lengths it names (fewer at the longest lengths, where one
    prompt costs the most)."""

    default: int = 20
    by_length: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self):
        for length, count in {None: self.default, **self.by_length}.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                where = "" if length is None else f" at length {length}"
                raise ValueError(f"the number of depths{where} must be a positive integer, got {count!r}")

    @classmethod
    def of(cls, num_depths: int | DepthPlan) -> DepthPlan:
        return num_depths if isinstance(num_depths, DepthPlan) else cls(default=num_depths)

    def count(self, length: int) -> int:
        return self.by_length.get(length, self.default)

    def depths(self, length: int) -> list[float]:
        return uniform_depths(self.count(length))
