"""What the fleet replay predicts for the live fleet A/B's chats, and what `cost`'s
frequency term does there.

The live A/B (``kvplug bench serve --workload multi-turn --servers 2``) sends 50 chats of
six turns, 8 at a time, through vllm-router or sglang-router. ``synthetic:served-chats``
is that workload as a trace, and the fleet replay's ``approx-tree`` router is the routers'
own ``cache_aware`` policy, so the replay of one against the other is the simulator's
prediction for the live setting. Each seed is one draw of the chats' lengths and timing;
the table gives, per fleet capacity (blocks in all, split over two engines) and arm, the
median hit ratio over the seeds with its range and the median change against `lru`, in
points, beside the no-eviction ceiling (a capacity no run fills). Arms: `lru` (what stock
vLLM and SGLang evict), and `cost` and `learned` at each `frequency_weight`.

    .venv/bin/python studies/served_chats_fleet.py --seeds 0,1,2,3,4 \
        --capacity-blocks 256,192,160,128 --frequency-weights 1,0.5,0
"""

from __future__ import annotations

import argparse
from statistics import median

from kvplug.core.model_spec import load_model
from kvplug.fleet.runner import run_fleet
from kvplug.replay.loop import Timing
from kvplug.replay.synthetic import synthetic_trace

CEILING = 1_000_000  # blocks: more than every run's distinct blocks
TIMING = Timing(prefill_tps=5000.0)  # a tiny model's prefill on a CPU, roughly


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--capacity-blocks", default="256,192,160,128")
    parser.add_argument("--frequency-weights", default="1,0.5,0")
    parser.add_argument("--policies", default="cost,learned")
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    model = load_model(None)
    capacities = [int(c) for c in args.capacity_blocks.split(",")]
    weights = [float(w) for w in args.frequency_weights.split(",")]
    policies = args.policies.split(",")
    hits: dict[tuple[int, str], list[float]] = {}
    ceiling: list[float] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        trace = synthetic_trace("served-chats", seed=seed)

        def run(arms: list[str], sizes: list[int], config: dict | None = None, trace=trace):
            return run_fleet(
                trace, ["approx-tree"], arms, [args.engines], sizes, model,
                timings=[TIMING], policy_config=config,
            )  # fmt: skip

        ceiling.append(run(["lru"], [CEILING])[0].hit_ratio)
        for row in run(["lru"], capacities):
            hits.setdefault((row.capacity_blocks, "lru"), []).append(row.hit_ratio)
        for weight in weights:
            for row in run(policies, capacities, {"frequency_weight": weight}):
                arm = f"{row.policy} w={weight:g}"
                hits.setdefault((row.capacity_blocks, arm), []).append(row.hit_ratio)
    print(
        f"served-chats, {args.engines} engines behind approx-tree, seeds {args.seeds}; "
        f"no-eviction ceiling {median(ceiling):.4f} [{min(ceiling):.4f}-{max(ceiling):.4f}]"
    )
    print(f"{'fleet blocks':>12} {'arm':<16} {'hit ratio, median [range]':<28} {'vs lru, pt':>10}")
    for capacity in capacities:
        lru = hits[(capacity, "lru")]
        for (size, arm), values in hits.items():
            if size != capacity:
                continue
            change = median(100 * (a - b) for a, b in zip(values, lru, strict=True))
            spread = f"{median(values):.4f} [{min(values):.4f}-{max(values):.4f}]"
            print(f"{capacity:>12} {arm:<16} {spread:<28} {change:>+10.2f}")


if __name__ == "__main__":
    main()
