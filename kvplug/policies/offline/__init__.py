"""Offline bounds: policies that need every request in advance, so run only in trace
replays (`EvictionPolicy.offline`). The replay hands each its future (`foresee`) and
advances its clock (`now`, the index of the request being admitted).

| module | owns |
|---|---|
| `belady` | ``belady``: evict the leaf whose next use lies farthest in the future |
| `rate_oracle` | ``rate-oracle`` (each prefix's exact count) and ``returning-oracle`` |
"""
