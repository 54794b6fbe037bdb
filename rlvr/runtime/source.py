"""The asynchronous batch source: rollout servers keep generating while the learner trains.

    open: start servers (embedded / Ray / given) -> the sampler over them -> dispatchers sample and score groups
    next: take B groups (dropping stale ones) -> the batch, advantages computed as the synchronous source does

The loop (rlvr/run/loop.py) is the same as a synchronous run's; it publishes and loads version v+1 on every
server after each update (``sampler.sync``), and the off-policy correction of the train step handles the
staleness. What differs is where groups come from (``Orchestrator``). On resume the
checkpoint's adapter is published and loaded before a single rollout is accepted, and the prompts that were
in flight at the checkpoint are dispatched first. A resumed asynchronous run continues correctly but does not
repeat the uninterrupted one bit for bit: which server answers first is not a function of the seed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time

import torch

from rlvr.config.schema import RunConfig
from rlvr.learn.collected import Collected, Round
from rlvr.platform.seeds import group_seed
from rlvr.rollout import Sampler
from rlvr.rollout.http_client import api_key_from_env
from rlvr.rollout.server_errors import NoServerError
from rlvr.run.build import build_remote_sampler, sampling_params
from rlvr.run.collect import Advantages, scored_batch
from rlvr.run.lifecycle import Run
from rlvr.runtime.orchestrator import Orchestrator, Taken


def _start_servers(cfg: RunConfig, model_dir, run_dir, stack_: contextlib.ExitStack):
    """URLs of the rollout servers, how to find a server again after it restarts (Ray, else None), the launcher
    (None for servers the user started) and the API key to send them: the user's (from the environment variable
    rollout.api_key_env), or a random one made here for the servers started here."""
    a = cfg.asynchronous
    if cfg.rollout.servers:
        return list(cfg.rollout.servers), None, None, api_key_from_env(cfg.rollout.api_key_env)
    api_key = secrets.token_urlsafe(32)  # this run's servers accept no one else's requests
    roots, protocols = adapter_access(cfg.rollout.bucket or str(run_dir / "adapters"))
    if a.runtime == "ray":
        from rlvr.runtime.ray_servers import RayServers

        servers = RayServers(str(model_dir), a.servers, a.server_threads, address=a.ray_address,
                             restarts=a.server_restarts, max_loras=a.max_staleness + 3, run_dir=run_dir,
                             host=a.server_host, api_key=api_key, adapter_roots=roots, adapter_protocols=protocols,
                             precision=cfg.rollout.precision, device=a.server_device)
        stack_.callback(servers.stop)
        return servers.start(), servers.resolve, servers, api_key
    from rlvr.runtime.embedded import EmbeddedServers, plan_cores

    plan = plan_cores(a.servers, a.server_threads, a.learner_threads) if a.pin else None
    servers = EmbeddedServers(str(model_dir), a.servers, a.server_threads, run_dir, restarts=a.server_restarts,
                              cores=plan[1] if plan else None, max_loras=a.max_staleness + 3, api_key=api_key,
                              adapter_roots=roots, adapter_protocols=protocols, precision=cfg.rollout.precision,
                              device=a.server_device)
    stack_.callback(servers.stop)
    urls = servers.start()
    if plan:  # the learner keeps to its own cores while it runs
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, plan[0])
        stack_.callback(os.sched_setaffinity, 0, previous)
    return urls, None, servers, api_key


def adapter_access(bucket: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the servers started here may load adapters from: the run's bucket (a directory, made absolute, or an
    fsspec URL with its protocol), nothing else."""
    protocol, sep, _ = bucket.partition("://")
    if sep and protocol.lower() not in ("file", "local"):
        return (bucket.rstrip("/"),), ("file", protocol.lower())
    return (os.path.abspath(bucket.partition("://")[2] if sep else bucket),), ("file",)


EMBEDDED_STARTUP_S = 120.0
MAX_ATTEMPTS = 4  # servers a request is tried on
SCORING_MARGIN_S = 300.0


def learner_wait_s(cfg: RunConfig) -> float:
    """How long the learner waits for the next scored group: async.learner_wait_s, or (0) the longest a healthy
    pool can take for one request - every attempt running to its deadline after waiting for a server - plus
    time to score it."""
    if cfg.asynchronous.learner_wait_s > 0:
        return cfg.asynchronous.learner_wait_s
    r = cfg.rollout
    return MAX_ATTEMPTS * (r.request_timeout_s + r.server_wait_s) + SCORING_MARGIN_S


class AsyncSource:
    """Batches from rollout servers that sample and score while the learner trains (async.enabled)."""

    label = "async "
    metrics_section = "async"

    def __init__(self, cfg: RunConfig, advantages: Advantages | None):
        self.cfg, self.advantages = cfg, advantages
        self.launcher = self.orchestrator = None
        self.urls: list[str] = []

    def open(self, run: Run, stack: contextlib.ExitStack) -> Sampler:
        cfg, a = self.cfg, self.cfg.asynchronous
        self.urls, resolve, self.launcher, api_key = _start_servers(cfg, run.data.model_dir, run.run_dir, stack)
        threads = a.learner_threads or (len(os.sched_getaffinity(0)) if a.pin else torch.get_num_threads())
        torch.set_num_threads(max(threads, 1))
        # servers started here are loading the model: they get at least EMBEDDED_STARTUP_S to come up
        sampler = build_remote_sampler(cfg, run.model, run.data.tokenizer, run.run_dir, self.urls, api_key,
                                       resolve=resolve, startup_s=EMBEDDED_STARTUP_S if self.launcher else 0.0,
                                       keep_versions=a.max_staleness + 2, max_attempts=MAX_ATTEMPTS,
                                       probe_interval_s=2.0)
        stack.callback(sampler.close)
        self.sampler, self._stack = sampler, stack
        return sampler

    def _start_orchestrator(self, run: Run) -> None:
        """Dispatching starts once the loop has loaded the restored (or initial) adapter on every server."""
        cfg, a, seed = self.cfg, self.cfg.asynchronous, self.cfg.train.seed
        self.orchestrator = Orchestrator(
            self.sampler, run.data.train_rows, run.rewards, cfg.rollout.group_size, sampling_params(cfg.rollout),
            data_seed=seed, sample_seed=lambda uid: group_seed(seed, uid),
            max_inflight=a.max_inflight_groups or cfg.train.prompts_per_step, max_staleness=a.max_staleness,
            cursor=run.state["cursor"], pending=run.state.get("pending", []), env_setup=run.data.env_setup,
        )
        self._busy, self._stats = self.sampler.busy_seconds(), self.orchestrator.stats.__dict__.copy()
        self._clock = time.perf_counter()
        self.orchestrator.start()
        self._stack.callback(self.orchestrator.stop)

    def next(self, run: Run, step: int) -> Collected:
        if self.orchestrator is None:
            self._start_orchestrator(run)
        cfg, wait_s = self.cfg, learner_wait_s(self.cfg)
        try:
            taken = self.orchestrator.take(cfg.train.prompts_per_step, version=step - 1,
                                           dynamic_sampling=cfg.algo.dynamic_sampling,
                                           max_resample_rounds=cfg.algo.max_resample_rounds, timeout_s=wait_s)
        except TimeoutError:
            pool = self.sampler.pool
            logs = (f" (logs: {run.run_dir / 'servers'})"
                    if self.launcher is not None and cfg.asynchronous.runtime != "ray" else "")
            raise NoServerError(
                f"step {step}: no scored group came from the rollout servers for {wait_s:.0f} s "
                f"(async.learner_wait_s): {pool.stats.requests} requests sent, {pool.stats.answers_rejected} "
                f"answers rejected as malformed, {len(pool.live())} of {len(self.urls)} servers live. Check the "
                f"servers{logs}, or raise async.learner_wait_s if generation is this slow") from None
        self.taken = taken
        groups = taken.groups  # one round: the groups taken for this step (B, or fewer with dynamic sampling)
        round_ = Round.concat(groups)
        return scored_batch([round_], [(round_, torch.arange(len(groups)))], self.advantages,
                            round_.time_generate_s, round_.time_reward_s)

    def report(self) -> dict[str, float]:
        busy, now = self.sampler.busy_seconds(), time.perf_counter()
        out = async_metrics(self.taken, self._stats, self.orchestrator.stats.__dict__, self._busy, busy,
                            now - self._clock)
        out["servers_restarted"] = getattr(self.launcher, "restarts", 0)
        self._busy, self._stats, self._clock = busy, self.orchestrator.stats.__dict__.copy(), now
        return out

    def state(self) -> dict:
        cursor, pending = self.orchestrator.position()
        return {"cursor": cursor, "pending": pending}


def async_metrics(taken: Taken, before: dict, now: dict, busy: dict, now_busy: dict, wall_s: float) -> dict:
    """Per step: groups sampled / trained / dropped / re-dispatched (orchestrator counters ``before`` and ``now``),
    staleness histogram, learner idle time, server busy fraction (from busy seconds per server) and generation
    throughput over ``wall_s``, the time since the previous report."""
    out = {
        "groups_sampled": now["sampled"] - before["sampled"],
        "groups_trained": len(taken.groups),
        "groups_dropped_stale": taken.dropped_stale,
        "groups_dropped_zero_variance": taken.dropped_zero_variance,
        "groups_redispatched": now["redispatched"] - before["redispatched"],
        "learner_idle_s": taken.idle_s,
        "gen_tokens_per_s": sum(float(g.groups.completion_mask.sum()) for g in taken.groups) / max(wall_s, 1e-9),
        **{f"staleness/{k}": v for k, v in sorted(taken.staleness.items())},
    }
    shared = [url for url in now_busy if url in busy]
    if shared and wall_s > 0:
        busy_frac = sum(now_busy[u] - busy[u] for u in shared) / (len(shared) * wall_s)
        out["server_busy_frac"] = busy_frac
        out["server_idle_s"] = (1 - busy_frac) * wall_s
    return out
