"""Fleet replay: one trace routed across N simulated engines, each with its own kvplug cache
and policy, behind a router that knows the engines only through their KV events, or, as
the real routers' own policy does, through what it routed.

| module | owns |
|---|---|
| `view` | the router's view: the key scheme, the lagged event feed, per-engine key sets |
| `router` | the routers (`round-robin`, `least-loaded`, `cache-aware`, `approx-tree`), by name |
| `engine` | a simulated engine: a cache publishing events, its scheduler, its load |
| `loop` | the fleet loop in simulated time, and how stale the router's view was |
| `runner` | routers x policies x engine counts x capacities, one row each |
| `report` | the fleet table, JSON and CSV |
"""
