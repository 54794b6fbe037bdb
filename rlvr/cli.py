"""Command line: ``rlvr train CONFIG.yaml [key.sub=value ...]``, ``rlvr eval CONFIG_OR_RUN_DIR [...]``,
``rlvr serve MODEL [--port ...]``, ``rlvr plan MODEL [...]`` and ``rlvr config [SECTION | SECTION.KEY]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rlvr.config.loading import ConfigError, load_config
from rlvr.envs.environment import EpisodeError
from rlvr.launch import NonFiniteError, train
from rlvr.platform.devices import DeviceMemoryError
from rlvr.platform.distributed import LearnerLost
from rlvr.rewards import RewardError, reward_search_path
from rlvr.rollout.decode_weights import PRECISIONS
from rlvr.rollout.http_client import API_KEY_ENV
from rlvr.rollout.server_errors import AdapterSyncError, NoServerError, ServerRequestError


def _train(args: argparse.Namespace) -> int:
    reward_search_path([Path(args.config).parent])  # module:function rewards: the working directory, then here
    cfg = load_config(args.config, args.overrides)
    reward_search_path([Path(args.config).parent, *cfg.import_dirs])  # then where a run's own modules came from
    summary = train(cfg)
    if "saved" not in summary:  # a learner other than rank 0 of a torchrun job: rank 0 reports
        return 0
    from rlvr.run.eval_only import accuracy_line

    print(accuracy_line(summary, cfg.output_dir))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rlvr.run.eval_only import evaluate_model

    target = Path(args.config)
    run_dir = target if target.is_dir() else None
    reward_search_path([run_dir or target.parent])
    cfg = load_config(run_dir / "config.yaml" if run_dir else target, args.overrides)
    reward_search_path([run_dir or target.parent, *cfg.import_dirs])
    if args.against_base and run_dir is None:
        raise SystemExit("rlvr eval: --against-base compares a trained run with its base model: give a run directory")
    out = evaluate_model(cfg, run_dir, Path(args.replies) if args.replies else None, args.against_base)
    print(json.dumps(out))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rlvr.serve import serve

    cores = tuple(int(c) for c in args.cores.split(",")) if args.cores else ()
    serve(args.model, args.host, args.port, args.max_loras, args.threads, args.max_model_len, args.served_model_name,
          args.max_num_seqs, args.batch_wait_ms, args.parent_pid, cores, api_key=args.api_key or None,
          allowed_adapter_roots=tuple(r for r in args.allowed_adapter_roots.split(",") if r),
          allowed_protocols=tuple(p for p in args.allowed_protocols.split(",") if p),
          max_batch_tokens=args.max_batch_tokens, max_queued_rows=args.max_queued_rows, max_body_mb=args.max_body_mb,
          body_timeout_s=args.body_timeout_s, precision=args.precision, device=args.device, dtype=args.dtype,
          lora_modules=tuple(args.lora_modules), task=args.task, prefix_cache_mb=args.prefix_cache_mb)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rlvr.config.plan import PlannedRun, report, resolve_arch

    given = {"dtype": args.precision, "optimizer": args.optimizer, "lora_rank": args.lora_rank, "beta": args.beta,
             "prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
             "completion_len": args.completion_len, "micro_batch": args.micro_batch,
             "checkpointing": args.checkpointing, "lean": None if args.plain is None else not args.plain,
             "devices": args.devices, "zero": args.zero}
    run = PlannedRun(**{k: v for k, v in given.items() if v is not None})  # the rest: the config's defaults
    print(report(resolve_arch(args.model), run))
    return 0


def _config(args: argparse.Namespace) -> int:
    from rlvr.config.doc import describe

    print(describe(args.key), end="")
    return 0


TRAIN_EPILOG = """\
config keys:
  rlvr config                 every section and key: type, default, description
  rlvr config algo            one section;  rlvr config algo.beta  one key
  (the same, as a page: docs/reference/config.md)

tasks, rewards and data:
  docs/concepts/rewards_data.md   built-in tasks and rewards, rewards of your own
                                  (rewards: [{name: my_rewards:my_reward, kwargs: {...}}], imported from the
                                  working directory, then the config's folder, then PYTHONPATH), JSONL and
                                  Hugging Face data formats
  examples/*.yaml                 configs to start from
"""


def _quiet_libraries() -> None:
    """Keep the terminal for rlvr's own progress bar: no per-file loading bars or upstream deprecations.

    Errors rlvr raises on bad input are printed as one line; RLVR_DEBUG=1 shows the traceback instead."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlvr", description="GRPO on verifiable rewards for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a model with GRPO / DAPO / Dr. GRPO", epilog=TRAIN_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p_train.add_argument("config", help="YAML config (see examples/), or a run's config.yaml to run it again")
    p_train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 algo.preset=dapo")
    p_train.set_defaults(run=_train)
    p_eval = sub.add_parser("eval", help="greedy held-out accuracy of a base model (config) or a trained run (run dir)")
    p_eval.add_argument("config", help="YAML config, or a run directory written by 'rlvr train'")
    p_eval.add_argument("overrides", nargs="*", help="dotted overrides, e.g. task.eval_size=50")
    p_eval.add_argument("--replies", default="", metavar="PATH",
                        help="write every held-out reply with its scores to PATH (JSON lines)")
    p_eval.add_argument("--against-base", action="store_true",
                        help="a run directory: evaluate the base model too, and run the gaming check from it to the "
                             "trained weights (a trained reward up while a measure it never trained on fell)")
    p_eval.set_defaults(run=_eval)
    p_serve = sub.add_parser("serve", help="an OpenAI-compatible inference server with vLLM's LoRA endpoints")
    p_serve.add_argument("model", help="built-in alias or a local model directory")
    p_serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p_serve.add_argument("--port", type=int, default=8000, help="port (0: any free one; the URL is printed)")
    p_serve.add_argument("--max-loras", type=int, default=4, help="LoRA adapters resident at once")
    p_serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                         help="adapters to load at start, as vLLM takes them: NAME=PATH or JSON "
                              '{"name": NAME, "path": PATH}; clients ask for them by NAME')
    p_serve.add_argument("--threads", type=int, default=0, help="torch threads for generation (0: all cores)")
    p_serve.add_argument("--max-model-len", type=int, default=0, help="context limit (0: the model's own)")
    p_serve.add_argument("--served-model-name", default="", help="the base model's name in the API (default: MODEL)")
    p_serve.add_argument("--max-num-seqs", type=int, default=256,
                         help="completions decoded together at most (default %(default)s); a larger request runs "
                              "as several batches, and n above it is refused (400)")
    p_serve.add_argument("--max-batch-tokens", type=int, default=0,
                         help="KV-cache positions per batch, completions x (longest prompt + max_tokens); a request "
                              "above it is split, one prompt whose n completions exceed it refused (400) "
                              "(0: max(131072, the context length))")
    p_serve.add_argument("--max-queued-rows", type=int, default=4096,
                         help="completions accepted and unfinished at once (default %(default)s); beyond: 503 "
                              "with Retry-After, and a single request above it is refused (400)")
    p_serve.add_argument("--max-body-mb", type=float, default=4.0,
                         help="largest request body in MiB (default %(default)s; beyond: 413)")
    p_serve.add_argument("--body-timeout-s", type=float, default=30.0,
                         help="a request body still arriving after this many seconds gets 408 (default %(default)s)")
    p_serve.add_argument("--api-key", default="",
                         help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); "
                              f"when absent, the {API_KEY_ENV} environment variable is used (keeps it out of ps)")
    p_serve.add_argument("--allowed-adapter-roots", default="",
                         help="comma-separated local directories and URL prefixes (s3://bucket/run1) that "
                              "lora_path must lie under (symlinks resolved); default: any local directory when "
                              "--host is loopback, nothing otherwise")
    p_serve.add_argument("--allowed-protocols", default="file",
                         help="comma-separated fsspec protocols lora_path may use (default: file, local paths only)")
    p_serve.add_argument("--batch-wait-ms", type=float, default=10.0,
                         help="how long a batch waits for requests sent together to arrive")
    p_serve.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (Linux)")
    p_serve.add_argument("--cores", default="", help="run on these CPU cores only, e.g. 1,2")
    p_serve.add_argument("--precision", choices=PRECISIONS, default="auto",
                         help="decoding matmuls: fp32, bf16, or auto (bf16 for a model of 50M+ parameters where the "
                              "hardware has bf16 units: AMX, AVX512-BF16, CUDA; fp32 otherwise)")
    p_serve.add_argument("--device", default="auto",
                         help="where the model runs: auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda, "
                              "cuda:N or mps")
    p_serve.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                         help="the base model's weights: auto (bf16 on a GPU with bf16 units, fp32 elsewhere), fp32 "
                              "or bf16; LoRA adapters keep their own dtype")
    p_serve.add_argument("--task", choices=("auto", "generate", "classify"), default="auto",
                         help="generate: a causal LM (the OpenAI routes); classify: a sequence-classification model, "
                              "e.g. a reward model (vLLM's POST /classify); auto: classify when the model's config "
                              "names a *ForSequenceClassification architecture")
    p_serve.add_argument("--prefix-cache-mb", type=float, default=1024,
                         help="MiB of recent completions' keys and values kept, so a request that extends an earlier "
                              "prompt + completion (an episode's next turn) feeds only its new tokens (default "
                              "%(default)s; 0: none)")
    p_serve.set_defaults(run=_serve)
    p_plan = sub.add_parser("plan", help="peak training memory per device, PPO vs GRPO, component by component")
    p_plan.add_argument("model", help="1.5b, 7b, 8b, 70b, smollm2-135m, a built-in alias or a local model directory")
    # unset flags take the run config's defaults (rlvr config), auto settings as on a CUDA device with bf16 units
    p_plan.add_argument("--precision", choices=("auto", "fp32", "bf16"), help="model.dtype (default auto: a bf16 "
                        "base under LoRA, fp32 for full fine-tuning)")
    p_plan.add_argument("--optimizer", choices=("adamw", "adamw_8bit", "sgd"), help="default adamw")
    p_plan.add_argument("--lora-rank", type=int, help="LoRA rank on all linear layers, 0: full (default model.lora_r)")
    p_plan.add_argument("--beta", type=float, help="KL coefficient, 0: no reference model (default algo.beta)")
    p_plan.add_argument("--prompts", type=int, help="B: prompts per step (default train.prompts_per_step)")
    p_plan.add_argument("--group", type=int, help="G: completions per prompt (default rollout.group_size)")
    p_plan.add_argument("--prompt-len", type=int, help="prompt tokens (default 64)")
    p_plan.add_argument("--completion-len", type=int, help="completion tokens (default rollout.max_new_tokens)")
    p_plan.add_argument("--micro-batch", type=int, help="completions per forward/backward on a device "
                        "(default train.micro_batch_size)")
    p_plan.add_argument("--checkpointing", action=argparse.BooleanOptionalAction,
                        help="activation checkpointing (default model.gradient_checkpointing: auto, on for CUDA)")
    p_plan.add_argument("--plain", action="store_true", default=None, help="the plain step (TRL's way) instead of "
                        "rlvr's")
    p_plan.add_argument("--devices", type=int, help="default 1")
    p_plan.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (3 = FSDP; default 0)")
    p_plan.set_defaults(run=_plan)
    p_config = sub.add_parser("config", help="every config key with its type, default and description")
    p_config.add_argument("key", nargs="?", default="", help="a section (algo) or one key (algo.beta); default: all")
    p_config.set_defaults(run=_config)
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError, ValueError, KeyError, RewardError, NonFiniteError, NoServerError,
            AdapterSyncError, ServerRequestError, DeviceMemoryError, LearnerLost, ConnectionError, EpisodeError) as err:
        if os.environ.get("RLVR_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"rlvr: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
