"""benchmarks/text_extrapolation.py --quick runs the whole pipeline: five models trained by bam-pretrain, RoPE's
two extensions, perplexity and passkey at every length, results renamed into place."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import checkout_environment


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "text_extrapolation.py"
MODELS = ("bam", "bam-ssmax", "alibi", "nope", "rope", "rope-dynamic", "rope-yarn")


def test_quick_run_writes_every_model_at_every_length(tmp_path):
    output = tmp_path / "results"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(output)],
        capture_output=True, text=True, timeout=600, env=checkout_environment(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((output / "results.json").read_text())
    lengths = [str(report["recipe"]["train_length"] * scale) for scale in report["recipe"]["scales"]]
    assert tuple(report["results"]) == MODELS
    for name, result in report["results"].items():
        assert list(result["perplexity"]) == lengths and list(result["passkey"]) == lengths
        for length in lengths:
            point = result["perplexity"][length]
            assert point["sequences"] == report["recipe"]["perplexity_sequences"]
            assert 1 < point["perplexity"] < 2 * report["training"]["bam"]["vocab_size"], (name, length, point)
            assert len(result["passkey"][length]["correct"][0]) == report["recipe"]["num_depths"]
        assert (output / f"passkey-{name}.png").stat().st_size > 0
    for name in ("bam", "alibi", "nope", "rope"):
        assert report["training"][name]["loss_after"] < report["training"][name]["loss_before"]
    assert (output / "perplexity.png").stat().st_size > 0
    assert "| rope-yarn |" in (output / "results.md").read_text()
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".partial")]
