"""The asynchronous learner: rollout servers keep generating while the learner trains.

    start servers (embedded / Ray / given) -> publish the current adapter -> dispatchers sample and score groups
    -> loop: take B groups (dropping stale ones) -> update -> publish + load v+1 -> log / evaluate / checkpoint

It reuses the synchronous loop's parts (``open_run``, ``Run.update``, ``Run.after_step``) and the off-policy
correction of the train step; what differs is where groups come from (``Orchestrator``). On resume the
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
from tqdm.auto import tqdm

from rlvr.bucket import AdapterBucket
from rlvr.config import RunConfig
from rlvr.core import group_advantages, informative_groups
from rlvr.rollout.remote import NoServerError, RemoteSampler, ServerPool, api_key_from_env
from rlvr.runtime.orchestrator import Orchestrator, Taken, stack
from rlvr.train.build import sampling_params
from rlvr.train.collect import Collected, Round
from rlvr.train.run import open_run, stop_on_interrupt


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
                             host=a.server_host, api_key=api_key, adapter_roots=roots, adapter_protocols=protocols)
        stack_.callback(servers.stop)
        return servers.start(), servers.resolve, servers, api_key
    from rlvr.runtime.embedded import EmbeddedServers, plan_cores

    plan = plan_cores(a.servers, a.server_threads, a.learner_threads) if a.pin else None
    servers = EmbeddedServers(str(model_dir), a.servers, a.server_threads, run_dir, restarts=a.server_restarts,
                              cores=plan[1] if plan else None, max_loras=a.max_staleness + 3, api_key=api_key,
                              adapter_roots=roots, adapter_protocols=protocols)
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


def _collected(taken: Taken, G: int, scale: str, adv_eps: float, negative_scale: float) -> Collected:
    groups, scores, rows = stack(taken.groups)
    uids = [g.uid for g in taken.groups]
    round_ = Round(rows, groups, scores, informative_groups(scores.total, G), uids)
    return Collected([round_], rows, groups, scores, group_advantages(scores.total, G, scale, adv_eps, negative_scale),
                     time_generate_s=taken.idle_s, time_reward_s=0.0)


def train_async(cfg: RunConfig) -> dict:
    """Train with generation on rollout servers overlapped with the updates; returns the summary."""
    run = open_run(cfg)
    a, algo, B, G = cfg.asynchronous, cfg.algo, cfg.train.prompts_per_step, cfg.rollout.group_size
    with contextlib.ExitStack() as stack_, stop_on_interrupt() as stop, run.writer:
        urls, resolve, launcher, api_key = _start_servers(cfg, run.data.model_dir, run.run_dir, stack_)
        threads = a.learner_threads or (len(os.sched_getaffinity(0)) if a.pin else torch.get_num_threads())
        torch.set_num_threads(max(threads, 1))
        pool = ServerPool(urls, api_key=api_key, request_timeout_s=cfg.rollout.request_timeout_s, resolve=resolve,
                          no_server_wait_s=cfg.rollout.server_wait_s, probe_interval_s=2.0, max_attempts=MAX_ATTEMPTS)
        # servers started here are loading the model: they get at least EMBEDDED_STARTUP_S to come up
        pool.wait_ready(cfg.rollout.server_wait_s if launcher is None else max(cfg.rollout.server_wait_s,
                                                                               EMBEDDED_STARTUP_S))
        sampler = RemoteSampler(pool, run.data.tokenizer, run.model, AdapterBucket(cfg.rollout.bucket or
                                run.run_dir / "adapters"), keep_versions=a.max_staleness + 2)
        stack_.callback(sampler.close)
        run.sampler = sampler
        sampler.sync(run.start)  # the restored (or initial) adapter is on every server before any rollout
        run.evaluate_before()
        seed = cfg.train.seed
        orchestrator = Orchestrator(
            sampler, run.data.train_rows, run.rewards, G, sampling_params(cfg.rollout), data_seed=seed,
            sample_seed=lambda uid: seed * 1_000_003 + uid, max_inflight=a.max_inflight_groups or B,
            max_staleness=a.max_staleness, cursor=run.state["cursor"], pending=run.state.get("pending", []),
        ).start()
        stack_.callback(orchestrator.stop)
        bar = tqdm(range(run.start + 1, cfg.train.steps + 1), disable=not cfg.log.progress,
                   desc=f"async {algo.preset}", unit="step", initial=run.start, total=cfg.train.steps)
        busy, clock = sampler.busy_seconds(), time.perf_counter()
        wait_s = learner_wait_s(cfg)
        for step in bar:
            before = orchestrator.stats.__dict__.copy()
            try:
                taken = orchestrator.take(B, version=step - 1, dynamic_sampling=algo.dynamic_sampling, timeout_s=wait_s)
            except TimeoutError:
                logs = f" (logs: {run.run_dir / 'servers'})" if launcher is not None and a.runtime != "ray" else ""
                raise NoServerError(
                    f"step {step}: no scored group came from the rollout servers for {wait_s:.0f} s "
                    f"(async.learner_wait_s): {pool.stats.requests} requests sent, {pool.stats.answers_rejected} "
                    f"answers rejected as malformed, {len(pool.live())} of {len(urls)} servers live. Check the "
                    f"servers{logs}, or raise async.learner_wait_s if generation is this slow") from None
            c = _collected(taken, G, algo.scale, algo.adv_eps, algo.negative_scale)
            metrics = run.update(c, step)
            now_busy, now = sampler.busy_seconds(), time.perf_counter()
            metrics.update(_async_metrics(taken, before, orchestrator, busy, now_busy, now - clock))
            metrics["servers_restarted"] = getattr(launcher, "restarts", 0)
            busy, clock = now_busy, now
            run.after_step(step, metrics, c, {"cursor": orchestrator.cursor, "pending": orchestrator.pending_uids()})
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{run.state['eval_accuracy']:.3f}",
                            idle=f"{taken.idle_s:.1f}s")
            if stop.requested:
                bar.close()
                run.interrupted(step)
    return run.finish()


def _async_metrics(taken: Taken, before: dict, orchestrator: Orchestrator, busy: dict, now_busy: dict,
                   wall_s: float) -> dict:
    """Per step: groups sampled / trained / dropped / re-dispatched, staleness histogram, learner idle time,
    server busy fraction."""
    s = orchestrator.stats
    out = {
        "groups_sampled": s.sampled - before["sampled"],
        "groups_trained": len(taken.groups),
        "groups_dropped_stale": taken.dropped_stale,
        "groups_dropped_zero_variance": taken.dropped_zero_variance,
        "groups_redispatched": s.redispatched - before["redispatched"],
        "learner_idle_s": taken.idle_s,
        "step_wall_s": wall_s,
        "gen_tokens_per_s": sum(float(g.groups.completion_mask.sum()) for g in taken.groups) / max(wall_s, 1e-9),
        **{f"staleness/{k}": v for k, v in sorted(taken.staleness.items())},
    }
    shared = [url for url in now_busy if url in busy]
    if shared and wall_s > 0:
        busy_frac = sum(now_busy[u] - busy[u] for u in shared) / (len(shared) * wall_s)
        out["server_busy_frac"] = busy_frac
        out["server_idle_s"] = (1 - busy_frac) * wall_s
    return out
