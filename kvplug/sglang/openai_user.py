"""The OpenAI ``user`` field as a session: copied to ``kvplug_session`` for the tree.

SGLang's OpenAI server does not pass a request's ``user`` on to its scheduler, where
kvplug reads a request's session (`kvplug.core.sessions`) from the sampling params'
``custom_params``. `forward_user_field` wraps where the server builds those params for a
chat request (``ChatCompletionRequest.to_sampling_params``) and a completion request
(``OpenAIServingCompletion._build_sampling_params``), so that a request with a ``user``
and no ``kvplug_session`` of its own carries ``{"kvplug_session": user}`` there. SGLang
reads no such key, so a server without kvplug's backend serves the request as before.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from kvplug.core.sessions import with_user_session

PROTOCOL = "sglang.srt.entrypoints.openai.protocol"
COMPLETIONS = "sglang.srt.entrypoints.openai.serving_completions"
# (module, class, method, whether the request is the method's first argument after self)
BUILDERS = (
    (PROTOCOL, "ChatCompletionRequest", "to_sampling_params", False),
    (COMPLETIONS, "OpenAIServingCompletion", "_build_sampling_params", True),
)


def forwarding_user(build: Callable[..., Any], request_argument: bool) -> Callable[..., Any]:
    """`build`, returning SGLang's sampling-params dict, adding the request's ``user`` as
    its session (the request is ``self``, or the first argument)."""

    @functools.wraps(build)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = build(self, *args, **kwargs)
        request = args[0] if request_argument and args else self
        user = getattr(request, "user", None)
        if user is not None and isinstance(params, dict):
            params["custom_params"] = with_user_session(params.get("custom_params"), user)
        return params

    wrapped.kvplug_user_session = True  # type: ignore[attr-defined]
    return wrapped


def forward_user_field() -> list[str]:
    """Wrap each builder (once); the classes wrapped."""
    wrapped = []
    for module_name, class_name, method_name, request_argument in BUILDERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # an SGLang without this API
            continue
        method = cls.__dict__.get(method_name)
        if method is None or getattr(method, "kvplug_user_session", False):
            continue
        setattr(cls, method_name, forwarding_user(method, request_argument))
        wrapped.append(class_name)
    return wrapped
