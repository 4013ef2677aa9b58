"""Outside connections of a sweep (an MLflow server, a Ray cluster), checked with a deadline
before they are used: an address that does not answer is one line naming it, not a hang."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from fedlt.errors import FedltError


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "no answer"
    return getattr(exc, "strerror", None) or str(getattr(exc, "reason", "")) or type(exc).__name__


def reachable(host: str, port: int, timeout: float, what: str) -> None:
    """FedltError unless a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise FedltError(f"{what} at {host}:{port} cannot be reached within {timeout:g} s ({_reason(exc)})") from None


def answers_http(url: str, timeout: float, what: str) -> None:
    """FedltError unless ``url`` answers an HTTP request (any status: a server is there) within
    ``timeout`` seconds — a blackholed address and a server that accepts but never replies alike."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise FedltError(f"{what}: {url!r} has no valid port") from None
    if not parts.hostname:
        raise FedltError(f"{what}: {url!r} names no host")
    address = f"{parts.hostname}:{port}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return  # an HTTP answer, whatever its status: the server is there
    except (OSError, ValueError) as exc:
        reason = _reason(exc.reason if isinstance(exc, urllib.error.URLError) else exc)
        raise FedltError(f"{what} at {address} ({url}): no HTTP answer within {timeout:g} s ({reason})") from None
