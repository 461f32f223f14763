"""The status page (``GET /status``): static HTML and a small script, shipped as package
data under ``k3dist/serve/status/``, that read ``/metrics`` and ``/status/placement``
from the same server. No libraries and no build step (the boxes may be offline); the
files carry no data, so they are served without the API key, and the script sends the
key (``?key=``, kept in the browser's local storage) with its reads."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).with_name("status")
PLACEMENT_PATH = "/status/placement"
# path -> (body, content type), read once at import
FILES = {
    "/status": ((_DIR / "index.html").read_bytes(), "text/html; charset=utf-8"),
    "/status/app.js": ((_DIR / "app.js").read_bytes(), "text/javascript; charset=utf-8"),
}
