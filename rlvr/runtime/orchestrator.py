"""The orchestrator of asynchronous GRPO: dispatcher threads keep the rollout servers busy, one group per
request, while the learner trains on the groups already scored.

- Prompts are identified by their position in the data stream (``uid``); the dataset row of position u is
  ``data_order(...)[u]``, as in the synchronous loop. A uid is trained at most once; a uid that is dispatched
  is trained, dropped by dynamic sampling (counted; rlvr.run.dynamic_sampling decides, as for the synchronous
  loop), or still pending - never lost.
- Each group is sampled whole by one request and tagged with the policy version the sampler had when the
  request was built; the learner publishes and loads version v+1 on every server before the sampler's version
  becomes v+1, so no group is tagged with a version the servers did not use.
- In-flight work is bounded: a dispatcher takes a slot before sampling and the learner gives it back when it
  takes (or drops) the group, so at most ``max_inflight`` groups are being sampled or waiting.
- Staleness: when the learner at version v takes a group sampled at version u with v - u > max_staleness, the
  group is dropped before training and its uid dispatched again (counted as ``dropped_stale``).
- A sample whose policy version was retired while it was in flight (``StaleVersion``: a server restarted and
  the learner moved past keep_versions meanwhile) is dispatched again at once (counted in ``redispatched``).
- A dispatcher that fails for good (no server reachable) hands the error to the learner, which raises it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlvr.learn.collected import Round
from rlvr.rewards import WeightedReward
from rlvr.rollout import Sampler, SamplingParams, StaleVersion
from rlvr.run.dynamic_sampling import DynamicSampling
from rlvr.run.scoring import EnvironmentSetup, sample_scored
from rlvr.tasks import data_order


@dataclass
class Taken:
    groups: list[Round]  # each one group (B = 1), with its uid; in the order taken
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    idle_s: float = 0.0  # time the learner waited for groups
    staleness: collections.Counter = field(default_factory=collections.Counter)  # versions behind -> groups


@dataclass
class OrchestratorStats:
    dispatched: int = 0  # sampling requests made (re-dispatches included)
    sampled: int = 0  # groups that came back scored
    redispatched: int = 0  # uids dispatched again after a stale drop
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    trained: int = 0


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Orchestrator:
    def __init__(
        self,
        sampler: Sampler,
        rows: list[dict],
        rewards: list[WeightedReward],
        group_size: int,
        params: SamplingParams,
        *,
        data_seed: int,
        sample_seed: Callable[[int], int],
        max_inflight: int,
        max_staleness: int,
        cursor: int = 0,
        pending: list[int] = (),
        env_setup: EnvironmentSetup | None = None,
    ):
        self.sampler, self.rows, self.rewards, self.G, self.params = sampler, rows, rewards, group_size, params
        self.data_seed, self.sample_seed = data_seed, sample_seed
        self.env_setup = env_setup  # multi-turn episodes: one dispatch = one group of G episodes
        self.max_inflight, self.max_staleness = max_inflight, max_staleness
        self.cursor = cursor  # next new position in the data stream
        self.stats = OrchestratorStats()
        self._redo: collections.deque[int] = collections.deque(sorted(pending))  # uids to dispatch first
        self._pending: set[int] = set(pending)  # dispatched or to be, not yet trained or dropped for good
        self._slots = threading.Semaphore(max_inflight)
        self._ready: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._score_lock = threading.Lock()  # reward functions are called one batch at a time
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._dispatch, name=f"rlvr-dispatch-{i}", daemon=True)
                         for i in range(max_inflight)]

    def start(self) -> Orchestrator:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for _ in self._threads:
            self._slots.release()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0))

    def position(self) -> tuple[int, list[int]]:
        """(cursor, pending uids: dispatched, or due to be, and not yet trained), read together: what a checkpoint
        must remember; a prompt dispatched meanwhile is in both or in neither, so none is lost or trained twice."""
        with self._lock:
            return self.cursor, sorted(self._pending)

    def _next_uid(self) -> int:
        with self._lock:
            if self._redo:
                return self._redo.popleft()
            uid, self.cursor = self.cursor, self.cursor + 1
            self._pending.add(uid)
            return uid

    def _dispatch(self) -> None:
        while True:
            self._slots.acquire()
            if self._stop.is_set():
                return
            uid = self._next_uid()
            row_id = data_order(len(self.rows), self.data_seed, uid, 1)[0]
            row = self.rows[row_id]
            with self._lock:
                self.stats.dispatched += 1
            try:
                got = sample_scored(self.sampler, [row], self.G, self.params, self.sample_seed(uid), self.rewards,
                                    self.env_setup, self._score_lock, row_ids=[row_id])
            except StaleVersion:  # its version was retired meanwhile: sample the prompt again, at the current one
                with self._lock:
                    self._redo.append(uid)
                    self.stats.redispatched += 1
                self._slots.release()
                continue
            except Exception as err:  # noqa: BLE001 (handed to the learner, which raises it)
                if not self._stop.is_set():
                    self._ready.put(_Failed(err))
                return
            with self._lock:
                self.stats.sampled += 1
            got.uids = [uid]
            self._ready.put(got)

    def take(self, n: int, version: int, dynamic_sampling: bool = False, max_resample_rounds: int = 0,
             timeout_s: float | None = None) -> Taken:
        """The scored groups to train at ``version``: ``n`` of them (blocks until they are there), or with dynamic
        sampling what ``DynamicSampling`` picks (rlvr.run.dynamic_sampling: each group taken is offered in turn;
        those dropped are dropped for good). Groups staler than max_staleness are not offered: they are dropped
        and their prompts dispatched again. ``timeout_s``: raise ``TimeoutError`` when no group (nor a
        dispatcher's error) arrives for that long - a deadline on progress, so the learner never hangs."""
        taken = Taken([])
        pick: DynamicSampling[Round] = DynamicSampling(n, dynamic_sampling, max_resample_rounds)
        while not pick.done:
            waited = time.perf_counter()
            try:
                item = self._ready.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no scored group for {timeout_s:g} s ({len(pick.kept)} of {n} taken)") from None
            taken.idle_s += time.perf_counter() - waited
            if isinstance(item, _Failed):
                raise item.error
            with self._lock:  # settle the group before its slot frees a dispatcher
                uid, sampled_at = item.uids[0], int(item.versions[0])
                if version - sampled_at > self.max_staleness:
                    self._redo.append(uid)
                    taken.dropped_stale += 1
                    self.stats.dropped_stale += 1
                    self.stats.redispatched += 1
                else:
                    self._pending.discard(uid)  # trained, or dropped for good
                    pick.offer(item, bool(item.informative[0]))
            self._slots.release()
        taken.groups = pick.trained()
        taken.dropped_zero_variance = pick.sampled - len(taken.groups)
        taken.staleness.update(version - int(g.versions[0]) for g in taken.groups)
        with self._lock:
            self.stats.trained += len(taken.groups)
            self.stats.dropped_zero_variance += taken.dropped_zero_variance
        return taken
