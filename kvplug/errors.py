"""Exceptions raised by kvplug.

Every error kvplug raises on bad input derives from `KVPlugError` and says what was
wrong and what is accepted. Operations that raise leave the cache unchanged.
"""


class KVPlugError(Exception):
    """Base class of every kvplug error."""


class ConfigError(KVPlugError, ValueError):
    """A configuration key or value is not accepted."""


class UnknownPolicyError(ConfigError):
    """An eviction policy name is not registered."""


class OutOfBlocksError(KVPlugError):
    """Not enough free or evictable blocks to serve an allocation."""


class UnknownRequestError(KVPlugError, KeyError):
    """A request id that the cache does not hold (never added, or already finished)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(KVPlugError):
    """A request id that the cache already holds."""


class FenceError(KVPlugError):
    """A fence that goes backwards, or that names a step not issued yet."""


class CapacityError(KVPlugError):
    """An append that would go past a request's declared maximum length."""


class UnknownRouterError(ConfigError):
    """A fleet router name is not one of the known routers."""
