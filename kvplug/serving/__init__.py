"""Server-level A/B: a stock vLLM or SGLang server against a kvplug-enabled one, over HTTP.

`kvplug ab --engine vllm|sglang --model DIR [--repeat N]` starts each server in turn as a
subprocess on 127.0.0.1 with the same model and KV budget, drives the same seeded
workload against it through the OpenAI-compatible ``/v1/completions`` endpoint, and
reports TTFT, throughput, cached tokens and the prefill compute they saved, side by side
(with N runs per arm, interleaved: the median and the min-max).

| module | owns |
|---|---|
| `workload` | the seeded workloads: shared system prompts, multi-turn chats, both mixed |
| `tokens` | counting tokens with the model directory's own tokenizer |
| `engines` | what differs per engine: command line and KV budget, kvplug arm, counters |
| `server` | starting, health-checking and stopping one server process group |
| `client` | sending the workload with bounded concurrency and timing each stream |
| `metrics` | parsing the Prometheus text from ``GET /metrics`` |
| `stats` | percentiles, one arm's summary, repeated runs combined (median, spread) |
| `report` | the side-by-side table, JSON and the bar-chart plot |
| `ab` | the arms and the A/B run |
| `cli` | the ``kvplug ab --engine vllm|sglang`` glue |

Nothing here imports vLLM or SGLang: servers are subprocesses, and aiohttp is imported only when
a workload is sent.
"""
