"""A file's first bytes, its size and its version in one ranged GET, where the client can say all three.

fsspec's `cat_file` keeps only the body of a ranged GET, so learning a file's size costs a HEAD first: two round
trips per file to open a checkpoint of many files. The answer to a ranged GET already carries the size
(`Content-Range: bytes 0-65535/SIZE`) and the version (`ETag`); for HTTP and S3 this module asks through the
clients fsspec itself uses (its aiohttp session, s3fs's botocore calls) and keeps those headers. Other protocols
return None and are asked the two-request way.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import HeaderError

Found = tuple[bytes, dict[str, Any]]  # (the first bytes, an fsspec-style info: size, ETag, type)


def first_read(fs: Any, protocol: str, path: str, length: int, fast: Any = None) -> Found | None | Literal[False]:
    """(first min(size, length) bytes, info) of the file at `path`; None when there is no such file; False when
    this client cannot do it in one request (ask for the info, then the bytes). On S3, through `fast` (obstore) where
    it can: opening a checkpoint then never builds s3fs's client (a fifth of a second of CPU per new client)."""
    from fsspec.asyn import sync  # fsspec is present wherever a remote store is

    if protocol in ("http", "https"):
        return sync(fs.loop, _http, fs, path, length)
    if protocol in ("s3", "s3a"):
        found: Found | None | Literal[False] = fast.first(path, length) if fast is not None else False
        return found if found is not False else sync(fs.loop, _s3, fs, path, length)
    return False


def _size_from(content_range: str | None, body: bytes, url: str) -> int:
    """The total size a `Content-Range: bytes A-B/SIZE` header gives."""
    total = (content_range or "").rpartition("/")[2]
    if not total.isdigit():
        raise HeaderError(f"a ranged answer gave no size (Content-Range {content_range!r})", file=url)
    size = int(total)
    if len(body) > size:
        raise HeaderError(f"the server sent {len(body)} bytes of a {size}-byte object", file=url)
    return size


async def _http(fs: Any, url: str, length: int) -> Found | None | Literal[False]:
    session = await fs.set_session()
    options = dict(fs.kwargs)
    headers = {**options.pop("headers", {}), "Range": f"bytes=0-{length - 1}", "Accept-Encoding": "identity"}
    async with session.get(fs.encode_url(url), headers=headers, **options) as answer:
        if answer.status in (404, 410):
            return None
        if answer.status == 416:  # an empty file has no byte 0
            return False
        if answer.status == 200:  # the server ignores Range: do not read a whole large file here
            return False
        answer.raise_for_status()
        body = await answer.read()
        info = {"name": url, "type": "file", "size": _size_from(answer.headers.get("Content-Range"), body, url)}
        for header in ("ETag", "Last-Modified"):
            if answer.headers.get(header):
                info[header] = answer.headers[header]
    return body, info


async def _s3(fs: Any, path: str, length: int) -> Found | None | Literal[False]:
    bucket, key, version = fs.split_path(path)
    if not key:
        return None
    try:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{length - 1}",
                                   **({"VersionId": version} if version else {}))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if "InvalidRange" in str(exc):  # an empty object has no byte 0
            return False
        raise
    try:
        body = await answer["Body"].read()
    finally:
        answer["Body"].close()
    info = {"name": path, "type": "file", "size": _size_from(answer.get("ContentRange"), body, path),
            "ETag": answer.get("ETag", "")}
    return body, info
