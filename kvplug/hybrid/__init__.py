"""Hybrid models: one decision across full-attention, sliding-window and Mamba state.

| module | owns |
|---|---|
| `spec` | `HybridSpec`: state groups, their bytes, prefill FLOPs; presets, config.json |
| `junction` | `longest_hits`: the longest prefix every group can serve, and each group's own hit |
| `cache` | `HybridCache`: kvplug's hybrid cache, evicting whole junctions by one policy |
| `policy` | `HybridRecord` (a junction or a speculative window) and `JunctionCostPolicy` |
| `audit` | `check_invariants` of a `HybridCache` |
"""
