"""The deployment's API key: read once at start-up, checked on every request but
``/health``, as ``Authorization: Bearer <key>`` (OpenAI clients) or ``x-api-key``
(Anthropic clients), in constant time."""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path


def load_key(key: str | None, key_file: str | None) -> str | None:
    """The key from ``--api-key`` or the first line of ``--api-key-file`` (better for a
    secret: a flag shows in ``ps``); None when neither is given."""
    if key and key_file:
        raise ValueError("give api_key or api_key_file, not both")
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"api_key_file {path} does not exist; write the key to "
                "it (one line) or drop the setting"
            )
        lines = path.read_text().strip().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"api_key_file {path} is empty")
    if key is not None and len(key) < 8:
        raise ValueError("the API key must have at least 8 characters")
    return key


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(host: str, key: str | None, allow_no_key: bool = False) -> None:
    """Refuse to serve a non-loopback address with no API key, unless ``allow_no_key``
    (``allow_no_api_key`` in the deployment, ``--allow-no-api-key``) says so."""
    if key is None and not allow_no_key and not is_loopback(host):
        raise ValueError(
            f"host {host} is reachable from other machines and no API key is set: anyone "
            "who can reach the port could use the model. Write a key to a file (e.g. "
            "`openssl rand -hex 24 > ~/.k3dist-key && chmod 600 ~/.k3dist-key`) and set "
            "api_key_file: ~/.k3dist-key in the deployment YAML (or --api-key-file); or bind "
            "127.0.0.1; or, on a network you trust, set allow_no_api_key: true "
            "(--allow-no-api-key)"
        )


def presented(headers) -> str:
    """The key a request presents (empty if none)."""
    auth = headers.get("Authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (headers.get("x-api-key") or "").strip()


def allowed(headers, key: str | None) -> bool:
    if key is None:
        return True
    return hmac.compare_digest(presented(headers).encode(), key.encode())
