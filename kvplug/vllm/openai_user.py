"""The OpenAI ``user`` field as a session: copied to ``kvplug_session`` for the scheduler.

vLLM's OpenAI server does not pass a request's ``user`` on to the engine, whose scheduler
is where kvplug reads a request's session (`kvplug.core.sessions`). `forward_user_field`
wraps ``to_sampling_params`` of the chat and completion requests so that a request with a
``user`` and no ``kvplug_session`` of its own carries ``{"kvplug_session": user}`` in its
``SamplingParams.extra_args``. vLLM itself reads no such key, so a server that does not
run kvplug's scheduler serves the request exactly as before.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from kvplug.core.sessions import with_user_session

REQUEST_CLASSES = (
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
)


def forwarding_user(to_sampling_params: Callable[..., Any]) -> Callable[..., Any]:
    """`to_sampling_params`, adding the request's ``user`` as its session."""

    @functools.wraps(to_sampling_params)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = to_sampling_params(self, *args, **kwargs)
        user = getattr(self, "user", None)
        if user is not None:
            params.extra_args = with_user_session(params.extra_args, user)
        return params

    wrapped.kvplug_user_session = True  # type: ignore[attr-defined]
    return wrapped


def forward_user_field() -> list[str]:
    """Wrap each request class's ``to_sampling_params`` (once); the classes wrapped."""
    wrapped = []
    for module_name, class_name in REQUEST_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # a vLLM without this API
            continue
        method = cls.__dict__.get("to_sampling_params")
        if method is None or getattr(method, "kvplug_user_session", False):
            continue
        cls.to_sampling_params = forwarding_user(method)
        wrapped.append(class_name)
    return wrapped
