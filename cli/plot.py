"""Accuracy against TTFT, one series per `ragkv eval --json` result (`ragkv bench --plot`).

Each eval file becomes one panel titled by its task and context; each method is one
point, its name written beside it, so every method reads against `full` and `reuse`
of the same run. Where the results have fidelity (`f1_vs_full`: token F1 of each answer
against full prefill's), each method gets a second, hollow triangle at that value, so
accuracy and fidelity to full read on one axis. matplotlib is the `plot` extra; nothing else imports it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def load_eval(path: Path) -> dict:
    """One `ragkv eval --json` object, checked for what the plot reads."""
    try:
        data = json.loads(path.read_text())
        modes = data["modes"]
        for m in modes.values():
            float(m["accuracy"]), float(m["ttft_median_s"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a `ragkv eval --json` result ({exc}); make one with "
                         "`ragkv eval ... --json > FILE.json`") from None
    return data


def series_label(data: dict, path: Path) -> str:
    cfg = data.get("config", {})
    if cfg.get("synthetic"):
        return f"{path.stem}: {cfg['synthetic']} {int(cfg.get('context', 0)) // 1024}K, n={cfg.get('n')}"
    return path.stem


def plot_accuracy_vs_ttft(paths: Sequence[Path], out: Path) -> Path:
    """Write a PNG with one panel per eval file: accuracy (y) against median TTFT (x, log).

    Dashed lines mark the quality target of issue 7 where the file has a `full` row:
    95% of full's accuracy (horizontal) and a third of full's TTFT (vertical); a method
    in the upper-left box meets both.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'ragkv[plot]'") from None
    if not paths:
        raise ValueError("give at least one eval result to plot")
    runs = [(load_eval(p), p) for p in paths]
    ncols = min(3, len(runs))
    nrows = (len(runs) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (data, path) in zip(axes.flat, runs):
        modes = data["modes"]
        fidelity = all("f1_vs_full" in m for m in modes.values())
        for name, m in modes.items():
            x, y = m["ttft_median_s"], m["accuracy"]
            color = "black" if name == "full" else "gray" if name.startswith("reuse") else \
                "tab:green" if name.startswith("focus") else "tab:blue"
            ax.plot([x], [y], "o", color=color)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
            if fidelity and name != "full":
                ax.plot([x], [float(m["f1_vs_full"])], "^", mfc="none", color=color)
        if "full" in modes:
            full = modes["full"]
            ax.axhline(0.95 * full["accuracy"], ls="--", lw=0.8, color="black")
            ax.axvline(full["ttft_median_s"] / 3, ls="--", lw=0.8, color="black")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(series_label(data, path), fontsize=10)
        ax.set_xlabel("median TTFT, s (log)", fontsize=8)
        ax.set_ylabel("accuracy (o), F1 vs full (^)" if fidelity else "accuracy", fontsize=8)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.suptitle("Accuracy against time to first token (dashed: 95% of full's accuracy, full's TTFT / 3)",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)
    return out
