"""What the conversions accept: the weights dtypes, shard sizes, the reference variants and prior-parameter name
generations (a converted Llama's prior: `positional_variants.PRIOR_INITS`). Light on purpose: `bam-convert --help`
reads it."""

from __future__ import annotations

import re

from ..files.outputs import OutputError

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}  # torch dtype names

DEFAULT_MAX_SHARD_SIZE = "5GB"

VARIANTS = ("bam", "bam_ssmax")  # the reference code's GGD-BAM `position_encoding`s

# The prior parameters were renamed upstream; both generations store them as (1, H, 1, 1).
PRIOR_NAME_GENERATIONS = {
    "shape-scale-loc": {"shape": "theta_beta", "scale": "theta_alpha", "loc": "theta_mu"},
    "theta": {"theta_beta": "theta_beta", "theta_alpha": "theta_alpha", "theta_mu": "theta_mu"},
}


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if match is None or float(match.group(1)) <= 0:
        raise OutputError(f"cannot read the shard size {size!r}; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * units[match.group(2) or ""])
