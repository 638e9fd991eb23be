"""What can go wrong, as the caller sees it.

    EncodeClientError
    ├── ServerError            an error answer: HTTP status (gRPC mapped to it), ``type``, ``index``
    ├── ReplicaUnavailable     no answer: connection refused or reset, DNS, a transport timeout
    ├── PrefixKeyError         bad input to the image-aware prefix key (also a ValueError)
    └── MissingExtra           a part used without its optional dependencies (also an ImportError)

``ServerError.retryable`` (503, 504) and ``ReplicaUnavailable`` are what the retry policy retries;
every other 4xx is the caller's to fix and is raised at once.
"""

from __future__ import annotations

__all__ = ["EncodeClientError", "MissingExtra", "PrefixKeyError", "ReplicaUnavailable", "ServerError", "install_hint"]


class EncodeClientError(Exception):
    """Base class of every error this package raises on purpose."""


class ServerError(EncodeClientError):
    """An error answer from a server; ``type`` is the API contract's stable code."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        index: int | None = None,
        *,
        retry_after: float | None = None,
        replica: str | None = None,
    ) -> None:
        where = f" (item {index})" if index is not None else ""
        super().__init__(f"{status} {type}: {message}{where}")
        self.status, self.type, self.message, self.index = status, type, message, index
        self.retry_after = retry_after
        self.replica = replica

    @property
    def retryable(self) -> bool:
        return self.status in (503, 504)


class ReplicaUnavailable(EncodeClientError):
    """A replica did not answer at all (down, unreachable, or the transport timed out)."""

    def __init__(self, replica: str, cause: str) -> None:
        super().__init__(f"{replica} is unavailable: {cause}")
        self.replica = replica


class PrefixKeyError(EncodeClientError, ValueError):
    """The prompt's placeholder runs do not match the images given."""


def install_hint(extra: str) -> str:
    """How to install an extra where the package comes from: a checkout, or the wheel ``make dist``
    builds (the package is on no public index)."""
    return (f"pip install './clients/python[{extra}]' from a checkout of encode-server, or "
            f"pip install \"$(ls dist/encode_client-*.whl)[{extra}]\" after its make dist")


class MissingExtra(EncodeClientError, ImportError):
    """A part of the package used without the extra that installs what it imports (a ``grpc://``
    replica without ``encode-client[grpc]``): said where it is configured, naming the extra,
    instead of a ``ModuleNotFoundError`` from the first call."""

    def __init__(self, what: str, extra: str, missing: str | None) -> None:
        super().__init__(
            f"{what} needs the [{extra}] extra ({missing or 'a dependency'} is not installed): "
            f"{install_hint(extra)}",
            name=missing,
        )
        self.extra = extra
