"""How far a learned reuse predictor on online features gets on a trace (issue 13's study).

Learning Relaxed Belady (NSDI 2020) trains gradient-boosted trees on features of past
accesses. This script asks the same of a trace, generously: for every access of a block
it records what an online cache could know at that moment, and fits LightGBM on the
whole trace's labels (so the predictor has seen the future's statistics, which no online
policy has), then replays the trace with the fitted predictions as a policy. Whatever it
closes of the lru-to-Belady gap bounds what a learned predictor with these features
could close.

Features of an access to a block, all known when it happens: its depth, how many
requests reached it so far, the last three gaps between them (in requests), how many
blocks of the request follow it, the request's input and output lengths, and how many
leading blocks of the request had been seen before.

Two policies use the predictions:
- `next-use` (LRB's own): the label is log(1 + requests until the next reuse), never
  reused counting as 4x the trace; the leaf whose predicted next use is farthest goes.
- `reuse-odds` (cost's rule with a learned probability): the label is whether the block
  is reused within `--horizon` requests; a released block ranks L + p * value and L rises
  to each victim's rank, as in `kvplug.policies.cost`.

Predictions are cross-fitted: the trace is cut into `--folds` spans of requests and each
span is predicted by a model fitted on the others (`--in-sample` fits and predicts the
whole trace; a large model then memorises each block's future, which is no predictor).

    pip install lightgbm      # not a kvplug dependency; only this study needs it
    python studies/predictor_bound.py ../shared/traces/mooncake_synthetic_trace.jsonl
"""

from __future__ import annotations

import argparse
from bisect import bisect_right
from math import exp

import lightgbm
import numpy as np

from kvplug.core.model_spec import DEFAULT_MODEL, load_model
from kvplug.policies.offline.rate_oracle import ReturningOraclePolicy
from kvplug.replay.arms.base import KVPlugArm
from kvplug.replay.loop import Job, make_jobs, replay
from kvplug.replay.runner import build_arm, replay_clock, requests_reaching
from kvplug.replay.sources import capacities_for, load_trace

FEATURES = ("depth", "count", "gap1", "gap2", "gap3", "from_end", "output", "input", "seen")


def access_table(jobs: list[Job], sequential: bool):
    """Per block key: the indices of the requests reaching it; per access (key, j): its
    features and the index of the next request reaching the key (None if none)."""
    probe = KVPlugArm("probe", ReturningOraclePolicy(), 1)
    requests = requests_reaching(jobs, probe, sequential)
    cache = probe.cache
    root = cache.hasher.root_key(cache.resolve_namespace())
    positions: dict[bytes, list[int]] = {key: [] for key in requests}
    seen_prefix, seen = [0] * len(jobs), set()
    for job in jobs:
        key, leading = root, True
        for position, unit in enumerate(job.prompt[: len(job.prompt) - (not sequential)]):
            key = cache.hasher.block_key(key, (unit,))
            positions[key].append(position)
            leading = leading and key in seen
            seen_prefix[job.index] += leading
            seen.add(key)
    rows, accesses = [], []
    for key, indices in requests.items():
        for j, index in enumerate(indices):
            job, position = jobs[index], positions[key][j]
            gaps = [index - indices[j - d] if j >= d else -1 for d in (1, 2, 3)]
            rows.append(
                [position + 1, j + 1, *gaps, len(job.prompt) - 1 - position]
                + [job.output_length, job.input_length, seen_prefix[index]]
            )
            accesses.append((key, j, indices[j + 1] if j + 1 < len(indices) else None))
    return requests, np.array(rows, dtype=float), accesses


class PredictedPolicy(ReturningOraclePolicy):
    """Ranks a released block by the prediction made at its latest access (module doc)."""

    name = "predicted"

    def __init__(self, predictions, kind: str, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block=tokens_per_block)
        self.predictions, self.kind, self.inflation = predictions, kind, 0.0

    def rank(self, node) -> float:
        indices = self._requests.get(node.key)
        if not indices:  # decode blocks and partial last blocks: no request reaches them
            return float("-inf") if self.kind == "next-use" else self.inflation
        j = max(bisect_right(indices, self.now), 1) - 1
        predicted = self.predictions[node.key][j]
        if self.kind == "next-use":
            return -(indices[j] + predicted)
        return self.inflation + predicted * self.value(node)

    def remove(self, node) -> None:
        ranked = self._rank.get(node.serial)
        super().remove(node)
        if self.kind == "reuse-odds" and ranked is not None and node.serial == self.chosen:
            self.inflation = max(self.inflation, ranked[0])


def fit_predict(x, y, request_of, n_requests: int, objective: str, args) -> np.ndarray:
    folds, rounds = args.folds, args.rounds
    params = {
        "objective": objective,
        "learning_rate": 0.05,
        "num_leaves": args.leaves,
        "min_data_in_leaf": 200,
        "verbose": -1,
        "num_threads": 2,
    }
    if args.in_sample:
        return lightgbm.train(params, lightgbm.Dataset(x, y), num_boost_round=rounds).predict(x)
    predicted = np.zeros(len(y))
    fold = request_of * folds // n_requests
    for k in range(folds):
        test = fold == k
        model = lightgbm.train(params, lightgbm.Dataset(x[~test], y[~test]), num_boost_round=rounds)
        predicted[test] = model.predict(x[test])
    return predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity-fractions", default="0.02,0.05,0.1,0.25")
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--horizon", type=int, default=1500)
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--in-sample", action="store_true")
    parser.add_argument("--leaves", type=int, default=15, help="leaves per tree")
    parser.add_argument("--rounds", type=int, default=100, help="boosting rounds")
    args = parser.parse_args()

    trace = load_trace(args.trace)
    jobs = make_jobs(trace, load_model(DEFAULT_MODEL))
    requests, x, accesses = access_table(jobs, args.sequential)
    request_of = np.array([requests[key][j] for key, j, _ in accesses])
    gap = np.array(
        [
            (nxt - i) if nxt is not None else 4 * len(jobs)
            for (_, _, nxt), i in zip(accesses, request_of, strict=True)
        ],
        dtype=float,
    )
    labels = {
        "next-use": (np.log1p(gap), "regression", lambda p: exp(p) - 1),
        "reuse-odds": ((gap <= args.horizon).astype(float), "binary", float),
    }
    predictions = {}
    for kind, (y, objective, back) in labels.items():
        fitted = fit_predict(x, y, request_of, len(jobs), objective, args)
        if objective == "regression":
            quality = 1 - np.mean((fitted - y) ** 2) / np.var(y)
        else:
            quality = float(np.mean((fitted > 0.5) == (y > 0.5)))
        table = {key: [0.0] * len(indices) for key, indices in requests.items()}
        for (key, j, _), value in zip(accesses, fitted, strict=True):
            table[key][j] = back(value)
        predictions[kind] = table
        metric = "R^2" if objective == "regression" else "accuracy"
        print(f"{kind}: {metric} {quality:.3f} ({'in sample' if args.in_sample else 'cross-fit'})")

    print(
        f"{'capacity':>9} {'lru':>7} {'cost':>7} {'belady':>7} "
        f"{'next-use':>17} {'reuse-odds':>17}   (saved compute %, gap closed)"
    )

    def saved_by(arm) -> float:
        clock = replay_clock(arm)
        c = replay(arm, jobs, trace.block_tokens, sequential=args.sequential, on_admit=clock)
        return c.saved_flops / c.total_flops

    fractions = [float(f) for f in args.capacity_fractions.split(",")]
    for capacity in capacities_for(trace, fractions):
        saved = {
            name: saved_by(build_arm(name, capacity, jobs, args.sequential, trace.block_tokens))
            for name in ("lru", "cost", "belady")
        }
        cells = []
        for kind in labels:
            policy = PredictedPolicy(predictions[kind], kind, trace.block_tokens)
            policy.foresee(requests)
            s = saved_by(KVPlugArm(kind, policy, capacity))
            closed = (s - saved["lru"]) / (saved["belady"] - saved["lru"])
            cells.append(f"{100 * s:7.2f} ({closed:6.1%})")
        print(
            f"{capacity:>9} {100 * saved['lru']:7.2f} {100 * saved['cost']:7.2f} "
            f"{100 * saved['belady']:7.2f} {cells[0]:>17} {cells[1]:>17}"
        )


if __name__ == "__main__":
    main()
