"""A DiLoCo learner: an ordinary run whose update, every diloco.inner_steps steps, takes part in a round.

    every step:          the run's own update (GRPO), on this learner's shard of the rows
    every H steps:       publish delta = theta - theta_start           (rlvr/store/rounds.py: the bucket)
                         wait for the round's decision (all arrived, or round_timeout_s; any learner may decide)
                         theta_start <- outer Nesterov step on the decided deltas   (rlvr/core/outer.py)
                         theta <- theta_start; the next round starts

Every learner applies the same decided deltas in learner order, so they all hold the same weights after a round;
a learner whose delta came late (not in the decision) loads the result like the others and, if the others have
moved further on, the newest shared weights. A learner that joins (or resumes after the others moved on) starts
from the newest shared weights and momentum in the bucket: an attested snapshot (rlvr/store/snapshots.py: a
majority of the round's members vouch for its digests), then the few rounds decided after it replayed, so it reads
a bounded number of objects however long the job has run; without a snapshot, every decided round is replayed from
the job's start. ``diloco.json`` in the run directory records the round and the step it started at, so a resumed
learner knows whether its checkpoint is still in the current round.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import defaultdict

import torch

from rlvr.config.diloco import parse_learner
from rlvr.config.schema import RunConfig
from rlvr.core.outer import bound_norm, delta_norm, finite, nesterov_step, outer_gradient
from rlvr.learn.collected import Collected
from rlvr.learn.learner import Learner
from rlvr.models.policy import resolve_model_dir
from rlvr.platform.faults import fault_point
from rlvr.run.lifecycle import Run, Update
from rlvr.store.bucket import ManifestError
from rlvr.store.rounds import DELTA_TORCH_DTYPES, Decision, RefusedDelta, RoundBucket, UnreadableDelta, state_digest
from rlvr.store.snapshots import attest, snapshot

POLL_S = 0.2
SNAPSHOT_LOOKBACK = 4  # rounds below the newest decided one searched for an attested snapshot
STATE_FILE = "diloco.json"


class DilocoUpdate:
    """``inner`` (the run's update), with a DiLoCo round every diloco.inner_steps steps."""

    def __init__(self, inner: Update, cfg: RunConfig):
        d = cfg.diloco
        self.inner, self.cfg = inner, cfg
        self.needs_reference = inner.needs_reference
        self.learner, self.learners = parse_learner(d.learner)
        self.bucket = RoundBucket(d.bucket, self.learner, self.learners)
        self.dtype = DELTA_TORCH_DTYPES[d.delta_dtype]
        self.round = -1  # the round this learner is in (set when it joins: bind)
        self.round_start_step, self.step = 0, 0
        self.start: dict[str, torch.Tensor] = {}  # the round's start weights (fp32), by parameter name
        self.momentum: dict[str, torch.Tensor] | None = None
        self.run: Run | None = None  # bound once the run is open (bind)
        self.hashed: dict[tuple[int, int], tuple[dict, str]] = {}  # (round, k) -> the delta and digest this learner
        # read when it decided the round: on a versioned store, the pinned bytes (not read twice)
        self.totals = dict.fromkeys(("rounds", "late", "refused", "refused_rounds", "bounded", "snapshots",
                                     "bytes_sent"), 0.0)

    def attach(self, model: torch.nn.Module):
        return self.inner.attach(model)

    def bind(self, run: Run) -> None:
        """The opened run whose weights, directory and first step the rounds read. The learner joins now, before its
        first batch is sampled: a fresh one samples it from the job's current weights, and a round a resumed one's
        checkpoint left open closes first."""
        self.run = run
        self._join(run)

    def __call__(self, learner: Learner, batch: Collected) -> dict[str, float]:
        run = self.run  # joined in bind
        stats = self.inner(learner, batch)
        self.step += 1
        H = self.cfg.diloco.inner_steps  # 0: the weights never meet (the learners share rollouts instead)
        if H and (self.step - self.round_start_step) % H == 0:
            stats.update(self._close_round(run))
        return {**stats, **{f"outer_{k}": v for k, v in self.totals.items()}}

    # ---------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _params(run: Run) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in run.trainable.named_parameters() if p.requires_grad}

    def _load(self, run: Run, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self._params(run).items():
                p.copy_(weights[name])

    def _save_position(self, run: Run) -> None:
        if run.main:
            (run.run_dir / STATE_FILE).write_text(json.dumps({"round": self.round,
                                                              "round_start_step": self.round_start_step}))

    def _saved_position(self, run: Run) -> dict:
        try:
            saved = json.loads((run.run_dir / STATE_FILE).read_text()[:4096])
        except (OSError, ValueError):
            return {}
        ok = isinstance(saved, dict) and all(type(saved.get(k)) is int for k in ("round", "round_start_step"))
        return saved if ok else {}

    def _rejoin(self, run: Run, latest: int, start: dict | None = None, momentum: dict | None = None,
                first: int = 1) -> None:
        """Start round latest + 1 from the weights and momentum after round ``latest`` (``_current``; ``start``: the
        weights after round first - 1, when this learner holds them)."""
        like = {n: p.detach() for n, p in self._params(run).items()}
        known = None if start is None else (first - 1, start, momentum)
        self.start, self.momentum = self._current(latest, like, known)
        self._load(run, self.start)
        self.round, self.round_start_step = latest + 1, self.step
        self._save_position(run)

    def _identity(self, rows: list[dict]) -> dict:
        """What every learner of the job must share (job.json): the model (its config.json's digest, so the same model
        at another path on another machine agrees), its trainable parameters, the task, and what the outer step
        computes with."""
        m, d = self.cfg.model, self.cfg.diloco
        config = resolve_model_dir(m.name) / "config.json"
        model = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else m.name
        identity = {"model": model, "lora": [m.lora, m.lora_r, m.lora_alpha, sorted(m.lora_targets)] if m.lora
                    else False, "task": self.cfg.task.name, "learners": self.learners, "inner_steps": d.inner_steps,
                    "outer_lr": d.outer_lr, "outer_momentum": d.outer_momentum, "delta_dtype": d.delta_dtype,
                    "max_delta_norm": d.max_delta_norm, "max_delta_ratio": d.max_delta_ratio}
        if d.rollouts != "off":
            # what a shared group means: the rows its ids name (their digest: another task config can draw other
            # rows), how it was sampled, and under rollouts=step the data order the learners split
            r, t = self.cfg.rollout, self.cfg.train
            digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
            identity["rollouts"] = [d.rollouts, digest, r.group_size, r.max_new_tokens, r.temperature, list(r.stop),
                                    t.prompts_per_step, t.seed if d.rollouts == "step" else None]
        return identity

    def _check_job(self, latest: int, fresh: bool, recorded: dict, mine: dict) -> None:
        """Stop in one line when the bucket's job is not this learner's: other settings, or (for a fresh learner not
        told diloco.join=true) a job already under way; a joining learner says which job and round it joined."""
        mine = json.loads(json.dumps(mine))  # as JSON reads it back (lists, not tuples)
        keys = {*mine, *recorded} - {"start"}  # the start's digest is the job's, not a setting
        differ = sorted(k for k in keys if json.dumps(mine.get(k)) != json.dumps(recorded.get(k)))
        if differ:
            # job.json is bucket content: each value shown escaped (repr) and cut, so it cannot flood the message
            shown = "; ".join(f"{k if k in mine else repr(k)[:40]}: job {recorded.get(k)!r:.80}, this learner "
                              f"{mine.get(k)!r:.80}" for k in differ[:8])
            raise RefusedDelta(f"diloco: {self.bucket.url} belongs to a job with other settings ({shown}); give this "
                               "learner the job's settings, or use another diloco.bucket for a new job")
        if fresh and latest >= 1:
            if not self.cfg.diloco.join:
                raise RefusedDelta(f"diloco: {self.bucket.url} already holds a job at round {latest}; this learner has "
                                   "no checkpoint of its own in it. Join it with diloco.join=true, continue your own "
                                   "run with resume=auto, or start a new job with another diloco.bucket")
            print(f"rlvr: diloco: learner {self.learner}/{self.learners} joined the job in {self.bucket.url} at round "
                  f"{latest + 1}", flush=True)

    def _join(self, run: Run) -> None:
        """At the first step of this process: where the job is (its last decided round), and whether this learner's
        weights are current. A new job's start is one learner's weights: that learner (the start's claimant) records
        their digest in job.json before publishing them, and every read of them is checked against it."""
        self.step = self.round_start_step = run.start
        saved = self._saved_position(run)
        mine, timeout = self._identity(run.data.task_rows), self.cfg.diloco.round_timeout_s
        if not self.bucket.has_job() and self.bucket.claim_start():  # a new job: its start is this learner's weights
            weights = {n: p.detach().float() for n, p in self._params(run).items()}
            self.bucket.job({**mine, "start": state_digest(weights)})
            self.bucket.publish_state(0, weights, None, {"learner": self.learner, "reason": "start"})
        self._check_job(self.bucket.decided(), not run.start and not saved, self.bucket.job(None, timeout), mine)
        self.bucket.wait_for_state(0, timeout)
        latest = self.bucket.decided()
        if run.start and saved.get("round") == latest + 1 and run.start >= saved["round_start_step"]:
            like = {n: p.detach() for n, p in self._params(run).items()}  # resumed inside the current round
            self.start, self.momentum = self._current(latest, like)
            self.round, self.round_start_step = latest + 1, saved["round_start_step"]
            H = self.cfg.diloco.inner_steps
            if H and self.step - self.round_start_step >= H:  # stopped while its round closed
                self._close_round(run)
        else:
            self._rejoin(run, latest)

    def _expected(self, round_: int) -> set[int]:
        """Whom a round waits for: the learners of the previous round (and this one); every learner when there is
        none. A learner that missed a round is not waited for again; its next delta counts if it comes in time."""
        try:
            previous = self.bucket.decision(round_ - 1) if round_ > 1 else None
        except RefusedDelta:
            previous = None
        if previous is None or not previous.members:
            return set(range(self.learners))
        return {*previous.members, self.learner}

    def _wait_for_decision(self, round_: int, like: dict[str, torch.Tensor]) -> Decision | None:
        """The round's decision; made here if this learner finds the round closable first. None when the run is
        asked to stop (SIGTERM, Ctrl-C) while it waits: the round stays open, to be closed when the run resumes. A
        decision that cannot be read (not JSON, not what rlvr writes, a FIFO or a link) is waited past for
        round_timeout_s, then the round is dropped by every learner alike."""
        d = self.cfg.diloco
        published = time.monotonic()
        expected = self._expected(round_)
        unreadable_since = None
        while True:
            if self.run is not None and self.run.stop_requested:
                return None
            try:
                decision = self.bucket.decision(round_)
            except RefusedDelta as err:
                now = time.monotonic()
                if unreadable_since is None:
                    unreadable_since = now
                    print(f"rlvr: diloco: {err}; waiting diloco.round_timeout_s for a readable one", flush=True)
                if now - unreadable_since >= d.round_timeout_s:
                    self.totals["refused_rounds"] += 1
                    print(f"rlvr: diloco: round {round_}'s decision stayed unreadable; the round is dropped",
                          flush=True)
                    return Decision.dropped(round_)
                time.sleep(POLL_S)
                continue
            if decision is not None:
                return decision
            arrived = self.bucket.arrived(round_)
            timed_out = time.monotonic() - published >= d.round_timeout_s
            if expected <= set(arrived) or timed_out:
                digests = {}
                for k in arrived:
                    try:
                        self.hashed[round_, k] = self.bucket.read_delta(round_, k, like, self.dtype)
                        digests[k] = self.hashed[round_, k][1]
                    except RefusedDelta as err:
                        self._refused(str(err))
                enough = len(digests) >= (d.min_learners if timed_out else 1)
                reason = "timeout" if timed_out else "all"
                members = sorted(digests) if enough else []
                try:
                    self.bucket.decide(Decision(round_, tuple(members), {k: digests[k] for k in members},
                                                self.learner, reason if enough else "too few"))
                except (ManifestError, OSError) as err:  # rounds/ made unwritable (a link): read as unreadable above
                    print(f"rlvr: diloco: could not write round {round_}'s decision: {err}", flush=True)
                    time.sleep(POLL_S)
                continue
            time.sleep(POLL_S)

    def _pinned_delta(self, round_: int, k: int, like: dict[str, torch.Tensor], digest: str,
                      version: str | None = None) -> dict | None:
        """Learner ``k``'s delta of ``round_``: the bytes its decision pins (on a versioned store, the object version
        it names: a delta replaced after its round is still read as decided), or None when every learner drops it.

        Bytes that are the pinned ones but not a delta of this model (names, shapes, dtype, a value not finite) are
        refused by every learner alike (the same bytes, the same verdict). Bytes that cannot be had (missing, torn,
        replaced, linked out of the bucket) may be there for one learner and not for another, so the first learner
        that reads them, or gives up after round_timeout_s, records a verdict (rounds/{round}-{k}.verdict, created
        once) and every learner follows it: no two learners apply different deltas, and a peer's delta costs that
        peer's share, never the run. What stops a learner: a delta that others applied and whose bytes were then
        removed or replaced before this learner read them - it cannot compute the weights the others hold."""
        deadline = time.monotonic() + self.cfg.diloco.round_timeout_s
        while True:
            verdict = self.bucket.verdict(round_, k)
            if verdict is False:
                return None
            try:
                held = self.hashed.pop((round_, k), None)  # only where every learner can read the pinned version:
                # elsewhere a delta withdrawn between two reads must cost the decider what it costs the others
                tensors = held[0] if held is not None and held[1] == digest and version else self.bucket.read_delta(
                    round_, k, like, self.dtype, digest, version)[0]
            except UnreadableDelta as err:
                if time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    continue
                if verdict is None and self.bucket.verdict(round_, k, taken=False) is False:
                    self._refused(f"{err}; dropped from round {round_} by every learner")
                    return None
                raise RefusedDelta(f"diloco: {err}; the other learners applied it, so without those bytes this "
                                   "learner would no longer hold what they hold. Restore that delta in "
                                   f"{self.bucket.url}, or start a new job (another diloco.bucket)") from None
            except RefusedDelta as err:  # the pinned bytes, refused on what they hold: by every learner alike
                self._refused(str(err))
                return None
            if verdict is None and self.bucket.verdict(round_, k, taken=True) is False:
                return None  # another learner gave up on it first
            return tensors

    def _refused(self, message: str) -> None:
        self.totals["refused"] += 1
        print(f"rlvr: diloco: refused {message}", flush=True)

    def _outer_step(self, round_: int, decision: Decision, start: dict, momentum: dict | None,
                    like: dict[str, torch.Tensor]) -> tuple[dict, dict | None, int, int]:
        """(weights, momentum, deltas averaged, deltas bounded) after ``round_`` from ``start``: the decided deltas
        in learner order, each bounded (diloco.max_delta_norm, else max_delta_ratio x |start|), then the Nesterov
        step. A round without deltas, or whose step is not finite, leaves ``start`` as it was (dropped)."""
        d = self.cfg.diloco
        bound = d.max_delta_norm or d.max_delta_ratio * delta_norm(start)  # 0: no bound
        deltas, bounded = [], 0
        for k in decision.members:  # learner order: every learner sums in the same order
            pinned = self._pinned_delta(round_, k, like, decision.digests[k], decision.versions.get(k))
            if pinned is None:  # dropped by every learner: that learner's share of the round, not the round
                continue
            tensors, scaled = bound_norm(pinned, bound)
            deltas.append(tensors)
            bounded += scaled
        self.hashed = {key: held for key, held in self.hashed.items() if key[0] > round_}
        if not deltas:
            return start, momentum, 0, 0
        stepped = nesterov_step(start, outer_gradient(deltas), momentum, d.outer_lr, d.outer_momentum)
        if not all(finite(t) for part in stepped for t in part.values()):  # finite deltas can overflow the sum
            self.totals["refused_rounds"] += 1
            print(f"rlvr: diloco: round {round_}'s outer step is not finite; the round is dropped", flush=True)
            return start, momentum, 0, bounded
        return *stepped, len(deltas), bounded

    def _job_start(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The job's starting weights (global/v0, published once by the learner that claimed the start), checked
        against the digest job.json recorded for them: a replaced start would split the job."""
        digest = self.bucket.job(None).get("start")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise RefusedDelta(f"diloco: {self.bucket.url}/job.json holds no digest of the job's start weights (a job "
                               "begun by an older rlvr, or a job.json rewritten): start a new job with another "
                               "diloco.bucket")
        return self.bucket.read_state(0, like, digest)[0]

    def _current(self, latest: int, like: dict[str, torch.Tensor],
                 known: tuple[int, dict, dict | None] | None = None) -> tuple[dict, dict | None]:
        """The weights and momentum after round ``latest``: from the newest attested snapshot among the last
        SNAPSHOT_LOOKBACK rounds (newer than ``known``'s round: (round, weights, momentum) this learner holds), the
        rounds after it replayed; else replayed from ``known``, or from the job's start."""
        floor = known[0] if known is not None else 0
        for round_ in range(latest, max(floor, latest - SNAPSHOT_LOOKBACK), -1):
            taken = snapshot(self.bucket, round_, like)
            if taken is not None:
                self.totals["snapshots"] += 1
                return self._replay(round_ + 1, latest, *taken, like)
        if known is not None:
            return self._replay(floor + 1, latest, known[1], known[2], like)
        if latest:
            print(f"rlvr: diloco: no attested snapshot of rounds {max(latest - SNAPSHOT_LOOKBACK, 0) + 1}-{latest}; "
                  f"replaying all {latest} decided rounds from the job's start", flush=True)
        return self._replay(1, latest, self._job_start(like), None, like)

    def _replay(self, first: int, last: int, start: dict, momentum: dict | None,
                like: dict[str, torch.Tensor]) -> tuple[dict, dict | None]:
        """The weights and momentum after round ``last`` from those after round first - 1: each decided round's
        outer step computed here, as every learner took it. A published global/ version is never taken on trust:
        one that differs from the replay is reported and ignored."""
        for round_ in range(first, last + 1):
            try:
                decision = self.bucket.decision(round_)
            except RefusedDelta:  # every learner that waited on it dropped the round
                decision = Decision.dropped(round_)
            if decision is None:
                raise RefusedDelta(f"diloco: round {round_} has no decision in {self.bucket.url}/rounds though later "
                                   "rounds do: the bucket was changed; start a new job (another diloco.bucket)")
            start, momentum, _, _ = self._outer_step(round_, decision, start, momentum, like)
        if first <= last and self.bucket.has_state(last):
            try:
                published = self.bucket.read_state(last, like)[0]
            except RefusedDelta:
                published = None
            if published is None or any(not torch.equal(published[n], start[n]) for n in start):
                self.totals["refused"] += 1
                print(f"rlvr: diloco: the shared weights of round {last} in {self.bucket.url}/global are not what "
                      "its decisions give; ignored", flush=True)
        return start, momentum

    def _close_round(self, run: Run) -> dict[str, float]:
        """Publish this round's delta, wait for the decision, take the outer step, start the next round."""
        d, round_ = self.cfg.diloco, self.round
        params = self._params(run)
        like = {n: p.detach() for n, p in params.items()}
        delta = {n: (p.detach().float() - self.start[n]).to(self.dtype) for n, p in params.items()}
        fault_point("diloco_delta", round_)
        try:
            sent = self.bucket.publish_delta(round_, delta, {"steps": d.inner_steps})
        except (ManifestError, OSError) as err:  # its directory made unwritable (a planted link): the round goes on
            print(f"rlvr: diloco: could not publish this learner's delta of round {round_}: {err}", flush=True)
            sent = 0
        t0 = time.monotonic()
        decision = self._wait_for_decision(round_, like)
        waited = time.monotonic() - t0
        if decision is None:  # stopping: the loop checkpoints this step; resumed, the round closes first
            print(f"rlvr: diloco: stopped while waiting for round {round_}'s decision; it closes when the run "
                  "resumes", flush=True)
            return {"outer_wait_s": waited, "outer_round_sent_bytes": float(sent)}
        weights, momentum, averaged, bounded = self._outer_step(round_, decision, self.start, self.momentum, like)
        attest(self.bucket, round_, weights, momentum)  # what a joiner's snapshot of this round is checked against
        if decision.closed_by == self.learner:  # one writer; the others compute the same weights themselves
            try:  # only compared by a joiner's replay, never taken: a refused write costs nothing
                self.bucket.publish_state(round_, weights, momentum, {"members": list(decision.members),
                                                                      "reason": decision.reason})
            except (ManifestError, OSError) as err:
                print(f"rlvr: diloco: could not publish the shared weights of round {round_}: {err}", flush=True)
        self.totals["rounds"] += 1
        self.totals["late"] += self.learner not in decision.members
        self.totals["bounded"] += bounded
        self.totals["bytes_sent"] += sent
        latest = self.bucket.decided()
        late = "" if self.learner in decision.members else "; this learner's delta came late: dropped"
        print(f"rlvr: diloco: round {round_} closed by learner {decision.closed_by} ({decision.reason}) with "
              f"learner(s) {', '.join(map(str, decision.members)) or 'none'} after {waited:.1f} s{late}"
              + (f"; continuing from round {latest}'s weights" if latest > round_ else ""), flush=True)
        if latest > round_:  # the others moved on while this learner was late: replayed from here
            self._rejoin(run, latest, weights, momentum, round_ + 1)
        else:
            self._load(run, weights)
            self.start, self.momentum = weights, momentum
            self.round, self.round_start_step = round_ + 1, self.step
            self._save_position(run)
        if d.reset_optimizer:
            run.optimizer.state = defaultdict(dict)
        return {"outer_learners": float(averaged), "outer_wait_s": waited,
                "outer_delta_norm": delta_norm(delta), "outer_round_sent_bytes": float(sent)}
