"""Real servers for the remote-checkpoint tests and benchmarks, all on 127.0.0.1 and free ports.

- `S3Endpoint`: moto's S3 server in a subprocess, with `make_bucket` and an `upload` of files as they are.
- `CountingProxy`: a reverse proxy in front of any HTTP upstream that counts requests and body bytes at the
  server side and injects faults (latency, error statuses, cut bodies, a lying Content-Length, a redirect loop).
- `HubServer`: static files in a Hugging Face hub layout, `/<repo>/resolve/<revision>/<file>`, honouring Range.

Each is a context manager; a pytest fixture is `with S3Endpoint() as s3: yield s3`. For example::

    with S3Endpoint() as s3, CountingProxy(s3.endpoint) as proxy:
        s3.make_bucket("ckpts")
        s3.upload(folder, "s3://ckpts/run1")
        fs = s3fs.S3FileSystem(**s3_storage_options(proxy.url), skip_instance_cache=True)
        fs.cat_file("ckpts/run1/model.safetensors", 0, 8)
        proxy.bytes_sent, proxy.requests
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route

# moto imports most of itself before it listens; on a loaded 2-core machine that takes several seconds
SERVER_START_TIMEOUT_S = 60.0
# a server that does not stop within this is killed (moto) or abandoned as a daemon thread (uvicorn)
SERVER_STOP_TIMEOUT_S = 10.0
# another process may take the free port between probing and binding it; try a fresh one this many times
START_ATTEMPTS = 3
# the proxy's upstream is local, so anything slower than this is a hung server, not a slow network
UPSTREAM_TIMEOUT_S = 60.0
# concurrent PUTs of `S3Endpoint.upload`; a 1,000-file repo would take long one file at a time
UPLOAD_WORKERS = 8
# the credentials and region moto accepts; the same as tests/test_distributed.py uses
S3_KEY = S3_SECRET = "testing"
S3_REGION = "us-east-1"
# create_user, create_policy, attach_user_policy, create_access_key: the unchecked actions `S3Endpoint(auth=True)` takes
AUTH_SETUP_ACTIONS = 4

ALL_METHODS = ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"]
# connection-level headers (RFC 9110 section 7.6.1) belong to one hop and are not forwarded; `expect` too,
# because the proxy already answered the client's 100-continue and httpx does not speak it upstream
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "expect"})
# S3's error codes for the statuses `fail_next` injects, so boto-based clients classify them as S3 would
S3_ERROR_CODES = {500: "InternalError", 503: "SlowDown", 403: "AccessDenied", 404: "NoSuchKey"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_storage_options(endpoint: str, key: str = S3_KEY, secret: str = S3_SECRET) -> dict[str, Any]:
    """s3fs storage options for moto's server at `endpoint` (or a `CountingProxy` in front of it)."""
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION}}


class S3Endpoint:
    """moto's real S3 server (`python -m moto.server`) in a subprocess on a free loopback port."""

    def __init__(self, auth: bool = False) -> None:
        """`auth=True`: moto checks every request's signature against an IAM user made at start (all actions
        allowed), whose keys `storage_options` carries; any other key or secret is refused with a 403."""
        self.auth = auth
        self.key, self.secret = S3_KEY, S3_SECRET
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._port = 0

    def __enter__(self) -> S3Endpoint:
        for _attempt in range(START_ATTEMPTS):
            self._port = free_port()
            self._log = tempfile.TemporaryFile()
            # moto checks signatures only after this many actions; the IAM set-up below takes exactly that many
            env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(AUTH_SETUP_ACTIONS)} if self.auth else None
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self._port)],
                stdout=subprocess.DEVNULL, stderr=self._log, env=env)
            if self._wait_until_answering():
                if self.auth:
                    self._make_user()
                return self
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")[-2000:]
            self.__exit__(None, None, None)
        raise RuntimeError(f"moto's S3 server did not start in {START_ATTEMPTS} attempts; its last log:\n{log}")

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _wait_until_answering(self) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline and self._process.poll() is None:
            try:
                httpx.get(f"{self.endpoint}/moto-api/", timeout=1.0)  # not an AWS action, so auth does not count it
                return True
            except httpx.TransportError:
                time.sleep(0.1)
        return False

    def _make_user(self) -> None:
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                           aws_secret_access_key=S3_SECRET, region_name=S3_REGION)
        iam.create_user(UserName="tensormorph-tests")
        policy = json.dumps({"Version": "2012-10-17",
                             "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
        arn = iam.create_policy(PolicyName="everything", PolicyDocument=policy)["Policy"]["Arn"]
        iam.attach_user_policy(UserName="tensormorph-tests", PolicyArn=arn)
        access = iam.create_access_key(UserName="tensormorph-tests")["AccessKey"]
        self.key, self.secret = access["AccessKeyId"], access["SecretAccessKey"]

    @property
    def endpoint(self) -> str:
        """The server's base URL, `http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs storage options that reach this server directly."""
        return self.storage_options_via(self.endpoint)

    def storage_options_via(self, url: str) -> dict[str, Any]:
        """s3fs storage options with this server's keys that reach it through `url` (a `CountingProxy`'s)."""
        return s3_storage_options(url, self.key, self.secret)

    def client(self) -> Any:
        """A boto3 S3 client for this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret, region_name=S3_REGION)

    def make_bucket(self, name: str) -> None:
        """Create bucket `name`."""
        self.client().create_bucket(Bucket=name)

    def upload(self, local: str | os.PathLike[str], url: str) -> list[str]:
        """Upload a file to the key of `url` (under it if `url` ends in "/"), or a folder's files (recursively)
        under its prefix, byte for byte with relative names kept: `upload("d", "s3://b/p")` puts `d/x/y.bin`
        at `s3://b/p/x/y.bin`. Returns the keys."""
        if not url.startswith("s3://"):
            raise ValueError(f"upload target must be an s3:// URL, got {url!r}")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        source = Path(local)
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        if source.is_file():
            pairs = [(source, prefix if base and not prefix.endswith("/") else base + source.name)]
        elif source.is_dir():
            pairs = [(f, base + f.relative_to(source).as_posix()) for f in sorted(source.rglob("*")) if f.is_file()]
        else:
            raise FileNotFoundError(f"nothing to upload at {source}")
        client = self.client()
        with ThreadPoolExecutor(UPLOAD_WORKERS) as pool:
            list(pool.map(lambda pair: client.upload_file(str(pair[0]), bucket, pair[1]), pairs))
        return [key for _, key in pairs]


class _BackgroundServer:
    """An ASGI app served by uvicorn on 127.0.0.1 (a free port, chosen by the OS) in a daemon thread."""

    def __init__(self, app: Any, name: str, own_headers: bool = True) -> None:
        # a stream still open at shutdown (a client that stopped reading) must not hang the teardown;
        # own_headers=False leaves Date and Server to the app (a proxy forwards its upstream's)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=int(SERVER_STOP_TIMEOUT_S) // 2,
                                server_header=own_headers, date_header=own_headers)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn ({self._thread.name}) did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(SERVER_STOP_TIMEOUT_S)


@dataclasses.dataclass
class ProxiedRequest:
    """One request as the proxy saw and answered it."""

    method: str
    path: str  # as sent, still percent-encoded
    query: str
    range: str | None  # the request's Range header
    status: int
    bytes_sent: int  # response body bytes written to the client (headers not counted)
    fault: str | None  # "fail", "cut", "lie", "redirect", or None when forwarded untouched


@dataclasses.dataclass
class _Rule:
    kind: str
    remaining: int | None  # None: every match until clear_faults()
    value: int
    path_contains: str | None = None
    method: str | None = None

    def matches(self, method: str, path: str) -> bool:
        return ((self.remaining is None or self.remaining > 0)
                and (self.path_contains is None or self.path_contains in path)
                and (self.method is None or self.method.upper() == method))


class CountingProxy:
    """A reverse proxy in front of `upstream` that counts what it serves and injects faults on demand.

    Every request is forwarded as it came (method, percent-encoded path, query, headers including Host, Range
    and S3's signature headers, streamed body), so a client signs for the proxy's address and the upstream
    checks that signature unchanged. Response bodies are streamed through, never held whole.

    Faults can be set at any time, from any thread; each applies to requests that arrive after it is set:
    `latency_s`, `fail_next`, `cut_next`, `lie_content_length`, `redirect_loop`; `clear_faults()` ends them all.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.latency_s = 0.0
        self.url = ""
        self._lock = threading.Lock()
        self._records: list[ProxiedRequest] = []
        self._rules: list[_Rule] = []
        self._client: httpx.AsyncClient | None = None
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=ALL_METHODS)], lifespan=self._lifespan)
        self._server = _BackgroundServer(app, "counting-proxy", own_headers=False)

    def __enter__(self) -> CountingProxy:
        self.url = self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        # the client lives on the server's event loop, so it is made and closed there
        # no connection limit: the proxy must not throttle a client's own concurrency
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S, follow_redirects=False, limits=limits) as client:
            client.headers.clear()  # forward the client's headers only, not httpx's defaults
            self._client = client
            yield

    @property
    def requests(self) -> list[ProxiedRequest]:
        """Copies of the records of the requests answered since the last `reset()`, in order of answer."""
        with self._lock:
            return [dataclasses.replace(r) for r in self._records]

    @property
    def bytes_sent(self) -> int:
        """Response body bytes written to clients since the last `reset()`."""
        with self._lock:
            return sum(r.bytes_sent for r in self._records)

    def reset(self) -> None:
        """Forget the records (faults stay; see `clear_faults`)."""
        with self._lock:
            self._records.clear()

    def fail_next(self, n: int, status: int = 503, path_contains: str | None = None,
                  method: str | None = None) -> None:
        """Answer the next `n` matching requests with `status` (and an S3-style XML error) without upstream."""
        self._add(_Rule("fail", n, status, path_contains, method))

    def cut_next(self, n: int, after_bytes: int, path_contains: str | None = None) -> None:
        """For the next `n` matching responses with a body: send the headers with the full Content-Length, then
        only `after_bytes` of the body, then drop the connection. HEAD and non-2xx responses do not match."""
        self._add(_Rule("cut", n, after_bytes, path_contains))

    def lie_content_length(self, extra: int, n: int | None = None, path_contains: str | None = None) -> None:
        """Announce Content-Length + `extra` on matching 2xx responses that have a Content-Length (HEAD too).

        extra > 0: the whole real body is sent, then the connection dropped. extra < 0: only the announced bytes
        are sent and the response ends normally, so only a client that checks Content-Range or the object's size
        sees it. `n`: how many responses; None, every one until `clear_faults()`.
        """
        self._add(_Rule("lie", n, extra, path_contains))

    def redirect_loop(self, path_contains: str) -> None:
        """Answer every request whose path contains `path_contains` with a 302 to itself, until `clear_faults()`."""
        self._add(_Rule("redirect", None, 302, path_contains))

    def clear_faults(self) -> None:
        """End every fault mode, latency included."""
        with self._lock:
            self._rules.clear()
        self.latency_s = 0.0

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, kind: str, method: str, path: str) -> _Rule | None:
        """The first live rule of `kind` matching the request, with one use of it spent."""
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and rule.matches(method, path):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    return rule
        return None

    async def _handle(self, request: Request) -> Response:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        method = request.method
        path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        query = request.url.query
        record = ProxiedRequest(method, path, query, request.headers.get("range"), 0, 0, None)
        if self._take("redirect", method, path):
            location = f"{self.url}{path}" + (f"?{query}" if query else "")
            return _Relay(self, record, 302, [(b"location", location.encode()), (b"content-length", b"0")],
                          None, fault="redirect")
        if rule := self._take("fail", method, path):
            code = S3_ERROR_CODES.get(rule.value, "InjectedFault")
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>injected by CountingProxy</Message></Error>").encode()
            headers = [(b"content-type", b"application/xml"), (b"content-length", str(len(body)).encode())]
            return _Relay(self, record, rule.value, headers, _once(body), fault="fail")
        try:
            upstream = await self._forward(request, path, query)
        except httpx.HTTPError as exc:
            body = f"proxy could not reach {self.upstream}: {exc!r}".encode()
            return _Relay(self, record, 502, [(b"content-length", str(len(body)).encode())], _once(body))
        return self._relay_upstream(record, upstream)

    async def _forward(self, request: Request, path: str, query: str) -> httpx.Response:
        assert self._client is not None, "the proxy's lifespan did not run"
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        upstream_request = self._client.build_request(
            request.method, httpx.URL(self.upstream + path + (f"?{query}" if query else "")), headers=headers,
            content=request.stream() if has_body else None)
        return await self._client.send(upstream_request, stream=True)

    def _relay_upstream(self, record: ProxiedRequest, upstream: httpx.Response) -> _Relay:
        method, path = record.method, record.path
        headers = [(k, v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
        length = upstream.headers.get("content-length")
        ok = 200 <= upstream.status_code < 300
        body = None if method == "HEAD" else upstream.aiter_raw()
        if ok and body is not None and (rule := self._take("cut", method, path)):
            return _Relay(self, record, upstream.status_code, headers, body, fault="cut", limit=rule.value,
                          complete=False, upstream=upstream)
        if ok and length is not None and (rule := self._take("lie", method, path)):
            announced = max(0, int(length) + rule.value)
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(announced).encode()))
            return _Relay(self, record, upstream.status_code, headers, body, fault="lie", limit=announced,
                          complete=rule.value < 0 or body is None, upstream=upstream)
        return _Relay(self, record, upstream.status_code, headers, body, upstream=upstream)

    def _started(self, record: ProxiedRequest) -> None:
        with self._lock:
            self._records.append(record)

    def _count(self, record: ProxiedRequest, n: int) -> None:
        with self._lock:
            record.bytes_sent += n


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class _Relay(Response):
    """A response streamed from `body`, at most `limit` bytes of it, and counted in `record` as it is sent.

    The counts are updated before each piece is handed to the client, so a client that has its bytes can
    already read the proxy's counts. `complete=False` returns without ending the body, on which uvicorn
    closes the connection mid-body (and logs that the app did not complete its response).
    """

    def __init__(self, proxy: CountingProxy, record: ProxiedRequest, status: int,
                 headers: list[tuple[bytes, bytes]], body: AsyncIterator[bytes] | None, *, fault: str | None = None,
                 limit: int | None = None, complete: bool = True, upstream: httpx.Response | None = None) -> None:
        self.status_code = status
        self.raw_headers = headers
        self.background = None
        self._proxy, self._record, self._body = proxy, record, body
        self._limit, self._complete, self._upstream = limit, complete, upstream
        record.status, record.fault = status, fault

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            self._proxy._started(self._record)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            sent = 0
            async for piece in self._body or _once(b""):
                if self._limit is not None:
                    piece = piece[: self._limit - sent]
                if piece:
                    self._proxy._count(self._record, len(piece))
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    sent += len(piece)
                if self._limit is not None and sent >= self._limit:
                    break
            if self._complete:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self._upstream is not None:
                await self._upstream.aclose()


class HubServer:
    """Static files in a Hugging Face hub layout: `GET|HEAD /<repo>/resolve/<revision>/<file>`.

    Honours Range (206 with Content-Range; Starlette's FileResponse), sends ETag, Content-Length and the hub's
    X-Repo-Commit, and answers 404 with the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound)
    for anything else: missing files, folders (no listing) and paths that climb out of the repo.
    """

    def __init__(self) -> None:
        self._repos: dict[tuple[str, str], Path] = {}
        self.url = ""
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "HEAD"])])
        self._server = _BackgroundServer(app, "hub-server")

    def __enter__(self) -> HubServer:
        self.url = self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def add(self, repo: str, folder: str | os.PathLike[str], revision: str = "main") -> str:
        """Serve `folder` as `repo` (e.g. "org/model") at `revision`; return the URL of that revision's root."""
        self._repos[(repo, revision)] = Path(folder)
        return f"{self.url}/{repo}/resolve/{revision}"

    def url_for(self, repo: str, file: str, revision: str = "main") -> str:
        """The URL of `file` in `repo` at `revision`."""
        return f"{self.url}/{repo}/resolve/{revision}/{file}"

    @staticmethod
    def commit(repo: str, revision: str) -> str:
        """The X-Repo-Commit this server sends for `repo` at `revision` (40 hex digits, like the hub's)."""
        return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()

    async def _handle(self, request: Request) -> Response:
        repo, sep, rest = request.path_params["path"].partition("/resolve/")
        revision, _, file = rest.partition("/")
        if not sep or not any(r == repo for r, _ in self._repos):
            return _hub_404("RepoNotFound", f"Repository {repo!r} not found")
        root = self._repos.get((repo, revision))
        if root is None:
            return _hub_404("RevisionNotFound", f"Revision {revision!r} not found in {repo!r}")
        parts = file.split("/")
        target = root.joinpath(*parts)
        if any(p in ("", ".", "..") for p in parts) or not target.is_file():
            return _hub_404("EntryNotFound", f"{file!r} not found in {repo!r} at {revision!r}")
        return FileResponse(target, stat_result=target.stat(),
                            headers={"x-repo-commit": self.commit(repo, revision)})


def _hub_404(code: str, message: str) -> Response:
    return PlainTextResponse(message, status_code=404, headers={"x-error-code": code, "x-error-message": message})


def request_log(records: Iterable[ProxiedRequest]) -> list[tuple[str, str | None, int, int]]:
    """(method, Range, status, bytes_sent) per record: a compact form to assert or print request sequences."""
    return [(r.method, r.range, r.status, r.bytes_sent) for r in records]
