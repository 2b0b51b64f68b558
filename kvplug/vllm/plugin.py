"""kvplug's ``vllm.general_plugins`` entry point.

vLLM loads general plugins in every process it starts, whether or not kvplug is enabled,
so this does nothing a user could notice unless kvplug's scheduler is in use:

- it names the folder for kvplug's metric snapshots in ``$KVPLUG_METRICS_DIR`` (inherited
  by the engine-core process) and registers a Prometheus collector that reads it; the
  collector yields nothing until a kvplug scheduler writes a snapshot;
- it registers kvplug's FlashInfer attention backend where a CUDA GPU allows, and
  ``kvplug`` as a policy of vLLM's CPU offload tier (`kvplug.vllm.offload_policy`; only
  used where ``kv_connector_extra_config`` names it);
- it copies a request's OpenAI ``user`` field to its ``kvplug_session`` argument, which
  only kvplug's scheduler reads (`kvplug.vllm.openai_user`);
- it warns, once, if the installed vLLM is not one kvplug is tested with. The error comes
  from `kvplug.vllm.Scheduler` at start-up, only when kvplug is enabled.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kvplug")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from kvplug.vllm.version import vllm_version_problem

    problem = vllm_version_problem()
    if problem is not None:
        logger.warning("%s (kvplug stays off unless --scheduler-cls names it)", problem)
    try:
        from prometheus_client import REGISTRY

        from kvplug.vllm.stats import KVPlugCollector, claim_metrics_dir

        REGISTRY.register(KVPlugCollector(claim_metrics_dir()))
    except Exception as exc:  # metrics are optional; never break vLLM's start-up
        logger.debug("kvplug metrics collector not registered: %s", exc)
    from kvplug.kernels.engine_hooks import vllm_plugin

    try:
        from kvplug.vllm.offload_policy import register as register_offload_policy
    except ImportError:  # a vLLM whose CPU tier takes no pluggable policy
        pass
    else:
        register_offload_policy()

    vllm_plugin()  # kvplug's FlashInfer backend at any page size, where a GPU allows
    try:
        from kvplug.vllm.openai_user import forward_user_field

        forward_user_field()
    except Exception as exc:  # the OpenAI server's classes moved: sessions by argument only
        logger.debug("kvplug: the OpenAI user field is not forwarded: %s", exc)
