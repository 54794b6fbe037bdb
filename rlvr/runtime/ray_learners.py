"""DiLoCo learners placed by Ray (diloco.placement=ray): each a Ray task running one ordinary learner
(``rlvr.launch.train`` with diloco.learner=k/K) wherever the cluster has room (``num_cpus`` = its threads, a GPU
when train.device asks for CUDA). The learners still talk only through diloco.bucket, which every node must reach
(a shared disk or an object store); Ray only places them, and a learner that dies does not stop the others (its
task's error is reported when the rest have ended). Anyone who can submit work to the Ray cluster can run code
there: the cluster must be trusted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from rlvr.config.schema import RunConfig


def _learner_config(cfg: RunConfig, k: int) -> RunConfig:
    """Learner k's configuration, its paths absolute (a Ray worker runs in a directory of Ray's)."""
    from rlvr.run.files import absolute_paths

    cfg = absolute_paths(cfg)
    d = cfg.diloco
    return dataclasses.replace(cfg, output_dir=str(Path(cfg.output_dir) / f"learner-{k}"),
                               diloco=dataclasses.replace(d, learner=f"{k}/{d.learners}", placement="hand",
                                                          learners=0))


def train_on_ray(cfg: RunConfig, train: Callable[[RunConfig], dict]) -> dict:
    """Place diloco.learners learners, each ``train`` (rlvr.launch.train) on its configuration, and wait for all;
    learner 0's summary, with every learner's under ``learners`` (an error string for one that failed)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address=cfg.asynchronous.ray_address or None, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        options = {"num_cpus": max(cfg.train.threads, 1), "max_retries": 0}
        if cfg.train.device.startswith("cuda"):
            options["num_gpus"] = 1
        task = ray.remote(**options)(train)
        pending = [task.remote(_learner_config(cfg, k)) for k in range(cfg.diloco.learners)]
        summaries = []
        for k, ref in enumerate(pending):
            try:
                summaries.append(ray.get(ref))
            except ray.exceptions.RayError as err:
                summaries.append({"error": f"learner {k}: {' '.join(str(err).split())[:300]}"})
    finally:
        if started:
            ray.shutdown()
    first = next((s for s in summaries if "error" not in s), None)
    if first is None:
        raise RuntimeError(f"every DiLoCo learner failed: {summaries[0]['error']}")
    return {**first, "learners": summaries}
