"""Learners that share scored groups through their bucket (diloco.rollouts), as well as or instead of weights.

    every step:  own      = this learner's groups of the step, sampled and scored here (collect.py)
                 publish    own's informative groups                         (rlvr/store/shared_groups.py)
                 external = the peers' groups: rollouts=step waits for every peer's groups of this step;
                            rollouts=recent never waits: of each peer's steps it has not taken yet, those already
                            there among the peer's newest rollout_max_age, sampled by weights at most
                            rollout_max_rounds rounds older than its own (learners of unequal speed each count
                            their own steps; ``taken``, saved in checkpoints, keeps a group from being trained twice)
                 each external group is rebuilt from this learner's own copy of its row and re-scored by its
                 own reward functions (the peer's rewards are only compared: ``reward_mismatch``)
                 batch    = the informative groups of both, advantages computed here (collect.scored_batch);
                            the update weighs every token by min(pi_theta / mu, algo.is_cap), mu the policy
                            that sampled it (its log-probs travel with the group)

Under rollouts=step the K learners draw each round's K x B rows together and sample their contiguous shares
(collect.round_share, per-completion seeds), and every learner trains the union in learner order: from the same
weights that is the step of one learner at K x B prompts, so the learners stay on the same weights without
exchanging any. Zero-variance groups are never shared, and a sharing learner trains only informative groups (its
own zero-variance fallback only when no learner has any), so that every learner trains the same batch.
docs/concepts/shared_rollouts.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from rlvr.config.diloco import parse_learner
from rlvr.config.schema import RunConfig
from rlvr.core import informative_groups
from rlvr.core.off_policy import floored_behaviour_logp
from rlvr.learn.batch import StepBatch
from rlvr.learn.collected import Collected, Round
from rlvr.learn.step import frozen_logprobs
from rlvr.models.prompts import encode_prompts
from rlvr.rollout import Groups, Sampler
from rlvr.rollout.groups import eos_token_ids, stop_string_checker
from rlvr.run.collect import SyncSource, round_share, scored_batch
from rlvr.run.lifecycle import Run
from rlvr.run.scoring import score_groups
from rlvr.store.bucket import ManifestError
from rlvr.store.shared_groups import GroupBucket, GroupLimits, NotPublished, RefusedGroups, SharedGroups

POLL_S = 0.2
TAKEN = "shared_taken"  # run.state: peer -> the newest of its steps this learner has looked at (rollouts=recent)
KEEP_VERSIONS = 64  # steps of its own groups a learner keeps in the bucket (a resumed peer may still read them)


class Receiver:
    """What a learner makes of a peer's groups: each rebuilt as its own would be, from its own copy of the rows
    (``rows``: every training row of the task), its tokenizer and its reward functions. ``own_logp`` (under
    algo.ratio_to=behaviour, where the ratio pi_theta / mu is the correction and no importance weight caps it): the
    learner's own log-probs of a Groups' tokens [n, T]; a peer's mu is then floored at own - log(is_cap), so a
    peer's token starts the step at a ratio of at most is_cap, whatever log-probs it claims."""

    def __init__(self, rows: list[dict], tokenizer, rewards: list, limits: GroupLimits, eos_ids: list[int],
                 stop: tuple[str, ...], temperature: float,
                 own_logp: Callable[[Groups], torch.Tensor] | None = None, is_cap: float = 2.0):
        self.rows, self.tokenizer, self.rewards, self.limits = rows, tokenizer, rewards, limits
        self.eos, self.stopped, self.temperature = set(eos_ids), stop_string_checker(tokenizer, stop), temperature
        self.own_logp, self.is_cap = own_logp, is_cap

    def rebuilt(self, shared: SharedGroups) -> tuple[Round, torch.Tensor, int]:
        """The peer's groups as a Round of this learner's: prompts from its rows, texts decoded and truncation
        found by its tokenizer, rewards from its reward functions (the peer's are only compared); which groups
        are informative on those rewards [B]; and how many completions the peer claimed another reward for."""
        tokenizer, G = self.tokenizer, self.limits.group_size
        rows = [self.rows[i] for i in shared.row_ids.tolist()]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [r["prompt"] for r in rows])
        mask = shared.mask
        tokens = [ids[m].tolist() for ids, m in zip(shared.completion_ids.long(), mask)]
        finished = [t[-1] in self.eos or (self.stopped is not None and self.stopped(t)) for t in tokens]
        n = len(tokens)
        groups = Groups(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=shared.completion_ids.long(),
            completion_mask=mask.long(), behaviour_logp=shared.behaviour_logp,
            truncated=~torch.tensor(finished, dtype=torch.bool, device="cpu"),
            texts=tokenizer.batch_decode(tokens, skip_special_tokens=True), group_size=G,
            version=torch.full((n,), shared.version, dtype=torch.long, device="cpu"),
            temperature=torch.full((n,), float(self.temperature), device="cpu"))
        if self.own_logp is not None:  # [n, T]: mu no lower than this learner's own policy allows at the cap
            floored = floored_behaviour_logp(groups.behaviour_logp, self.own_logp(groups).float(), self.is_cap)
            groups = replace(groups, behaviour_logp=floored.masked_fill(~mask, 0.0))
        scores = score_groups(self.rewards, groups, rows)
        claimed, ours = shared.rewards, scores.total.float()
        same = (claimed == ours) | (torch.isnan(claimed) & torch.isnan(ours))
        return Round(shared.row_ids.tolist(), groups, scores), informative_groups(scores.total, G), int((~same).sum())


class SharingSource:
    """``inner`` (the synchronous source), with this step's groups shared and the peers' trained on."""

    metrics_section = "shared"

    def __init__(self, inner: SyncSource, cfg: RunConfig, round_of: Callable[[], int] = lambda: 0):
        d = cfg.diloco
        self.round_of = round_of  # the DiLoCo round this learner's weights are in (0: no weight rounds)
        self.inner, self.cfg, self.mode = inner, cfg, d.rollouts
        self.label = inner.label
        self.learner, self.learners = parse_learner(d.learner)
        self.bucket = GroupBucket(d.bucket, self.learner, self.learners)
        if self.mode == "step":
            inner.share = (self.learner, self.learners)
        self.waiting = set(range(self.learners)) - {self.learner}  # the peers a step waits for (rollouts=step)
        self.strikes = dict.fromkeys(self.waiting, 0)  # steps each peer missed or was refused (rollouts=step)
        self.on_time = dict.fromkeys(self.waiting, 0)  # its steps on time and valid since its last strike
        self.taken: dict[int, int] = {}  # peer -> the newest of its steps considered (rollouts=recent; checkpointed)
        self.totals = dict.fromkeys(("published_groups", "external_groups", "refused", "reward_mismatch",
                                     "rescored_flat", "missed", "stale", "bytes_sent", "bytes_received"), 0.0)
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ the source
    def open(self, run: Run, stack: contextlib.ExitStack) -> Sampler:
        sampler = self.inner.open(run, stack)
        cfg = self.cfg
        rows = run.data.task_rows  # every training row: a peer's row ids index these
        limits = GroupLimits(max_groups=cfg.train.prompts_per_step * self.inner.rounds_reserved(),
                             group_size=cfg.rollout.group_size, max_tokens=cfg.rollout.max_new_tokens,
                             vocab=run.model.get_input_embeddings().weight.shape[0], rows=len(rows))
        own = policy_logprobs(run.model, cfg.train.logprob_chunk) if cfg.algo.ratio_to == "behaviour" else None
        saved = run.state.get(TAKEN, {})  # a resumed learner: the peers' steps its checkpointed weights have seen
        self.taken = {int(k): s for k, s in saved.items() if k.isdigit() and int(k) < self.learners}
        self.receiver = Receiver(rows, run.data.tokenizer, run.rewards, limits, eos_token_ids(run.model,
                                 run.data.tokenizer), tuple(cfg.rollout.stop), cfg.rollout.temperature, own,
                                 cfg.algo.is_cap)
        return sampler

    def next(self, run: Run, step: int) -> Collected:
        cursor = run.state["cursor"]  # where this step's rows start in the data stream (rollouts=step)
        own = self.inner.next(run, step)
        G = own.groups.group_size
        mine = informative_groups(own.scores.total, G)  # [b]
        with ThreadPoolExecutor(max_workers=self.learners) as pool:  # its publishing and the peers' reads overlap:
            sending = pool.submit(self._publish, own, mine, step)  # a far store's round trips once, not per peer
            t0 = time.monotonic()
            external = self._gather(run, step, cursor, pool)
            waited = time.monotonic() - t0
            sent = sending.result()
        batch, trained = self._combined(own, mine, external)
        self.last = {"published_groups": float(int(mine.sum())), "external_groups": float(trained),
                     "wait_s": waited, "sent_bytes": float(sent)}
        self.totals["published_groups"] += int(mine.sum())
        self.totals["external_groups"] += trained
        self.totals["bytes_sent"] += sent
        return batch

    def report(self) -> dict[str, float]:
        """shared/...: this step's groups published and trained from peers, the wait, and the run's totals."""
        return {**self.last, **{f"total_{k}": v for k, v in self.totals.items()}}

    def state(self) -> dict:
        return {**self.inner.state(), TAKEN: {str(k): s for k, s in sorted(self.taken.items())}}

    # ----------------------------------------------------------------------------------------- publishing
    def _global_row(self, i: int) -> int:
        """The task-row identity of this learner's row ``i`` (its shard under rollouts=recent)."""
        return i if self.mode == "step" else self.learner + self.learners * i

    def _publish(self, own: Collected, mine: torch.Tensor, step: int) -> int:
        """This learner's informative groups of ``step`` (none: an empty version, so no peer waits for it)."""
        G = own.groups.group_size
        keep = mine.nonzero().squeeze(-1).tolist()
        groups, scores = own.groups.select(keep), own.scores.select(
            torch.tensor([g * G + j for g in keep for j in range(G)], dtype=torch.long, device="cpu"))
        mask = groups.completion_mask.bool()
        shared = SharedGroups(
            learner=self.learner, step=step, version=int(own.groups.version.min()), group_size=G,
            round=max(self.round_of(), 0),
            row_ids=torch.tensor([self._global_row(own.row_ids[g]) for g in keep], dtype=torch.int64,
                                 device="cpu"),
            completion_ids=groups.completion_ids.masked_fill(~mask, 0),
            lengths=mask.sum(dim=1), behaviour_logp=groups.behaviour_logp.float().masked_fill(~mask, 0.0),
            rewards=scores.total.float())
        try:
            written = self.bucket.publish(shared)
            if step % 16 == 0:
                self.bucket.gc(KEEP_VERSIONS)
        except (ManifestError, OSError) as err:  # its directory made unwritable (a planted link): it trains on
            print(f"rlvr: shared rollouts: could not publish step {step}'s groups: {err}", flush=True)
            return 0
        return written

    # ------------------------------------------------------------------------------------------ receiving
    def _allowed_rows(self, k: int, cursor: int) -> set[int] | None:
        """Rows peer ``k`` may send this step: its shares of the step's rounds (rollouts=step); None: any row of its
        shard (checked per row)."""
        if self.mode != "step":
            return None
        B, K = self.cfg.train.prompts_per_step, self.learners
        return {i for r in range(self.inner.rounds_reserved())
                for i in round_share(self.receiver.limits.rows, self.cfg.train.seed, cursor + r * K * B, (k, K), B)}

    def _fetch(self, k: int, step: int) -> tuple[SharedGroups, int] | RefusedGroups | None:
        """Peer ``k``'s groups of ``step`` and their bytes as the bucket gives them, or why they were refused; None
        while their manifest is not there (any thread: nothing is counted here)."""
        try:
            return self.bucket.read(k, step, self.receiver.limits)
        except NotPublished:
            return None
        except RefusedGroups as err:
            return err

    def _read(self, k: int, step: int, cursor: int) -> SharedGroups | None:
        """Peer ``k``'s groups of ``step``, or None (refused: counted and said)."""
        fetched = self._fetch(k, step)
        return self._accepted(k, step, cursor, RefusedGroups(f"learner {k}'s groups of step {step}: not there")
                              if fetched is None else fetched)

    def _accepted(self, k: int, step: int, cursor: int,
                  fetched: tuple[SharedGroups, int] | RefusedGroups) -> SharedGroups | None:
        """The fetched groups when their rows are peer ``k``'s to send, else None (refused: counted and said)."""
        try:
            if isinstance(fetched, RefusedGroups):
                raise fetched
            shared, size = fetched
            allowed = self._allowed_rows(k, cursor)
            rows = shared.row_ids.tolist()
            if any(i % self.learners != k for i in rows) if allowed is None else not set(rows) <= allowed:
                raise RefusedGroups(f"learner {k}'s groups of step {step}: a row that is not among its prompts")
        except RefusedGroups as err:
            self.totals["refused"] += 1
            print(f"rlvr: shared rollouts: refused {err}", flush=True)
            return None
        self.totals["bytes_received"] += size
        return shared

    def _gather(self, run: Run, step: int, cursor: int, pool: ThreadPoolExecutor) -> list[SharedGroups]:
        """The peers' groups this step trains on, in the order they join the batch."""
        if self.mode == "step":
            return self._gather_step(run, step, cursor)
        return self._gather_recent(cursor, pool)

    def _newest(self, k: int) -> list[tuple[int, tuple[SharedGroups, int] | RefusedGroups | None]] | OSError:
        """Peer ``k``'s steps not taken yet among its newest rollout_max_age, newest first, each with what reading it
        gave (``_fetch``); one listing (any thread)."""
        try:
            steps = self.bucket.published(k)
        except OSError as err:  # the store unreachable for now
            return err
        newest = [s for s in steps[-max(self.cfg.diloco.rollout_max_age, 1):] if s > self.taken.get(k, 0)]
        return [(s, self._fetch(k, s)) for s in reversed(newest)]

    def _gather_recent(self, cursor: int, pool: ThreadPoolExecutor) -> list[SharedGroups]:
        """rollouts=recent: never waits. Every peer is listed and read at once (``_newest``: its steps after the last
        one taken, among its newest rollout_max_age, whose manifest is there); their groups are taken from the next
        learner on, newest first, up to the budget of groups; a group sampled by weights more than rollout_max_rounds
        rounds older than this learner's is skipped (stale). A step looked at is never taken again, whatever came of
        it; one still being written is looked at again next step."""
        d = self.cfg.diloco
        budget = d.external_groups or self.cfg.train.prompts_per_step
        own_round = max(self.round_of(), 0)
        peers = [(self.learner + i) % self.learners for i in range(1, self.learners)]
        found: list[SharedGroups] = []
        for k, looked in zip(peers, pool.map(self._newest, peers)):
            if isinstance(looked, OSError):
                print(f"rlvr: shared rollouts: could not list learner {k}'s groups: {looked}", flush=True)
                continue
            for s, fetched in looked:
                if fetched is None:
                    continue
                self.taken[k] = max(self.taken.get(k, 0), s)
                if sum(g.num_groups for g in found) >= budget:
                    continue
                shared = self._accepted(k, s, cursor, fetched)
                if shared is None or not shared.num_groups:
                    continue
                if d.inner_steps and shared.round < own_round - d.rollout_max_rounds:
                    self.totals["stale"] += shared.num_groups
                    continue
                found.append(shared)
        return found

    def _gather_step(self, run: Run, step: int, cursor: int) -> list[SharedGroups]:
        """Every peer's groups of ``step``: those already there, and the waited-for peers' up to rollout_timeout_s.
        A peer that misses the deadline or is refused takes a strike and is not waited for until it has been on time
        and valid for as many steps as its strikes: a late or hostile peer costs its own share, and at most a
        timeout once per so many steps of its good behaviour (about sqrt(2 x steps) timeouts in all), never one a
        step."""
        deadline = time.monotonic() + self.cfg.diloco.rollout_timeout_s
        got: dict[int, SharedGroups | None] = {}
        while True:
            for k in self.bucket.arrived(step):
                if k != self.learner and k not in got:
                    got[k] = self._read(k, step, cursor)
            if self.waiting <= set(got) or time.monotonic() >= deadline or run.stop_requested:
                break
            time.sleep(POLL_S)
        missed = self.waiting - set(got)
        if missed:
            self.totals["missed"] += len(missed)
            print(f"rlvr: shared rollouts: step {step} goes on without learner(s) {sorted(missed)}'s groups; not "
                  "waited for again until they publish in time", flush=True)
        for k in self.strikes:
            if got.get(k) is None:  # missed (waited for or not) or refused
                self.strikes[k] += k in missed or k in got
                self.on_time[k] = 0
            else:
                self.on_time[k] += 1
        self.waiting = {k for k in self.strikes if got.get(k) is not None and self.on_time[k] >= self.strikes[k]}
        return [got[k] for k in sorted(got) if got[k] is not None and got[k].num_groups]

    def _combined(self, own: Collected, mine: torch.Tensor, external: list[SharedGroups]) -> tuple[Collected, int]:
        """The step's batch: the informative groups of this learner and of ``external`` (learner order under
        rollouts=step; its own first under recent, up to external_groups of the peers'), and how many groups came
        from peers. No informative group anywhere: ``own`` as it is."""
        rebuilt = []
        for shared in external:
            round_, informative, mismatched = self.receiver.rebuilt(shared)
            self.totals["reward_mismatch"] += mismatched
            self.totals["rescored_flat"] += int((~informative).sum())
            rebuilt.append((shared.learner, round_, informative))
        if self.mode == "recent":  # at most the budget, its own groups first
            budget = self.cfg.diloco.external_groups or self.cfg.train.prompts_per_step
            capped = []
            for k, round_, informative in rebuilt:
                idx = informative.nonzero().squeeze(-1)[:max(budget, 0)]
                budget -= idx.numel()
                capped.append((k, round_, idx))
            parts = [(self.learner, Round(own.row_ids, own.groups, own.scores), mine.nonzero().squeeze(-1)), *capped]
        else:
            parts = sorted([(self.learner, Round(own.row_ids, own.groups, own.scores), mine.nonzero().squeeze(-1)),
                            *[(k, r, i.nonzero().squeeze(-1)) for k, r, i in rebuilt]], key=lambda p: p[0])
        kept = [(r, idx) for _, r, idx in parts if idx.numel()]
        if not kept:
            return own, 0
        trained = sum(idx.numel() for k, _, idx in parts if k != self.learner)
        batch = scored_batch(own.rounds, kept, self.inner.advantages, own.time_generate_s, own.time_reward_s)
        batch.groups = _trimmed(batch.groups)
        return batch, trained


def _trimmed(groups: Groups) -> Groups:
    """``groups`` without padding columns that no row uses: the batch's widths then depend on its tokens only, not on
    how each part was padded before (a learner's own groups carry the width of every prompt it sampled, a peer's
    the width of those it shared), so every learner of rollouts=step runs the same shapes and gets the same bits."""
    p, t = int(groups.prompt_mask.sum(dim=1).max()), int(groups.completion_mask.sum(dim=1).max())  # left / right pad
    return replace(groups, prompt_ids=groups.prompt_ids[:, -p:], prompt_mask=groups.prompt_mask[:, -p:],
                   completion_ids=groups.completion_ids[:, :t], completion_mask=groups.completion_mask[:, :t],
                   behaviour_logp=groups.behaviour_logp[:, :t], sampled_mask=groups.sampled_mask[:, :t])


def policy_logprobs(model: torch.nn.Module, chunk_tokens: int = 512) -> Callable[[Groups], torch.Tensor]:
    """``model``'s log-probs [n, T] of a Groups' completion tokens at their temperatures, without gradient, on the
    CPU (0 on padding): what a receiver under ratio_to=behaviour floors a peer's log-probs at."""

    def own_logp(groups: Groups) -> torch.Tensor:
        n = groups.completion_ids.shape[0]
        device = next(model.parameters()).device
        batch = StepBatch.from_groups(groups, torch.zeros(n, device="cpu")).to(device)
        rows = torch.arange(n, device=device)
        return frozen_logprobs(model, batch, [rows], chunk_tokens, True).float().to("cpu")

    return own_logp
