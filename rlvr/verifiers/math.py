"""Math answer verification that cannot hang the trainer.

Extraction (ours, before any parsing):
- Only the last ``MAX_COMPLETION_CHARS`` characters of a completion and the first ``MAX_GOLD_CHARS`` of a
  gold answer are looked at, so a 100k-character completion costs no more than a short one.
- ``\\boxed{...}`` (and ``\\fbox``) contents are read with balanced braces. If the completion boxes
  several *different* answers it scores 0: listing candidates is not rewarded. Otherwise the (last)
  boxed answer is the prediction.
- Without a box, the text after the last ``<answer>`` tag, else after the last "answer is" / "answer:",
  else the whole tail is handed to math-verify, which takes the final expression it finds there.

Comparison is Hugging Face ``math-verify`` (sympy underneath): fractions, decimals, percentages,
thousands separators, simple units and LaTeX forms compare by value. Numbers are equal when they agree
after rounding to 6 decimal places (math-verify's ``float_rounding=6``), so 1/3 = 0.333333 but
1/3 != 0.33; 12 != 12.0001. A plain-number gold ("1,000", "-2.5", "3/4") is parsed as an expression;
any other gold is read as LaTeX.

Timeouts: every check runs in a worker *process* (a fresh interpreter, nothing of the trainer inherited). A
check that exceeds ``timeout_s`` has its worker SIGKILLed and replaced; the completion scores 0 (the
model wrote something pathological) and the timeout is counted. A worker that dies otherwise is an
infrastructure failure: that completion scores None (excluded, counted) and the worker is replaced.
Nothing relies on SIGALRM, so this works from any thread and inside an asyncio loop.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 120.0
MAX_COMPLETION_CHARS = 4000
MAX_GOLD_CHARS = 1000
AMBIGUOUS = object()  # several different boxed answers
_PLAIN_NUMBER = re.compile(r"^\s*-?\d[\d,]*(\.\d+)?(\s*/\s*\d+)?\s*$")
_ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*", re.IGNORECASE)


def _boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...} / \\fbox{...}, braces balanced; an unclosed one is ignored."""
    out = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i])
                break
    return out


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} / \\fbox{...} in ``text`` (nested braces kept), or None."""
    boxed = _boxed_contents(text)
    return boxed[-1] if boxed else None


def extract_answer(completion: str) -> object:
    """The answer text to verify, or AMBIGUOUS when several different answers are boxed."""
    tail = completion[-MAX_COMPLETION_CHARS:].replace("\u2212", "-")
    boxed = _boxed_contents(tail)
    if boxed:
        distinct = {re.sub(r"\s+", "", b) for b in boxed}
        return AMBIGUOUS if len(distinct) > 1 else f"\\boxed{{{boxed[-1]}}}"
    tags = _ANSWER_TAG.findall(tail)
    if tags:
        return tags[-1]
    marks = list(_ANSWER_IS.finditer(tail))
    return tail[marks[-1].end() :] if marks else tail


def gold_text(gold: str) -> str:
    gold = str(gold)[:MAX_GOLD_CHARS].strip()
    if _PLAIN_NUMBER.match(gold) or "$" in gold or "\\boxed" in gold:
        return gold
    return f"${gold}$"


@dataclass
class VerifierStats:
    checks: int = 0
    timeouts: int = 0
    worker_failures: int = 0
    restarts: int = 0
    seconds: float = 0.0  # total time spent in checks (worker start-up excluded)


class _Worker:
    """One ``python -m rlvr.verifiers.math_worker`` process, spoken to in JSON lines over its stdin/stdout.

    A plain subprocess (not multiprocessing) so nothing of the caller's ``__main__`` is re-imported.
    """

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
            # one thread each: the trainer owns the cores, workers must not oversubscribe them
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlvr.verifiers.math_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0,
        )
        self._buffer = b""
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the worker has imported math-verify (the check timeout must not pay for that)."""
        if not self.ready:
            reply = self.receive(STARTUP_TIMEOUT_S)
            if reply is None or reply[0] != "ready":
                raise EOFError("math worker did not start")
            self.ready = True

    def send(self, gold: str, answer: str) -> None:
        self.proc.stdin.write((json.dumps([gold, answer]) + "\n").encode())

    def receive(self, timeout_s: float) -> tuple[str, object] | None:
        """The next reply, or None if none arrived within the timeout. Raises EOFError if the worker died."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise EOFError("math worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        status, value = json.loads(line)
        return status, value

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class MathVerifier:
    """A pool of verifier processes; ``score`` may be called from any thread, concurrently."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("MathVerifier needs workers >= 1 and timeout_s > 0")
        self.timeout_s = timeout_s
        self.size = workers
        self.stats = VerifierStats()
        self._idle: deque[_Worker] = deque()
        self._all: list[_Worker] = []
        self._lock = threading.Condition()
        self._started = False
        self._closed = False

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            for _ in range(self.size):
                worker = _Worker()
                self._all.append(worker)
                self._idle.append(worker)
            self._started = True
            atexit.register(self.close)

    def _acquire(self) -> _Worker:
        with self._lock:
            while not self._idle:
                self._lock.wait()
            return self._idle.popleft()

    def _release(self, worker: _Worker, broken: bool) -> None:
        if broken:
            worker.kill()
            replacement = _Worker()
        with self._lock:
            if broken:
                self._all[self._all.index(worker)] = replacement
                worker = replacement
                self.stats.restarts += 1
            self._idle.append(worker)
            self._lock.notify()

    def check(self, gold: str, completion: str) -> float | None:
        """Score one completion against one gold answer (see the module docstring)."""
        answer = extract_answer(completion)
        if answer is AMBIGUOUS:
            return 0.0
        self._start()
        worker = self._acquire()
        broken, started = True, None
        try:
            worker.wait_ready()
            started = time.perf_counter()
            worker.send(gold_text(gold), answer)
            reply = worker.receive(self.timeout_s)
            if reply is None:
                self.stats.timeouts += 1
                return 0.0
            status, value = reply
            broken = False
            return value if status == "ok" else 0.0
        except (EOFError, OSError, BrokenPipeError):
            self.stats.worker_failures += 1
            return None
        finally:
            self.stats.checks += 1
            if started is not None:
                self.stats.seconds += time.perf_counter() - started
            self._release(worker, broken)

    def score(self, golds: list[str], completions: list[str]) -> list[float | None]:
        """Check many pairs, ``workers`` at a time."""
        if len(golds) != len(completions):
            raise ValueError(f"{len(golds)} gold answers for {len(completions)} completions")
        if len(golds) <= 1 or self.size == 1:
            return [self.check(g, c) for g, c in zip(golds, completions)]
        with ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="rlvr-math") as pool:
            return list(pool.map(self.check, golds, completions))

    @property
    def alive_workers(self) -> int:
        with self._lock:
            return sum(w.alive() for w in self._all)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._all, self._idle = self._all, [], deque()
        for worker in workers:
            worker.kill()
