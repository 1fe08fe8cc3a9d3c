"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

from bdlora.base.io import atomic_path


def plot_controller(controller_log: Path, modules: list[dict], out: Path) -> None:
    """Left: schedule target b(t) vs retained dense fraction C(t)/D over steps. Right: final d per module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(controller_log).read_text().splitlines() if line]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["budget"] for r in rows], label="target b(t)", lw=2)
    a.plot(steps, [r["retained"] for r in rows], label="retained C(t)/D", lw=2, ls="--")
    a.set_xlabel("optimiser step")
    a.set_ylabel("dense fraction")
    a.set_ylim(-0.03, 1.03)
    a.legend()
    a.set_title("budget schedule vs retained dense compute")
    names = [m["name"].replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for m in modules]
    b.bar(range(len(modules)), [m["d"] for m in modules], color="tab:green")
    b.set_xticks(range(len(modules)), names, rotation=90, fontsize=7)
    b.set_ylabel("final d")
    b.set_ylim(0, 1.05)
    b.set_title("final dense retention per module")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
