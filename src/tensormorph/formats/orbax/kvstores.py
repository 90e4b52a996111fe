"""tensorstore's own key/value store for an Orbax item folder: local files, an S3 bucket, or any HTTP server.

tensorstore reads the arrays itself, not through our byte store, so a remote folder is handed to its own drivers:
- `s3://bucket/prefix`: its `s3` driver, with the endpoint, region and keys of fsspec's storage options
  (`endpoint_url` or `client_kwargs.endpoint_url`, `client_kwargs.region_name`, `key`/`secret`/`token`, `anon`);
  without keys, tensorstore's default AWS chain (environment, ~/.aws, instance metadata). Keys given as options are
  handed over in a private temporary AWS profile (tensorstore takes keys from a profile or the environment only),
  removed when the store is dropped.
- `http://` and `https://`: its read-only `http` driver under the folder's URL (GET with Range), with the `headers`
  option when given. HTTP has no listing: the URL must name an item folder (where `_METADATA` is).
Other protocols are an UnsupportedError naming these.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ...errors import UnsupportedError
from ...storage import AnyPath, RemotePath

REMOTE_PROTOCOLS = ("s3", "http", "https")
_PRIVATE = 0o600  # the temporary profile holds the keys


def base_spec(folder: AnyPath) -> tuple[dict[str, Any], Any]:
    """The kvstore spec of `folder` (its path ends with "/"), and what must stay alive while the store is used
    (a temporary profile), or None."""
    if not isinstance(folder, RemotePath):
        return {"driver": "file", "path": f"{Path(str(folder))}/"}, None
    protocol = folder.remote.protocol
    url = folder.url.rstrip("/") + "/"
    options: dict[str, Any] = dict(getattr(folder.remote.fs, "storage_options", {}) or {})
    if protocol in ("http", "https"):
        spec: dict[str, Any] = {"driver": "http", "base_url": url}
        headers = options.get("headers") or (options.get("client_kwargs") or {}).get("headers")
        if isinstance(headers, dict) and headers:
            spec["headers"] = [f"{k}: {v}" for k, v in headers.items()]
        return spec, None
    check_protocol(folder)
    return _s3(url, options)


def check_protocol(folder: AnyPath) -> None:
    """UnsupportedError for a URL whose protocol tensorstore cannot read here; nothing is written."""
    if isinstance(folder, RemotePath) and folder.remote.protocol not in (*REMOTE_PROTOCOLS, "s3a"):
        raise UnsupportedError(f"Orbax checkpoints are read through tensorstore, here from local folders, "
                               f"{', '.join(p + '://' for p in REMOTE_PROTOCOLS)} URLs only", file=folder.url)


def _s3(url: str, options: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    client = options.get("client_kwargs") or {}
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": prefix}
    endpoint = options.get("endpoint_url") or client.get("endpoint_url")
    region = client.get("region_name") or options.get("region_name")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if options.get("anon"):
        spec["aws_credentials"] = {"type": "anonymous"}
        return spec, None
    key, secret = options.get("key"), options.get("secret")
    if not (key and secret):
        return spec, None  # tensorstore's default chain
    keep = tempfile.TemporaryDirectory(prefix="tensormorph-aws-")
    lines = ["[tensormorph]", f"aws_access_key_id = {key}", f"aws_secret_access_key = {secret}"]
    if options.get("token"):
        lines.append(f"aws_session_token = {options['token']}")
    credentials, config = os.path.join(keep.name, "credentials"), os.path.join(keep.name, "config")
    for path, text in ((credentials, "\n".join(lines)), (config, f"[profile tensormorph]\nregion = {region or ''}")):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE)
        with os.fdopen(descriptor, "w") as out:
            out.write(text + "\n")
    spec["aws_credentials"] = {"type": "profile", "profile": "tensormorph", "credentials_file": credentials,
                               "config_file": config}
    return spec, keep
