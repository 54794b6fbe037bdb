"""The adapters every live server of a pool holds, and the exchanges that put them there: a load goes to every
live server, all or nothing (if one server fails to load version v, v is unloaded from the servers that took it
and the error is raised); a server that rejoins the pool is first brought to the pool's adapters."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol, TypeVar

import httpx

from rlvr.rollout.http_client import HttpClient, error_message, read_json
from rlvr.rollout.server_errors import AdapterSyncError, MalformedAnswer

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class PoolServer(Protocol):
    """What adapter sync reads of a pool's server."""

    url: str
    alive: bool


S = TypeVar("S", bound=PoolServer)


def model_ids(r: httpx.Response) -> set[str]:
    """The model ids a /v1/models answer lists (the base model and the adapters loaded), or ``MalformedAnswer``."""
    body = read_json(r)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise MalformedAnswer("/v1/models without a list of models")
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


class AdapterSync:
    """``held``: what every live server holds (lora name -> lora path); ``ever_loaded``: every name loaded, so a
    404 for one of them means it was unloaded since. The pool holds ``lock`` around every change of the adapters
    and while a server rejoins (no change between its sync and its return). Exchanges run on ``parallel``; each
    has ``timeout_s`` seconds."""

    def __init__(self, http: HttpClient, timeout_s: float, parallel: Executor):
        self.http, self.timeout_s, self.parallel = http, timeout_s, parallel
        self.held: dict[str, str] = {}
        self.ever_loaded: set[str] = set()
        self.lock = threading.RLock()

    def _post(self, url: str, body: dict) -> httpx.Response:
        return self.http.request("POST", url, json_body=body, timeout_s=self.timeout_s)

    def bring_up_to_date(self, url: str) -> bool:
        """Bring the server at ``url`` to the held adapters: unload the ones dropped since (a server that was away
        missed those unloads), load the held ones (a restarted server has none); False if it cannot."""
        try:
            r = self.http.request("GET", f"{url}/v1/models", timeout_s=10)
        except (httpx.HTTPError, MalformedAnswer):
            return False
        try:
            on_server = model_ids(r) if r.status_code == 200 else set()
        except MalformedAnswer:
            return False
        try:
            for name in on_server & (self.ever_loaded - set(self.held)):
                self._post(f"{url}{UNLOAD_PATH}", {"lora_name": name})
            for name, path in list(self.held.items()):
                r = self._post(f"{url}{LOAD_PATH}", {"lora_name": name, "lora_path": path, "load_inplace": True})
                if r.status_code != 200:
                    return False
        except (httpx.HTTPError, MalformedAnswer):
            return False
        return True

    def load_everywhere(self, name: str, path: str, servers: Sequence[S], mark_dead: Callable[[S], None]) -> list[S]:
        """Load on each of ``servers`` at once, all or nothing; returns the servers that took it. A server that
        refuses it fails the load: it is unloaded from the others and ``AdapterSyncError`` raised. One that cannot
        be reached goes to ``mark_dead`` (and gets the adapter when it rejoins). On success the adapter is held."""
        self.ever_loaded.add(name)
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}

        def load(server: S) -> str | None:
            try:
                r = self._post(f"{server.url}{LOAD_PATH}", body)
            except (httpx.HTTPError, MalformedAnswer):
                mark_dead(server)
                return None
            if r.status_code in (401, 403):
                return str(self.http.auth_error(server.url, LOAD_PATH, r))
            return None if r.status_code == 200 else f"{server.url}: {r.status_code} {error_message(r)}"

        errors = list(self.parallel.map(load, servers))
        loaded = [s for s, e in zip(servers, errors) if e is None and s.alive]
        failed = [e for e in errors if e]
        if failed:
            for server in loaded:
                self.unload_on(server, name, mark_dead)
            raise AdapterSyncError(f"adapter {name} ({path}) did not load everywhere, so it was unloaded from "
                                   f"the others: {'; '.join(failed)}")
        self.held[name] = path  # servers that rejoin load it before they get work
        return loaded

    def unload_on(self, server: S, name: str, mark_dead: Callable[[S], None]) -> None:
        try:
            self._post(f"{server.url}{UNLOAD_PATH}", {"lora_name": name})
        except (httpx.HTTPError, MalformedAnswer):
            mark_dead(server)

    def unload_everywhere(self, name: str, servers: Sequence[S], mark_dead: Callable[[S], None]) -> None:
        """Drop it from the held adapters and unload it from each of ``servers`` at once (one that cannot be
        reached: ``mark_dead``)."""
        self.held.pop(name, None)
        list(self.parallel.map(lambda s: self.unload_on(s, name, mark_dead), servers))
