"""Every ``kvplug`` command: the group in `main`, one module per command family.

| module | owns |
|---|---|
| `app` | the ``kvplug`` group, lazy registration, ``kvplug info``, the deprecated names |
| `replay` | ``kvplug replay`` (one cache) and ``kvplug ab`` (the A/B replay, the main job) |
| `replay_fleet` | ``kvplug replay-fleet``: the trace across N simulated engines behind a router |
| `replay_hybrid` | ``kvplug replay-hybrid``: hybrid models' caches, stock and kvplug |
| `options` | the options and number parsing the replay commands share |
| `bench` | ``kvplug bench``: core, replay, step, manager, block-pool, sglang-cache, serve |
| `serve` | ``kvplug bench serve --engine vllm|sglang``: the live-server A/B glue |
| `sweep`, `budget`, `demo` | ``kvplug sweep``, ``kvplug budget``, ``kvplug demo`` |

Commands are the only place that parses arguments and prints; what they run lives in the
packages below (`kvplug.replay`, `kvplug.fleet`, `kvplug.bench`, `kvplug.serving`,
`kvplug.tools`).
"""

from kvplug.cli.app import main

__all__ = ["main"]
