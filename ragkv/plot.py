"""Accuracy against TTFT, one series per `ragkv eval --json` result (`ragkv bench --plot`).

Each eval file becomes one panel-series labelled by its task and context; each method
is one point, its name written beside it, so every method reads against `full` and
`reuse` of the same run. matplotlib is the `plot` extra; nothing else imports it.
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
        for name, m in modes.items():
            float(m["accuracy"]), float(m["ttft_median_s"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a `ragkv eval --json` result ({exc}); make one with "
                         "`ragkv eval ... --json > FILE.json`") from None
    return data


def series_label(data: dict, path: Path) -> str:
    cfg = data.get("config", {})
    if cfg.get("synthetic"):
        return f"{cfg['synthetic']} {int(cfg.get('context', 0)) // 1024}K (n={cfg.get('n')})"
    return path.stem


def plot_accuracy_vs_ttft(paths: Sequence[Path], out: Path) -> Path:
    """Write a PNG of accuracy (y) against median TTFT (x, log) for every eval file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'ragkv[plot]'") from None
    if not paths:
        raise ValueError("give at least one eval result to plot")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for path in paths:
        data = load_eval(path)
        modes = data["modes"]
        names = sorted(modes, key=lambda n: modes[n]["ttft_median_s"])
        xs = [modes[n]["ttft_median_s"] for n in names]
        ys = [modes[n]["accuracy"] for n in names]
        line = ax.plot(xs, ys, "o", label=series_label(data, path))[0]
        for name, x, y in zip(names, xs, ys):
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7,
                        color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("median TTFT, s (log scale; left is faster)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Answer accuracy against time to first token")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)
    return out
