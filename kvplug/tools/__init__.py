"""Tools around the core: what the commands that size, demonstrate and probe kvplug run.

The commands themselves are in `kvplug.cli`; the core imports none of these.

| module | owns |
|---|---|
| `demo` | a small seeded chat workload through the core cache (``kvplug demo``) |
| `info` | probing which optional engines and kernel libraries are installed (``kvplug info``) |
| `sweep` | ``kvplug sweep``: the block-size sweep (a package: config, accounting, latency, ...) |
| `tiny_model` | tiny random-weight Hugging Face models for tests and CPU demos |
"""
