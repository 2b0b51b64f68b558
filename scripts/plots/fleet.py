"""Draw docs/images/fleet-mooncake.png from `kvplug replay-fleet --format json` output.

Usage: python scripts/plots/fleet.py FLEET.json OUT.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str, out: str) -> None:
    rows = json.loads(Path(path).read_text())
    cells = list(dict.fromkeys((r["engines"], r["capacity_blocks"]) for r in rows))
    arms = list(dict.fromkeys((r["router"], r["policy"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(arms)
    for i, (router, policy) in enumerate(arms):
        values = [
            100
            * next(
                r["saved_compute_ratio"]
                for r in rows
                if (r["router"], r["policy"]) == (router, policy)
                and (r["engines"], r["capacity_blocks"]) == cell
            )
            for cell in cells
        ]
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(cells))]
        hatch = "//" if policy == "lru" else None
        color = {"round-robin": "tab:gray", "least-loaded": "tab:blue", "cache-aware": "tab:orange"}
        ax.bar(
            xs,
            values,
            width,
            label=f"{router} {policy}",
            color=color.get(router),
            hatch=hatch,
            edgecolor="white",
        )
    ax.set_xticks(range(len(cells)), [f"{n} engines, {c:,} blocks" for n, c in cells])
    ax.set_ylabel("fleet prefill compute saved (%)")
    ax.set_title("Mooncake trace, realistic: fleet replay (hatched: lru, solid: cost)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
