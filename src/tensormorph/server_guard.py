"""Who may use the viewer, and how much heavy work it does at once: one ASGI middleware before every route.

- DNS rebinding: a page on evil.example can make its own name resolve to 127.0.0.1 and then read the viewer
  as if it were same-origin. The browser still sends `Host: evil.example`, so every request must name this
  viewer in its Host header: a loopback name (localhost, 127.0.0.1, [::1]), the address the connection
  reached, or the host the viewer was started on (any name when it listens on every interface: the token
  guards it then), as Jupyter's check_host does. The port is not compared: an ssh tunnel
  (-L 9000:localhost:8000) changes it legitimately, and a rebinding page reaches the viewer's own port anyway.
- An Origin header, when present, must be the viewer's own origin: no other site's page may call it.
- The token (set when the viewer listens beyond loopback) guards every route, the page included. The page's
  URL carries it once (?token=...); that answer sets it as an HttpOnly, SameSite=Strict cookie, so that the
  page's scripts and styles load; the page forwards the token on its API calls.
- Heavy routes run at most HEAVY_REQUESTS_AT_ONCE at a time, each until its answer is sent: memory stays
  bounded whatever the number of simultaneous requests.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEAVY_REQUESTS_AT_ONCE = 4  # tiles, statistics, diffs, plans and summaries computed or sent at once
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listening on every interface: any Host name may reach the viewer
TOKEN_HEADER = "x-tensormorph-token"


def parse_host(header: str) -> tuple[str, str] | None:
    """(name, port) of a Host header: the name in lower case, IPv6 without brackets, the port "" when absent;
    None when malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        name, _, port = header.partition(":")
    if not name or (port and not (port.isascii() and port.isdigit())):
        return None
    return name, port


def is_loopback(name: str) -> bool:
    """Whether a host name or address stays on this machine (localhost, 127.0.0.0/8, ::1)."""
    name = name.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_token(given: str | None, token: str) -> bool:
    # bytes: compare_digest refuses non-ASCII str, and a header may hold any character
    return given is not None and secrets.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode())


class Guard:
    """The Host, Origin and token checks, then the bound on heavy requests, around a Starlette app."""

    def __init__(self, app: ASGIApp, *, host: str, token: str | None, heavy: Callable[[str], bool]):
        self.app = app
        self.host = host.strip("[]").lower()
        self.token = token
        self.heavy = heavy
        self._slots = anyio.Semaphore(HEAVY_REQUESTS_AT_ONCE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        header = request.headers.get("host")
        parsed = parse_host(header) if header is not None else None
        refusal = self._refusal(request, header, parsed)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if (self.token is not None and parsed is not None and not scope["path"].startswith("/api/")
                and _same_token(request.query_params.get("token"), self.token)):
            send = self._setting_cookie(send, parsed[1])  # the page: its scripts and styles need no ?token
        if self.heavy(scope["path"]):
            async with self._slots:
                await self.app(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _refusal(self, request: Request, header: str | None, parsed: tuple[str, str] | None) -> Response | None:
        path = request.scope["path"]
        if header is None or parsed is None or not self._known_host(parsed[0], request.scope.get("server")):
            return _refuse(path, 403, f"refused: Host {header!r} does not name this viewer (DNS rebinding guard)")
        origin = request.headers.get("origin")
        if origin is not None and origin.lower() != f"{request.scope['scheme']}://{header}".lower():
            return _refuse(path, 403, f"refused: a request from origin {origin!r}, not this viewer's page")
        if self.token is not None and not any(_same_token(given, self.token) for given in (
                request.query_params.get("token"), request.headers.get(TOKEN_HEADER),
                request.cookies.get(_cookie_name(parsed[1])))):
            return _refuse(path, 401, "missing or wrong token: open the URL the viewer printed (...?token=...)")
        return None

    def _known_host(self, name: str, server: Any) -> bool:
        reached = str(server[0]).strip("[]").lower() if server else None
        return self.host in WILDCARD_HOSTS or name in (self.host, reached) or is_loopback(name)

    def _setting_cookie(self, send: Send, port: str) -> Send:
        cookie = f"{_cookie_name(port)}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode("latin-1")

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)

        return sending


def _cookie_name(port: str) -> str:
    # cookies ignore ports: one name per port keeps two viewers on one machine from overwriting each other's
    return f"tensormorph-token-{port or 80}"


def _refuse(path: str, status: int, message: str) -> Response:
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    return PlainTextResponse(message, status_code=status)
