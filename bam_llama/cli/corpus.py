"""`python -m bam_llama.cli.corpus OUTPUT_DIR`: write the no-download Python corpus (`data/corpus.py`)."""

import argparse
import json
import sys
from pathlib import Path

CORPUS_DESCRIPTION = "A real-text corpus with no download: the text that ships with Python itself."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bam_llama.cli.corpus", description=CORPUS_DESCRIPTION)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--heldout-percent", type=float, default=5.0, help="share of documents held out (default 5)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUTPUT_DIR")
    args = parser.parse_args(argv)
    if not 0 < args.heldout_percent < 100:
        parser.error(f"--heldout-percent must be in (0, 100), got {args.heldout_percent}")
    from ..data.corpus import write_corpus

    statistics = write_corpus(args.output_dir, args.heldout_percent / 100, args.force)
    print(json.dumps(statistics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
