"""Requests to object stores and HTTP servers as a production client makes them: retried with backoff when the
failure is passing (throttling, a 5xx, a connection cut mid-body, a timeout), and turned into one-line
CheckpointErrors naming the URL when it is not (missing, access denied)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import AccessDeniedError, CheckpointError, MissingFileError, TruncatedFileError

T = TypeVar("T")

MAX_ATTEMPTS = 5  # a request is tried at most this many times; passing failures rarely last longer
FIRST_BACKOFF_S = 0.05  # the wait before the second try, doubled before each further one, with jitter
MAX_BACKOFF_S = 2.0
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # timeouts, throttling and server errors
# names of aiohttp's exception types for failures of the connection or the body, not of the request itself
# (an invalid URL or a certificate error stays one, however often it is tried)
PASSING_KINDS = ("ServerDisconnected", "ClientPayloadError", "ClientConnectionResetError", "ClientOSError",
                 "ServerTimeout", "ClientConnectorError")
# words botocore and aiohttp put in the messages of passing failures that reach us as plain OSErrors
PASSING_WORDS = ("SlowDown", "Throttl", "ServiceUnavailable", "InternalError", "RequestTimeout",
                 "Connection reset", "Server disconnected", "Response payload is not completed",
                 "ContentLengthError", "IncompleteRead", "timed out")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp's ClientResponseError, fsspec's HTTP errors), if any."""
    value = getattr(exc, "status", None)
    return value if isinstance(value, int) and 100 <= value < 600 else None


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (botocore wraps aiohttp's, fsspec wraps both)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 8:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def _redirects(exc: BaseException) -> bool:
    return any("Redirect" in type(e).__name__ for e in _chain(exc))


def is_passing(exc: BaseException) -> bool:
    """Whether trying the same request again may succeed."""
    if isinstance(exc, (CheckpointError, FileNotFoundError, PermissionError)) or _redirects(exc):
        return False  # a redirect loop stays one
    status = status_of(exc)
    if status is not None:
        return status in RETRIED_STATUS
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(word in text for word in PASSING_WORDS) or any(kind in type(exc).__name__ for kind in PASSING_KINDS)


def as_checkpoint_error(exc: BaseException, url: str, attempts: int = MAX_ATTEMPTS) -> CheckpointError:
    """A one-line CheckpointError naming `url` for a failure that retrying does not mend."""
    if isinstance(exc, CheckpointError):
        return exc
    status = status_of(exc)
    if isinstance(exc, FileNotFoundError) or status in (404, 410):
        return MissingFileError("is missing on the server (404)", file=url)
    if isinstance(exc, PermissionError) or status in (401, 403):
        return AccessDeniedError(f"access denied ({status or 'permission error'}): check the credentials "
                                 "(storage_options, or the environment's AWS_* variables)", file=url)
    if _redirects(exc):
        return CheckpointError("the server redirects in a loop (or too many times)", file=url)
    detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if is_passing(exc):
        return TruncatedFileError(f"the request kept failing after {attempts} tries: {detail}", file=url)
    return CheckpointError(f"cannot be read: {type(exc).__name__}: {detail}", file=url)


def with_retries(call: Callable[[], T], url: str, *, attempts: int = MAX_ATTEMPTS,
                 sleep: Callable[[float], None] = time.sleep, failed: BaseException | None = None) -> T:
    """`call()`, tried again after a passing failure (up to `attempts` tries in all, counting a `failed` first try
    made elsewhere); any other failure, or the last passing one, is raised as a CheckpointError naming `url`."""
    if failed is not None and not is_passing(failed):
        raise as_checkpoint_error(failed, url, attempts) from failed
    for attempt in range(1 if failed is not None else 0, attempts):
        if attempt:
            backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 1))
            sleep(backoff * (0.5 + random.random() / 2))  # jitter: clients that failed together do not retry together
        try:
            return call()
        except Exception as exc:
            if attempt + 1 == attempts or not is_passing(exc):
                raise as_checkpoint_error(exc, url, attempts) from exc
    raise as_checkpoint_error(failed or TimeoutError("no try was made"), url, attempts)
