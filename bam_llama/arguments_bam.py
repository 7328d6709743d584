"""argparse `type=` checks shared by the commands: a bad value becomes one line naming the argument and exit
status 2, before any weights are loaded. Light on imports, so --help stays fast."""

import argparse


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text!r}")
    return value


def length_list(text: str) -> list[int]:
    """`"256,512,1k"` -> `[256, 512, 1024]`; `k` means 1024; every length must be positive."""
    lengths = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        number, scale = (item[:-1], 1024) if item.endswith("k") else (item, 1)
        try:
            length = int(number) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a length in tokens (write e.g. 512,1k,2k)") from None
        if length <= 0:
            raise argparse.ArgumentTypeError(f"lengths must be positive, got {item!r}")
        lengths.append(length)
    if not lengths:
        raise argparse.ArgumentTypeError(f"no length in {text!r}")
    return lengths


def device_name(text: str) -> str:
    """A torch device this PyTorch build can use: cpu, cuda, cuda:N, mps, ..."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "has no CUDA support" if torch.version.cuda is None else "sees no GPU"
            raise argparse.ArgumentTypeError(f"{text!r}: this PyTorch build ({torch.__version__}) {build}; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: there are only {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available on this machine; use cpu")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
