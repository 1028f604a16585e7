"""Is a hub reachable? Asked once, in a few seconds, before a hub client is called.

Without a network the hub clients retry for half a minute before they give up (measured offline:
``oscar pull rotationzoo:qwen3-8b`` 31 s, huggingface_hub listing with five retries 1 + 2 + 4 + 8 +
8 s; ``oscar pull modelscope:ORG/NAME`` 33 s, ModelScope's own four), and print a line per retry.
:func:`require_online` answers first: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set means no
(for the Hugging Face hub), else a DNS lookup and a TCP connection to the hub's host, or to the
HTTPS proxy the environment names, each bounded by :data:`PROBE_TIMEOUT_S`. A failure is one
:class:`~oscar_calib.errors.PublishError` line. A hub that answers is left to the client, whose
own errors (no such repository, no access) stay as they are.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from urllib.parse import urlsplit

from ..errors import PublishError

PROBE_TIMEOUT_S = 3.0
HUB_NAMES = {"hf": "the Hugging Face hub", "modelscope": "ModelScope"}
_TRUE = ("1", "true", "yes", "on")


def endpoint(hub: str) -> str:
    """The hub's base URL, as its client would use it (``HF_ENDPOINT``; ``MODELSCOPE_DOMAIN``)."""
    if hub == "hf":
        return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    domain = os.environ.get("MODELSCOPE_DOMAIN") or "www.modelscope.cn"
    return domain if domain.startswith(("http://", "https://")) else f"https://{domain}"


def offline_setting(hub: str) -> str | None:
    """The environment variable that switches the hub off, when one is set."""
    if hub != "hf":
        return None
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def require_online(hub: str, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`PublishError` (one line) unless ``hub`` (``hf`` or ``modelscope``) can be
    reached: see the module docstring. Takes at most about ``2 * timeout`` seconds."""
    name = HUB_NAMES[hub]
    setting = offline_setting(hub)
    if setting:
        raise PublishError(f"{setting}={os.environ[setting]} is set, so {name} is not contacted; unset it to "
                           "download (nothing was fetched)")
    url = urlsplit(endpoint(hub))
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    via = ""
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(url.scheme or "https")
    if proxy:
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port, via = p.hostname or "", p.port or 8080, " through the proxy the environment names"
    problem = _probe(host, port, timeout)
    if problem:
        raise PublishError(f"cannot reach {name} at {host}:{port}{via} ({problem}); no network? "
                           "(nothing was fetched)")


def _probe(host: str, port: int, timeout: float) -> str | None:
    """Why ``host:port`` takes no TCP connection within ``timeout`` s per step, or None."""
    found: list = []

    def lookup():
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            found.append(e)

    t = threading.Thread(target=lookup, daemon=True)     # getaddrinfo has no timeout of its own
    t.start()
    t.join(timeout)
    if not found:
        return f"no answer to the name lookup within {timeout:g} s"
    if isinstance(found[0], OSError):
        return f"name lookup failed: {found[0].strerror or found[0]}"
    last = None
    for family, kind, proto, _, address in found[0]:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout)
                s.connect(address)
                return None
        except OSError as e:
            last = e
    if isinstance(last, socket.timeout):
        return f"no connection within {timeout:g} s"
    return f"connection failed: {getattr(last, 'strerror', None) or last}"
