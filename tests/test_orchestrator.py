"""The asynchronous orchestrator against a scripted sampler: staleness accounting, re-dispatch, back-pressure,
exactly-once prompts, dynamic sampling and failure propagation, on hand-built schedules."""

import threading
import time

import pytest
import torch

from rlvr.rewards import WeightedReward
from rlvr.rollout import Groups, SamplingParams, StaleVersion
from rlvr.runtime.orchestrator import Orchestrator
from rlvr.tasks import data_order

G = 2


class ScriptedSampler:
    """Answers instantly (or when released), tagged with ``version``; counts concurrent calls."""

    def __init__(self, hold: bool = False, fail_after: int | None = None, stale_calls: tuple[int, ...] = ()):
        self.version, self.hold, self.fail_after, self.stale_calls = 0, hold, fail_after, stale_calls
        self.release = threading.Semaphore(0)
        self.calls, self.running, self.most_running = 0, 0, 0
        self.lock = threading.Lock()

    def sample(self, prompts, group_size, params, seed):
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            version, calls = self.version, self.calls
        try:
            if self.fail_after is not None and calls > self.fail_after:
                raise ConnectionError("all rollout servers are unreachable")
            if calls in self.stale_calls:
                raise StaleVersion("policy-v0 was unloaded while the request was in flight")
            if self.hold:
                self.release.acquire()
            n = group_size
            return Groups(
                prompt_ids=torch.zeros(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                completion_ids=torch.ones(n, 1, dtype=torch.long), completion_mask=torch.ones(n, 1, dtype=torch.long),
                behaviour_logp=torch.zeros(n, 1), truncated=torch.zeros(n, dtype=torch.bool),
                texts=[f"{prompts[0]}|{j}" for j in range(n)], group_size=n,
                version=torch.full((n,), version), temperature=torch.ones(n),
            )
        finally:
            with self.lock:
                self.running -= 1


def spread_reward(prompts, completions, **kw):
    """Rows named 'flat...' score all equal (no signal); others 0 and 1."""
    return [0.0 if p.startswith("flat") else float(c.endswith("|1")) for p, c in zip(prompts, completions)]


ROWS = [{"prompt": f"p{i}"} for i in range(50)]


def _orchestrator(sampler, rows=ROWS, **kw):
    args = {"data_seed": 0, "sample_seed": lambda uid: uid, "max_inflight": 4, "max_staleness": 1, **kw}
    return Orchestrator(sampler, rows, [WeightedReward("spread", spread_reward)], G, SamplingParams(), **args)


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_retired_version_is_sampled_again_not_fatal():
    orch = _orchestrator(ScriptedSampler(stale_calls=(2, 3)), max_inflight=1).start()
    taken = orch.take(3, version=0)
    orch.stop()
    assert [u for g in taken.groups for u in g.uids] == [0, 1, 2]  # uid 1 failed twice as stale, then came through
    # 3 groups + 2 retries; the dispatcher may have sent the next prompt (max_inflight=1) before stop()
    assert orch.stats.redispatched == 2 and orch.stats.dispatched in (5, 6)


def test_groups_come_in_data_order_with_their_uids_and_rows():
    orch = _orchestrator(ScriptedSampler(), max_inflight=1).start()
    taken = orch.take(3, version=0)
    orch.stop()
    assert [u for g in taken.groups for u in g.uids] == [0, 1, 2]
    assert [i for g in taken.groups for i in g.row_ids] == data_order(len(ROWS), 0, 0, 3)
    assert all(g.groups.texts[0].startswith(ROWS[g.row_ids[0]]["prompt"]) for g in taken.groups)
    assert taken.staleness == {0: 3}


def test_in_flight_work_is_bounded():
    sampler = ScriptedSampler(hold=True)
    orch = _orchestrator(sampler, max_inflight=3).start()
    _wait(lambda: sampler.running == 3)
    time.sleep(0.1)
    assert sampler.calls == 3  # no fourth request until the learner takes one
    for _ in range(3):
        sampler.release.release()
    orch.take(1, version=0)
    _wait(lambda: sampler.calls == 4)
    assert sampler.most_running == 3
    for _ in range(10):
        sampler.release.release()
    orch.stop()


def test_stale_groups_are_dropped_and_their_prompts_sampled_again():
    """Schedule: 4 groups sampled at version 0; the learner reaches version 2 (max_staleness 1): all 4 are too
    old, dropped, and their uids dispatched again at version 2 (each accepted group frees a slot for a new uid,
    so the fourth accepted may be uid 4 while one redone uid is still on its way - pending, not lost)."""
    sampler = ScriptedSampler()
    orch = _orchestrator(sampler, max_inflight=4).start()
    _wait(lambda: orch.stats.sampled == 4 and orch._ready.qsize() == 4)
    sampler.version = 2  # the learner published two versions meanwhile
    taken = orch.take(4, version=2)
    orch.stop()
    uids = [u for g in taken.groups for u in g.uids]
    assert taken.dropped_stale == 4 and orch.stats.redispatched == 4
    assert all(g.versions.tolist() == [2] for g in taken.groups) and taken.staleness == {0: 4}
    assert set(uids) <= {0, 1, 2, 3, 4, 5} and len(set(uids)) == 4
    assert {0, 1, 2, 3} <= set(uids) | set(orch.position()[1])


def test_one_version_behind_is_trained():
    sampler = ScriptedSampler()
    orch = _orchestrator(sampler, max_inflight=2).start()
    _wait(lambda: orch.stats.sampled == 2)
    taken = orch.take(2, version=1)
    orch.stop()
    assert taken.dropped_stale == 0 and taken.staleness == {1: 2}


def test_every_prompt_is_trained_once_and_none_is_lost():
    sampler = ScriptedSampler()
    orch = _orchestrator(sampler, max_inflight=4, max_staleness=0).start()
    trained = []
    for version in range(6):
        sampler.version = version
        trained += [u for g in orch.take(3, version=version).groups for u in g.uids]
    cursor, pending = orch.position()  # read together: the dispatcher runs on meanwhile
    orch.stop()
    assert len(trained) == len(set(trained)) == 18  # none twice
    assert sorted(trained + pending) == list(range(cursor))  # none lost: trained, or still pending
    assert orch.stats.dropped_stale > 0  # staleness 0 with 4 in flight forces drops, and they were redone


def test_pending_prompts_of_a_checkpoint_go_first():
    orch = _orchestrator(ScriptedSampler(), max_inflight=1, cursor=10, pending=[7, 3]).start()
    taken = orch.take(3, version=0)
    orch.stop()
    assert [u for g in taken.groups for u in g.uids] == [3, 7, 10]


def test_dynamic_sampling_drops_zero_variance_groups_for_good():
    rows = [{"prompt": "flat" if i % 2 else f"p{i}"} for i in range(40)]
    orch = _orchestrator(ScriptedSampler(), rows=rows, max_inflight=2).start()
    taken = orch.take(4, version=0, dynamic_sampling=True, max_resample_rounds=3)
    orch.stop()
    assert len(taken.groups) == 4 and all(not rows[g.row_ids[0]]["prompt"].startswith("flat") for g in taken.groups)
    assert taken.dropped_zero_variance > 0 and orch.stats.dropped_zero_variance == taken.dropped_zero_variance
    flat = [u for u in range(orch.cursor) if rows[data_order(40, 0, u, 1)[0]]["prompt"] == "flat"]
    still_pending = set(flat) & set(orch.position()[1])  # only those not yet taken (at most the 2 in flight)
    assert len(flat) - len(still_pending) == taken.dropped_zero_variance and len(still_pending) <= 2


def _rows_by_uid(informative_uids: set[int], n: int = 40) -> list[dict]:
    """Rows laid out so that the prompt at stream position u is informative iff u is in ``informative_uids``."""
    rows = [{}] * n
    for uid, row in enumerate(data_order(n, 0, 0, n)):
        rows[row] = {"prompt": f"p{uid}" if uid in informative_uids else "flat"}
    return rows


@pytest.mark.parametrize("informative, B, rounds, trained, dropped", [
    # the tables of tests/test_collect.py, one group at a time: the same groups are trained
    ({0, 4, 5}, 3, 3, [0, 4, 5], 3),  # 3 informative by the 6th group: stop there
    ({1}, 3, 1, [1], 5),  # budget (1 + 1) x 3 = 6 groups spent: the one informative group is trained
    (set(), 3, 1, [0, 1, 2], 3),  # none informative in 6: the first 3, as they are
    (set(), 2, 0, [0, 1], 0),  # no extra round: the first B, as they are
])
def test_dynamic_sampling_keeps_what_the_synchronous_loop_keeps(informative, B, rounds, trained, dropped):
    orch = _orchestrator(ScriptedSampler(), rows=_rows_by_uid(informative), max_inflight=1).start()
    taken = orch.take(B, version=0, dynamic_sampling=True, max_resample_rounds=rounds, timeout_s=30)
    orch.stop()
    assert [u for g in taken.groups for u in g.uids] == trained
    assert taken.dropped_zero_variance == orch.stats.dropped_zero_variance == dropped
    assert orch.stats.trained == len(trained) and taken.staleness == {0: len(trained)}


def test_a_failing_sampler_is_raised_in_the_learner():
    orch = _orchestrator(ScriptedSampler(fail_after=2), max_inflight=1).start()
    orch.take(2, version=0)
    with pytest.raises(ConnectionError, match="unreachable"):
        orch.take(2, version=0, timeout_s=10)
    orch.stop()


def test_the_learners_wait_is_a_deadline_on_progress():
    """take(timeout_s) raises when no group arrives for that long, whatever the number asked for: groups that keep
    coming are waited for even when all of them together take longer than the deadline."""
    sampler = ScriptedSampler(hold=True)
    orch = _orchestrator(sampler, max_inflight=2).start()

    def trickle(n: int) -> None:
        for _ in range(n):
            time.sleep(0.4)
            sampler.release.release()

    feeder = threading.Thread(target=trickle, args=(6,))
    feeder.start()
    taken = orch.take(6, version=0, timeout_s=2.0)  # 6 x 0.4 s > 2 s, but never 2 s without a group
    feeder.join()
    assert len(taken.groups) == 6
    with pytest.raises(TimeoutError, match=r"no scored group for 0.3 s \(0 of 2 taken\)"):
        orch.take(2, version=0, timeout_s=0.3)
    for _ in range(4):
        sampler.release.release()
    orch.stop()


def test_dynamic_sampling_stops_after_its_budget():
    """Every group flat (a weak model): after (1 + max_resample_rounds) x B groups the learner trains the first B
    (advantage 0) instead of draining the data stream, as the synchronous loop trains its first round."""
    rows = [{"prompt": "flat"} for _ in range(40)]
    orch = _orchestrator(ScriptedSampler(), rows=rows, max_inflight=2).start()
    taken = orch.take(4, version=0, dynamic_sampling=True, max_resample_rounds=2, timeout_s=30)
    orch.stop()
    assert taken.dropped_zero_variance == 8 and len(taken.groups) == 4  # 12 sampled, 4 trained
    assert all(g.informative.tolist() == [False] for g in taken.groups)
