"""Trace replay: kvplug's policies against the engines' own caches on the same requests.

`trace` reads Mooncake and Bailian traces, `synthetic` makes seeded workloads, `loop`
replays one trace through one arm, `arms` (with `vllm_stock` and `sglang_stock`) are the
caches compared, `runner` runs arms x capacities and `report` prints and plots.
"""
