"""Tools around the core: the commands that measure, size, demonstrate and probe kvplug.

Each module serves one ``kvplug`` subcommand or the tests; the core imports none of them.

| module | owns |
|---|---|
| `bench` | ``kvplug bench``: speed of the core cache, of the replay and of vLLM's scheduler step |
| `budget` | ``kvplug budget``: the KV budget worksheet for a model on a GPU |
| `demo` | ``kvplug demo``: a small seeded chat workload through the core cache |
| `info` | probing which optional engines and kernel libraries are installed (``kvplug info``) |
| `sweep` | ``kvplug sweep``: the block-size sweep (a package: config, accounting, latency, ...) |
| `tiny_model` | tiny random-weight Hugging Face models for tests and CPU demos |
"""
