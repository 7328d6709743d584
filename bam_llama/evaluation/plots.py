"""Figures of the evaluation (built with `matplotlib.figure.Figure`, never pyplot), and the learned GGD prior of a
model per head over distance (the paper's Figure 1 style)."""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure

from ..model.prior_bam import ggd_bias, prior_offset
from .decoding import load_model


def find_priors(model) -> list[tuple[str, torch.nn.Module]]:
    """(label, module) for every GGD prior of a model: the shared one, or one per layer. Duck-typed, so models
    loaded with trust_remote_code (whose classes are not bam_llama's) work too."""
    priors = [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith("prior") and all(hasattr(module, f"theta_{part}") for part in ("alpha", "beta", "mu"))
    ]
    if not priors:
        raise ValueError(f"{type(model).__name__} has no GGD-BAM prior to plot")
    return priors


def prior_curves(prior, max_distance: int) -> torch.Tensor:
    """(H, max_distance + 1) prior b_h at causal distances i - j = 0 .. max_distance."""
    distance = -torch.arange(max_distance + 1, dtype=torch.float32, device=prior.theta_alpha.device)
    formula, eps = getattr(prior, "formula", "current"), getattr(prior, "eps", 1e-5)
    with torch.no_grad():
        return ggd_bias(distance, prior.theta_alpha, prior.theta_beta, prior.theta_mu, formula, eps).cpu()


def plot_prior(model_or_path, path, max_distance: int = 1024, layer: int | None = None) -> None:
    """Each head's penalty -b_h over distances 1 .. max_distance on log-log axes (heads differ by orders of
    magnitude; a power law is a straight line, ALiBi a slope of 1), one line per head with its parameters and its
    value at distance 0 in the legend, one subplot per prior: the shared prior, every layer's, or only `layer`'s."""
    model = model_or_path
    if isinstance(model_or_path, (str, Path)):
        model = load_model(model_or_path, device="cpu")
    priors = _select_priors(find_priors(model), layer)
    train_length = getattr(model.config, "train_context_length", None)
    columns = min(len(priors), 3)
    rows = -(-len(priors) // columns)
    figure = Figure(figsize=(6.5 * columns, 4.5 * rows))
    distances = range(1, max_distance + 1)
    for axes, (label, prior) in zip(figure.subplots(rows, columns, squeeze=False).flat, priors):
        curves = prior_curves(prior, max_distance)
        mu = prior_offset(prior.theta_mu.detach().float()).cpu()
        for head, curve in enumerate(curves):
            alpha, beta = prior.theta_alpha[head].item(), prior.theta_beta[head].item()
            axes.plot(
                distances, -curve[1:],
                label=f"head {head}: θα={alpha:.2f} θβ={beta:.2f} μ={mu[head]:.2f}, b(0)={curve[0].item():.2g}",
            )
        if train_length and train_length <= max_distance:
            axes.axvline(train_length, color="gray", linestyle="--", label=f"training length {train_length}")
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("distance i - j (tokens)")
        axes.set_ylabel("penalty -b_h (log scale)")
        axes.set_title(label)
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(fontsize="x-small", ncol=2 if len(curves) > 8 else 1)
    for axes in list(figure.axes)[len(priors) :]:
        axes.set_visible(False)
    save_figure(figure, path)


def _select_priors(priors, layer):
    labelled = [(_prior_label(name), prior) for name, prior in priors]
    if layer is None:
        return labelled
    if len(labelled) == 1 and "layers" not in priors[0][0]:
        return labelled  # one prior shared by every layer
    wanted = [(label, prior) for (name, _), (label, prior) in zip(priors, labelled) if f"layers.{layer}." in name]
    if not wanted:
        raise ValueError(f"no prior for layer {layer}; the model has {len(priors)} layer priors")
    return wanted


def _prior_label(module_name: str) -> str:
    parts = module_name.split(".")
    if "layers" in parts:
        return f"layer {parts[parts.index('layers') + 1]}"
    return "prior shared by all layers"


def save_figure(figure, path) -> None:
    """Figures are built with `matplotlib.figure.Figure` (no pyplot), so no GUI backend is ever touched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
