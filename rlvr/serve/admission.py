"""How a request of ``rlvr serve`` gets to its engine's thread: the admission queue both engines (generation and
/classify) take their work from.

A request is admitted, or refused at once: 400 (``EngineError``) when it alone is larger than the bound, 503 with
Retry-After (``ServerBusy``) while admitting it would put more than ``max_rows`` rows (completions, texts) in the
hands of the engine, or more than ``max_entries`` answer entries that grow with the prompt rather than the
completions (``prompt_logprobs``: one per prompt token and log-prob asked), 503 once the server is shutting down.
Its rows and entries count until its future is done (answered, failed or cancelled). The engine thread takes what
arrived in arrival order, waiting ``window_s`` after the first so that requests sent together join one batch; a
request whose client went away (its future cancelled) is dropped and counted in ``cancelled``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time

DEFAULT_QUEUED_ROWS = 4096
RETRY_AFTER_S = 1
_CLOSED = object()  # queued by close(): nothing follows it


class EngineError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


class ServerBusy(EngineError):
    """The queue is full: 503 with Retry-After."""

    def __init__(self, message: str):
        super().__init__(message, 503, {"Retry-After": str(RETRY_AFTER_S)})


def settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Complete a future unless its request was cancelled meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class AdmissionQueue:
    """The jobs (each with a ``future``) an engine has accepted and not yet taken, oldest first, and the count of
    rows accepted and not finished (``rows``, at most ``max_rows``). ``unit``: what a row is, ``sent``: what a
    client sends fewer of, as error answers say them."""

    def __init__(self, max_rows: int, unit: str, sent: str, max_entries: int = 0):
        self.max_rows, self.unit, self.sent = max_rows, unit, sent
        self.max_entries = max_entries  # prompt log-prob entries accepted and unfinished, at most (0: none may be)
        self.rows = 0  # accepted and not finished
        self.entries = 0  # prompt log-prob entries of the rows accepted and not finished
        self.cancelled = 0  # jobs dropped because their client went away
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False  # no job is accepted any more
        self._ended = False  # the engine thread has taken everything accepted before close()

    def check_size(self, rows: int, described: str = "") -> None:
        """Refuse (400) a job of more rows than the bound, which no wait would admit; ``described``: its size in
        the client's terms (default: the rows)."""
        if rows > self.max_rows:
            raise EngineError(f"{described or f'{rows} {self.unit}'} is more than this server accepts at once "
                              f"(--max-queued-rows {self.max_rows}): send fewer {self.sent} per request")

    def submit(self, job, rows: int = 0, entries: int = 0) -> concurrent.futures.Future:
        """Queue ``job`` behind every job before it; its ``rows`` and ``entries`` (prompt log-probs its answer will
        hold: the caller refuses with ``EngineError`` one that could never fit) count against the bounds until its
        future is done. EngineError (400) if its rows never fit, ServerBusy (503) while the queue is too full, 503
        once closed."""
        self.check_size(rows)
        with self._lock:
            if self._closed:
                raise EngineError("the server is shutting down", 503)
            if self.rows + rows > self.max_rows:
                raise ServerBusy(f"the server is busy ({self.rows} {self.unit} queued, at most {self.max_rows}); "
                                 "retry later or on another server")
            if entries and self.entries + entries > self.max_entries:
                raise ServerBusy(f"the server is busy ({self.entries} prompt log-prob entries queued, at most "
                                 f"{self.max_entries}); retry later or on another server")
            self.rows += rows
            self.entries += entries
            self._jobs.put(job)  # under the lock: nothing is queued behind close()
        if rows or entries:
            job.future.add_done_callback(lambda _: self._release(rows, entries))
        return job.future

    def _release(self, rows: int, entries: int = 0) -> None:
        with self._lock:
            self.rows -= rows
            self.entries -= entries

    def close(self) -> None:
        """Refuse (503) every job from now on; the engine thread still takes those accepted before."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(_CLOSED)

    def arrivals(self, wait: bool = False, window_s: float = 0.0) -> list:
        """The jobs queued since the last call, oldest first. ``wait``: block until one arrives (an empty list then
        means closed: nothing more will come); ``window_s``: then wait that long for jobs sent together with it."""
        jobs = []
        if wait and not self._ended:
            first = self._jobs.get()
            if first is _CLOSED:
                self._ended = True
                return jobs
            jobs.append(first)
        if window_s and not self._ended:
            time.sleep(window_s)
        while not self._ended:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _CLOSED:
                self._ended = True
            else:
                jobs.append(job)
        return jobs

    def drop_cancelled(self, jobs: list) -> list:
        """``jobs`` whose clients still wait for them; the cancelled ones (the client went away) are counted."""
        live = [job for job in jobs if not job.future.cancelled()]
        self.cancelled += len(jobs) - len(live)
        return live
