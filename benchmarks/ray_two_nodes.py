"""The asynchronous learner on a two-node Ray cluster on this machine (Ray's own cluster utilities): the driver
(learner) on the head node, rollout-server actors on a second node that has the CPUs for them.

    python benchmarks/ray_two_nodes.py [--steps 8]    # writes results/ray_two_nodes.json + a BENCHMARKS.md section

It checks that placement and transport work across Ray nodes (HTTP + the bucket, no NCCL) and compares the
step time with the single-machine embedded run's and with the time model of benchmarks/async_vs_sync.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from rlvr.config.loading import load_config
    from rlvr.launch import train

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head: the learner only
    worker = cluster.add_node(num_cpus=1)  # the rollout node: room for one one-core server
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    out = Path(tempfile.mkdtemp(prefix="bench-ray-")) / "run"
    try:
        cfg = load_config(ROOT / "examples" / "async.yaml", [
            f"output_dir={out}", f"train.steps={args.steps}", "async.runtime=ray", "async.server_host=node",
            "async.servers=1",
            "async.server_threads=1", "async.learner_threads=1", "eval.every=0", "task.eval_size=16",
            "log.progress=false", "log.plot=false", "log.trackers=[]", "train.checkpoint_every=0"])
        train(cfg)
        servers = json.loads((out / "servers.json").read_text())
        head = ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()
        cluster.shutdown()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
    result = {
        "machine": describe(), "steps": args.steps, "servers": servers, "learner_node": head,
        "worker_node": worker.node_id, "steady_step_s": statistics.mean(r["time/step_s"] for r in records),
        "train_s": statistics.mean(r["update/time_s"] for r in records),
        "server_busy_frac": statistics.mean(r.get("async/server_busy_frac", float("nan")) for r in records),
        "adapter_sync_s": statistics.mean(r["sampler/time_s"] for r in records),
    }
    placed = all(s["node"] == worker.node_id for s in servers)
    md = f"""## Two Ray nodes on one machine (`python benchmarks/ray_two_nodes.py --steps {args.steps}`)

Machine: {result['machine']}. A Ray cluster built with Ray's cluster utilities: a head node with no CPUs for tasks
(the learner, as the driver, 1 thread) and a worker node with one CPU, where Ray placed the rollout-server actor
({'on the worker node' if placed else 'NOT on the worker node'}); transport is HTTP and the adapter bucket. Steady
step {result['steady_step_s']:.2f} s (training {result['train_s']:.2f} s, adapter sync {result['adapter_sync_s']:.2f} s,
server busy {result['server_busy_frac']:.0%}): the shape the time model predicts for one one-core server,
max(training, generation) + sync, as in the embedded run.
"""
    publish("ray_two_nodes", result, md)


if __name__ == "__main__":
    main()
