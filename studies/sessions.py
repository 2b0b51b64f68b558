"""What naming sessions is worth: `cost` and `learned` told each request's session, or not.

A client may name a request's session (``kvplug_session``, the OpenAI ``user`` field);
`cost`'s classes then learn the reuse odds of blocks released by requests that named one
apart from the others (`kvplug.core.sessions`). In the synthetic ``mixed`` workload the
chats and agents name theirs and the one-off questions to system prompts do not; in
``conversations`` every request names one (so the bit splits nothing); ``--blend
system-prompts`` adds that workload's one-off questions (no session, their own ids,
answers of lengths like the chats') to the one named. Each seed is
replayed with and without sessions; `lru` and `belady` give the gap
(``gap closed = (arm - lru) / (belady - lru)``), and the table shows each arm's mean over
the seeds and the mean and range of its change with sessions, in points of saved compute.

    .venv/bin/python studies/sessions.py --workload mixed --seeds 0,1,2,3,4 \
        --capacity-fractions 0.05,0.1,0.25
    .venv/bin/python studies/sessions.py --workload conversations --blend system-prompts
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from statistics import mean

from kvplug.core.model_spec import load_model
from kvplug.replay.runner import run_replay
from kvplug.replay.sources import capacities_for
from kvplug.replay.synthetic import synthetic_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--capacity-fractions", default="0.05,0.1,0.25")
    parser.add_argument("--blend", default=None, help="a second workload, naming no session")
    parser.add_argument("--sequential", action="store_true")
    args = parser.parse_args()
    model = load_model(None)
    fractions = [float(f) for f in args.capacity_fractions.split(",")]
    arms = ["cost", "learned"]
    saved: dict[tuple[float, str], list[float]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        trace = synthetic_trace(args.workload, seed=seed)
        if args.blend:
            other = synthetic_trace(args.blend, seed=seed + 1000)
            offset = 1 + max(h for r in trace.requests for h in r.hash_ids)
            trace.requests.extend(
                replace(r, hash_ids=tuple(h + offset for h in r.hash_ids), session="")
                for r in other.requests
            )
            trace.requests.sort(key=lambda r: r.arrival)
        capacities = capacities_for(trace, fractions)
        for told in (False, True):
            rows = run_replay(
                trace,
                ["lru", "belady", *arms],
                capacities,
                model,
                sequential=args.sequential,
                sessions=told,
            )
            for row in rows:
                fraction = fractions[capacities.index(row.capacity_blocks)]
                saved.setdefault((fraction, row.policy), []).append(row.saved_compute_ratio)
    mode = "sequential" if args.sequential else "realistic"
    blend = f" + {args.blend}" if args.blend else ""
    print(f"synthetic {args.workload}{blend}, seeds {args.seeds}, {mode} replay")
    print(f"{'size':>5} {'arm':>17} {'saved':>7} {'gap closed':>10} {'change':>7} {'range':>14}")
    for fraction in fractions:
        lru = mean(saved[(fraction, "lru")][::2])
        belady = mean(saved[(fraction, "belady")][::2])
        print(f"{fraction:>5.0%} {'lru':>17} {lru:>7.2%}")
        print(f"{fraction:>5.0%} {'belady':>17} {belady:>7.2%}")
        for arm in arms:
            plain = saved[(fraction, arm)]
            told = saved[(fraction, f"{arm}+sessions")]
            changes = [100 * (t - p) for t, p in zip(told, plain, strict=True)]
            for label, values in ((arm, plain), (f"{arm}+sessions", told)):
                gap = (mean(values) - lru) / (belady - lru) if belady > lru else float("nan")
                change = f"{mean(changes):>+6.2f}" if label != arm else ""
                spread = f"{min(changes):+.2f}..{max(changes):+.2f}" if label != arm else ""
                print(
                    f"{fraction:>5.0%} {label:>17} {mean(values):>7.2%} {gap:>10.0%} "
                    f"{change:>7} {spread:>14}"
                )
        print()


if __name__ == "__main__":
    main()
