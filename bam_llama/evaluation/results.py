"""Results of `bam-eval ... --out`: the table, the JSON results and the plot, and reading the JSON back."""

from __future__ import annotations

import json
from pathlib import Path

from ..files.outputs import staged_files
from .needles import NeedleResults
from .passkey import PasskeyResults
from .perplexity import PerplexityResults


def write_outputs(folder, name: str, table: str, results: dict, save_png) -> None:
    """NAME.md, NAME.json and NAME.png (`save_png(path)` writes it) in `folder`, staged and renamed in together: a
    failure (a full disk, Ctrl-C) leaves no partial file and keeps the earlier ones."""
    folder = Path(folder)
    with staged_files(folder, name) as staging:
        (staging / f"{name}.md").write_text(table, encoding="utf-8")
        (staging / f"{name}.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
        save_png(staging / f"{name}.png")
    print(f"Wrote {folder / name}.md, .json and .png")


RESULT_KINDS = {cls.KIND: cls for cls in (PasskeyResults, NeedleResults)} | {"perplexity": PerplexityResults}
Results = PasskeyResults | NeedleResults | PerplexityResults


def results_from_dict(values: dict, source: str = "evaluation results") -> Results:
    """The results a `to_dict()` (or its JSON) holds, by its `kind`; a ValueError naming `source` otherwise."""
    if not isinstance(values, dict) or values.get("kind") not in RESULT_KINDS:
        kind = values.get("kind") if isinstance(values, dict) else None
        raise ValueError(f"{source} is not a bam-eval results file (kind={kind!r})")
    return RESULT_KINDS[values["kind"]].from_dict(values)


def load_results(path) -> Results:
    """Results saved by `bam-eval ... --out` (their `kind` says which)."""
    return results_from_dict(json.loads(Path(path).read_text(encoding="utf-8")), str(path))
