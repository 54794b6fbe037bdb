"""What ``rlvr serve`` lets a client do: the API key, and where adapters may be loaded from.

**API key** (``--api-key``, or ``RLVR_API_KEY`` when the flag is absent): every route except ``GET /health``
needs ``Authorization: Bearer KEY`` (compared in constant time), as vLLM's ``--api-key`` does; anything else
is answered 401 before the request body is read.

**Adapter paths** (``--allowed-adapter-roots``, ``--allowed-protocols``): a ``lora_path`` is checked before
anything is opened or fetched. A local path is resolved (``..`` and every symlink, the adapter's own files
included) and must stay inside one of the local roots; a URL must use an allowed protocol, contain no
chaining (``::``), ``..``, query, fragment, user info or percent-escapes, and lie under one of the URL roots
(whole path segments: ``s3://b/run1`` does not admit ``s3://b/run10``). A path outside the roots, a missing one,
one without readable adapter files (a FIFO is never opened) and one whose files are not a LoRA adapter all get the
same 400 ``NOT_ALLOWED``, so a client learns nothing about what exists on the server (the reason goes to its log).

Defaults: no protocol but local files; without roots, a server bound to loopback accepts any local directory
(today's local use: the embedded runtime, tests, one-machine runs), and a server bound to any other address
accepts none until roots are given. What is NOT protected: a client holding the key can load any adapter
under the roots and make the server generate with it; a writer inside a root can swap files between the check
and the load; an allowed http(s) root's server is trusted, redirects included.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL_PROTOCOLS = ("file", "local")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "manifest.json")
NOT_ALLOWED = "adapter path not allowed, or no readable LoRA adapter there (the server's log says which)"
MAX_PATH_CHARS = 4096
_URL_REST = re.compile(r"[A-Za-z0-9._~/:=,+-]+")  # host[:port]/segments: no '@', '%', '?', '#', '\', spaces


class AdapterPathError(ValueError):
    """A ``lora_path`` outside the allowed roots or protocols (the message never says more than that)."""

    def __init__(self) -> None:
        super().__init__(NOT_ALLOWED)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_url(path: str) -> tuple[str | None, str]:
    """(protocol, rest) for ``proto://rest``; (None, path) for a plain path."""
    head, sep, rest = path.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return None, path
    return head.lower(), rest


def _clean_url_rest(rest: str) -> str | None:
    """``host/seg/seg`` without a trailing slash, or None if it has anything but plain segments."""
    rest = rest.rstrip("/")
    if not rest or not _URL_REST.fullmatch(rest):
        return None
    if any(seg in ("", ".", "..") for seg in rest.split("/")):
        return None
    return rest


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class AdapterPolicy:
    """Where adapters may come from. Build with :meth:`parse` (flags) or :meth:`default` (no roots given)."""

    local_roots: tuple[str, ...] = ()  # directories (absolute, as given; resolved again at every check)
    url_roots: tuple[str, ...] = ()  # "proto://host/prefix/" (ends with a slash: whole segments only)
    protocols: frozenset[str] = frozenset()  # remote protocols allowed, besides local files

    @classmethod
    def parse(cls, roots: Iterable[str], protocols: Iterable[str] = ("file",)) -> AdapterPolicy:
        """From the command line's lists; ValueError with a message naming the flag for anything wrong."""
        import fsspec

        known = set(fsspec.available_protocols())
        remote = set()
        for proto in (p.strip().lower() for p in protocols):
            if not proto or proto in LOCAL_PROTOCOLS:
                continue
            if proto not in known:
                raise ValueError(f"--allowed-protocols: unknown protocol {proto!r} (fsspec knows: "
                                 f"{', '.join(sorted(known))})")
            remote.add(proto)
        local, urls = [], []
        for root in (r.strip() for r in roots):
            if not root:
                continue
            proto, rest = _split_url(root)
            if proto is None or proto in LOCAL_PROTOCOLS:
                local.append(os.path.abspath(rest if proto else root))
                continue
            if proto not in remote:
                raise ValueError(f"--allowed-adapter-roots {root}: protocol {proto!r} is not allowed; add it to "
                                 f"--allowed-protocols (e.g. --allowed-protocols file,{proto})")
            if not rest.strip("/"):  # proto:// alone: every URL of that protocol (trusting all of them)
                urls.append(f"{proto}://")
                continue
            clean = _clean_url_rest(rest)
            if clean is None:
                raise ValueError(f"--allowed-adapter-roots {root}: a URL root is proto://host/path with plain path "
                                 "segments (no '..', '@', '%', '?', '#')")
            urls.append(f"{proto}://{clean}/")
        return cls(tuple(local), tuple(urls), frozenset(remote))

    @classmethod
    def default(cls, host: str) -> AdapterPolicy:
        """No roots given: any local directory on a loopback-bound server, nothing on any other address."""
        return cls(local_roots=(os.sep,) if is_loopback(host) else ())

    def describe(self) -> str:
        roots = [*self.local_roots, *self.url_roots]
        protocols = ",".join(["file", *sorted(self.protocols)])
        return f"adapters from {', '.join(roots) if roots else 'nowhere (give --allowed-adapter-roots)'} " \
               f"(protocols {protocols})"

    def resolve(self, lora_path: str) -> str:
        """The path to load from: a resolved local path, or the URL as checked. AdapterPathError otherwise."""
        if not lora_path or len(lora_path) > MAX_PATH_CHARS or any(ord(c) < 32 or c == "\x7f" for c in lora_path):
            raise AdapterPathError()
        if "::" in lora_path:  # fsspec URL chaining (simplecache::s3://..., zip://...::http://...)
            raise AdapterPathError()
        proto, rest = _split_url(lora_path)
        if proto is None or proto in LOCAL_PROTOCOLS:
            return self._resolve_local(rest if proto else lora_path)
        if proto not in self.protocols:
            raise AdapterPathError()
        clean = _clean_url_rest(rest)
        if clean is None:
            raise AdapterPathError()
        url = f"{proto}://{clean}"
        if not any((url + "/").startswith(root) for root in self.url_roots):
            raise AdapterPathError()
        return url

    def _resolve_local(self, path: str) -> str:
        real = os.path.realpath(path)
        roots = [r for r in (os.path.realpath(root) for root in self.local_roots) if _inside(real, r)]
        if not roots:
            raise AdapterPathError()
        for name in ADAPTER_FILES:  # a file linked to somewhere outside the root is refused too
            target = os.path.join(real, name)
            if os.path.lexists(target) and not any(_inside(os.path.realpath(target), r) for r in roots):
                raise AdapterPathError()
        return real


def check_api_key(key: str) -> str:
    """The key, if usable in an HTTP header (visible ASCII, no spaces); ValueError otherwise."""
    if not key or any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("--api-key / RLVR_API_KEY must be non-empty visible ASCII without spaces")
    return key


class BearerAuth:
    """ASGI middleware: every HTTP route but ``/health`` needs ``Authorization: Bearer KEY``; 401 otherwise."""

    OPEN = ("/health",)

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {check_api_key(api_key)}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.OPEN:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        response = JSONResponse(
            {"error": {"message": "missing or invalid API key (send Authorization: Bearer KEY)",
                       "type": "AuthenticationError", "param": None, "code": 401}},
            status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
