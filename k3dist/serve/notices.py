"""One log line per kind of request part the server leaves out (not per request).

Agents send what this server cannot run with every request (Codex's ``web_search``,
Anthropic's built-in tools): it is dropped, not refused, and said once in the log.
"""

from __future__ import annotations

import logging
import threading

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def dropped_tool(api: str, kind: str) -> None:
    """Log, once per (API, tool type), that tools of this type are left out."""
    key = (api, kind[:64])
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    logging.warning(
        "%s: tools of type %r are built into the hosted API and cannot run "
        "here; they are left out of the prompt (logged once)",
        api,
        key[1],
    )
