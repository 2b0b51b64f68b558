"""kvplug inside vLLM: ``--scheduler-cls kvplug.vllm.Scheduler``.

    python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --scheduler-cls kvplug.vllm.Scheduler \\
        --additional-config '{"kvplug": {"policy": "cost"}}'

or offline, ``LLM(model, scheduler_cls="kvplug.vllm.Scheduler", additional_config=...)``.
Options are kvplug's config keys (`kvplug.config.KVPlugConfig`), from
``additional_config["kvplug"]`` or the file named by ``$KVPLUG_CONFIG``.

Importing this package does not import vLLM; `Scheduler` does, when vLLM calls it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Scheduler"]


def Scheduler(**kwargs: Any) -> Any:  # noqa: N802 - vLLM calls it like a class
    """Build the scheduler vLLM would have built, with kvplug's block pool inside."""
    from kvplug.vllm.scheduler import Scheduler as build

    return build(**kwargs)
