"""benchmarks/flat_heads.py: a head is flat where exp(theta_alpha) * distance ** theta_beta is below the threshold,
each prior is counted once with its models' best rate at 64x, and the table splits priors by a flat head below the
last layer."""

import importlib.util
import json
import math
import sys

from helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "flat_heads.py"


def load():
    spec = importlib.util.spec_from_file_location("flat_heads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flat_heads"] = module
    spec.loader.exec_module(module)
    return module


def prior(flat: dict[int, int]) -> dict:
    """Two layers of two heads, each local (alpha 0, beta 1: cost 4096 at 4,096 tokens) but for `flat` {layer: head}
    with beta -1 (cost 1/4096)."""
    beta = [[-1.0 if flat.get(layer) == head else 1.0 for head in range(2)] for layer in range(2)]
    return {"theta_alpha": [[0.0, 0.0], [0.0, 0.0]], "theta_beta": beta}


def job(learned: dict, found: int, phase: str = "validation") -> dict:
    correct = [[index < found for index in range(20)]]
    return {"stages": {"trained": {"learned": learned}, "extended": {"learned": learned}},
            "results": {"bam": {"trained": {"passkey": {"8192": {"correct": correct}}},
                                "extended": {"passkey": {"8192": {"correct": correct}}}}}}


def test_a_head_is_flat_by_its_cost_at_the_distance():
    flat_heads = load()
    learned = {"theta_alpha": [[math.log(4.0), math.log(6.0)]], "theta_beta": [[0.0, 0.0]]}  # costs 4 and 6
    assert flat_heads.flat_layers(learned, 4096, 5.0) == [0]
    assert flat_heads.flat_layers(learned, 4096, 3.0) == []
    assert flat_heads.flat_layers(prior({1: 0}), 4096, 5.0) == [1]
    assert flat_heads.flat_layers(prior({1: 0}), 1, 5.0) == [0, 1]  # at distance 1 every head costs 1


def test_priors_split_by_a_flat_head_below_the_last_layer(tmp_path):
    flat_heads = load()
    jobs = {"validation/bam/a/seed-100": job(prior({0: 1}), 15), "validation/bam/b/seed-101": job(prior({0: 0}), 4),
            "test/bam/a/seed-3": job(prior({1: 1}), 2, "test"), "test/bam/a/seed-4": job(prior({1: 1}), 1, "test")}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"jobs": jobs}))
    rows = flat_heads.prior_rows([path], "bam", 4096, 5.0)
    assert sorted((row["layers"], row["found"]) for row in rows) == [([0], 4), ([0], 15), ([1], 2)]  # seed 4's prior = seed 3's
    lines = flat_heads.table(rows)
    assert lines[2] == "| yes | 2 | 0 | 1 | 75% |"
    assert lines[3] == "| no | 1 | 1 | 0 | 10% |"
