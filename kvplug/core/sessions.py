"""Sessions: whether a request says which conversation or user it belongs to.

A client may name a request's session: the OpenAI API's ``user`` field, or a
``kvplug_session`` argument (vLLM: ``vllm_xargs``; SGLang: ``custom_params``), which wins
where both are given. A session's turn tends to be followed by its next, while an
anonymous request is often a one-off, so the `cost` and `learned` policies learn the
reuse odds of the blocks released by requests that named a session apart from the
others (`kvplug.policies.node.CachedNode.request_session`, a bit of the reuse class).
Where no request names one, every block is in the classes it had before sessions were
known, and the policy decides exactly as without this module.

The id itself is not kept: only whether a request named one. An id is a non-empty string
of at most `MAX_SESSION_CHARS` characters, or an integer. Any other value is not served:
the request runs as if it named none, and the adapter logs why and counts it
(``kvplug_sessions_refused``), as the engine's scheduler must not stop on a bad request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvplug.engine_stats import PoolStats
from kvplug.errors import ConfigError

SESSION_ARG = "kvplug_session"  # per request: vLLM's extra_args, SGLang's custom_params
MAX_SESSION_CHARS = 256


def check_session(value: object) -> str:
    """`value` as a session id, or a `ConfigError` naming what is accepted."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(
            f"{SESSION_ARG} must be a string or an integer naming the session, "
            f"got {type(value).__name__} {value!r}"
        )
    text = str(value)
    if not text or len(text) > MAX_SESSION_CHARS:
        raise ConfigError(
            f"{SESSION_ARG} must be 1 to {MAX_SESSION_CHARS} characters, got {len(text)}"
        )
    return text


def names_session(
    asked: object,
    user: object,
    stats: PoolStats,
    request_id: object,
    logger: logging.Logger,
) -> bool:
    """Whether a request names a session: its `asked` ``kvplug_session`` value, else its
    OpenAI `user` (None: not given). A bad value names none, and is logged and counted;
    a request that names one is counted in ``session_requests``."""
    value = user if asked is None else asked
    if value is None:
        return False
    try:
        check_session(value)
    except ConfigError as exc:
        stats.sessions_refused += 1
        logger.warning("kvplug: request %s: session not served (%s)", request_id, exc)
        return False
    stats.session_requests += 1
    return True


def with_user_session(params: Mapping[str, Any] | None, user: object) -> dict[str, Any] | None:
    """A request's engine arguments `params` (vLLM's ``extra_args``, SGLang's
    ``custom_params``) with its OpenAI `user` as its session where it names none of its own
    (`params` itself, unchanged, where there is nothing to add)."""
    if user is None or (params is not None and SESSION_ARG in params):
        return None if params is None else dict(params)
    return {**(params or {}), SESSION_ARG: user}
