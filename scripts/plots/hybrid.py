"""Draw docs/images/hybrid-mooncake.png from `kvplug replay-hybrid --format json` output.

Usage: python scripts/plots/hybrid.py GEMMA.json NEMOTRON.json OUT.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(paths: list[str], out: str) -> None:
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths, strict=True):
        rows = [r for r in json.loads(Path(path).read_text()) if r["available"]]
        fractions = sorted({r["capacity_fraction"] for r in rows})
        arms = list(dict.fromkeys((r["model"], r["policy"]) for r in rows))
        width = 0.8 / len(arms)
        for i, (model, policy) in enumerate(arms):
            label = f"full attention, {policy}" if "full attention" in model else policy
            values = [
                100
                * next(
                    r["junction_hit_ratio"]
                    for r in rows
                    if (r["model"], r["policy"]) == (model, policy) and r["capacity_fraction"] == f
                )
                for f in fractions
            ]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(fractions))]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(fractions)), [f"{f:.0%}" for f in fractions])
        ax.set_xlabel("capacity (share of distinct blocks, in full-attention bytes)")
        ax.set_ylabel("junction hit ratio (% of prompt tokens)")
        ax.set_title(rows[0]["model"])
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle("Mooncake trace, realistic: hybrid cache vs full-attention equivalent")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
