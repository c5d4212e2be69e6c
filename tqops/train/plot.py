"""Loss curves of a training log: train loss and evaluation losses by step, other evaluation metrics beside them."""
from __future__ import annotations

import numpy as np

SKIP = {"step", "epoch", "seconds"}


def smooth(values, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (shorter at the start)."""
    values = np.asarray(values, dtype=float)
    if window <= 1 or len(values) == 0:
        return values
    cum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (cum[idx] - cum[lo]) / (idx - lo)


def plot_log(log: dict, path) -> None:
    """PNG at ``path``: train and evaluation losses (log scale), then one panel per other evaluation metric."""
    import matplotlib  # the optional "train" extra, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    train, evals = log.get("train", []), log.get("evals", [])
    keys = [k for k in (evals[0] if evals else {}) if k not in SKIP and isinstance(evals[0][k], (int, float))]
    losses = [k for k in keys if k.endswith("loss")]
    others = [k for k in keys if k not in losses]
    fig, axes = plt.subplots(1, 1 + len(others), figsize=(7 + 4.5 * len(others), 4.5), squeeze=False)
    ax = axes[0][0]
    if train:
        steps, values = [r[0] for r in train], [r[1] for r in train]
        ax.plot(steps, values, color="0.8", linewidth=0.6, label="train (per step)")
        ax.plot(steps, smooth(values, max(1, len(values) // 50)), color="0.3", label="train (mean)")
    for k in losses:
        ax.plot([e["step"] for e in evals], [e[k] for e in evals], "-o", markersize=3, label=k)
    ax.set_yscale("log")  # late differences of a few hundredths stay visible under an early loss of ~8
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title(log.get("title", "loss"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    for ax, k in zip(axes[0][1:], others):
        ax.plot([e["step"] for e in evals], [e[k] for e in evals], "-o", markersize=3, color="C2")
        ax.set_xlabel("step")
        ax.set_title(k)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
