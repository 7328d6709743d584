"""The needle tasks `bam-eval needles` offers: their kinds, sizes and labels (the prompts and scoring: `needles.py`).
Light on purpose: `bam-eval --help` reads it."""

from dataclasses import dataclass

NEEDLE_KINDS = ("multikey", "multivalue", "multiquery", "vartrack")

LABELS = (
    "apple", "river", "candle", "mountain", "violet", "harbor", "pepper", "falcon", "marble", "lantern", "meadow",
    "copper", "walnut", "glacier", "saddle", "orchid", "thunder", "pebble", "compass", "willow", "ember", "anchor",
    "cobalt", "biscuit", "canyon", "feather", "garnet", "hollow", "island", "jasmine", "kettle", "ladder", "magnet",
    "nectar", "oyster", "parrot", "quartz", "ribbon", "salmon", "timber", "velvet", "wagon", "yonder", "zephyr",
    "badger", "cactus", "dolphin", "engine", "fossil", "ginger", "helmet", "igloo", "jungle", "koala", "lemon",
    "mitten", "nutmeg", "otter", "puzzle", "rocket", "spider", "tulip", "umbrella", "vessel",
)


@dataclass(frozen=True)
class NeedleTask:
    """One needle variant and its sizes (each kind reads its own: `keys`, `values`, `queries`, `chains` and `hops`)."""

    kind: str
    keys: int = 4
    values: int = 3
    queries: int = 3
    chains: int = 2
    hops: int = 2
    digits: int = 5

    def __post_init__(self):
        if self.kind not in NEEDLE_KINDS:
            raise ValueError(f"needle task {self.kind!r} is not one of {', '.join(NEEDLE_KINDS)}")
        smallest = {"keys": 2, "values": 2, "queries": 2, "chains": 1, "hops": 1, "digits": 1}
        for name, least in smallest.items():
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
        if self.labels_needed() > len(LABELS):
            raise ValueError(f"{self.kind} needs {self.labels_needed()} labels; there are {len(LABELS)}")

    def labels_needed(self) -> int:
        return {
            "multikey": self.keys, "multivalue": 1, "multiquery": self.queries, "vartrack": self.chains * (self.hops + 1)
        }[self.kind]

    def values_needed(self) -> int:
        return {"multikey": self.keys, "multivalue": self.values, "multiquery": self.queries, "vartrack": self.chains}[self.kind]

    def describe(self) -> str:
        return {
            "multikey": f"{self.keys} keys, one asked",
            "multivalue": f"one key with {self.values} values, all asked",
            "multiquery": f"{self.queries} keys, all asked at once",
            "vartrack": f"{plural(self.chains, 'chain')} of {plural(self.hops, 'hop')}, the end of one asked",
        }[self.kind]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
