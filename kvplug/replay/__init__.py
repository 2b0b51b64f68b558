"""Trace replay: kvplug's policies against the engines' own caches on the same requests.

A trace's requests become jobs in *units* (one unit is one trace block, one cache block
holds one unit); every arm gets the same calls in the same order and decides only what
it keeps. The counters are taken at each request's first admission, so every arm's
ratios share one denominator.

| module | owns |
|---|---|
| `trace` | Mooncake and Bailian traces; `count_blocks`, the one tokens-per-block rule |
| `sources` | a trace by name (a file, ``packaged:NAME``, ``synthetic:NAME[:SEED]``), sizes |
| `synthetic` | the seeded synthetic workloads, as Mooncake-style traces |
| `loop` | jobs from a trace, and replaying them through one arm, sequential or realistic |
| `arm_spec` | arm names parsed once into an `ArmSpec` (which cache, which policy) |
| `arms/` | `base` (`CacheArm`, `KVPlugArm`) and the engine arms, one module per engine |
| `runner` | arms x capacities, one `ReplayRow` each, and the offline policies' future |
| `hybrid` | the hybrid replay: capacity in bytes, junction and per-kind hits, `HybridRow` |
| `report` | the table, JSON, CSV and the plot (absolute and relative to the stock arm) |

The commands (``kvplug replay``, ``ab``, ``replay-fleet``, ``replay-hybrid``) are in
`kvplug.cli`.
"""
