"""log.trackers: wandb (offline) and trackio (local) get what metrics.jsonl gets, read back with their own readers."""

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.cli import main
from rlvr.config.loading import ConfigError, load_config, to_dict
from rlvr.launch import train
from rlvr.store.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parent.parent
_connections: list | None = None  # network use seen by the audit hook while watched


def _audit(event: str, args: tuple) -> None:
    if _connections is None:
        return
    if event == "socket.connect" and args[0].family != socket.AF_UNIX or event == "socket.getaddrinfo":
        _connections.append((event, args[1:]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def no_network():
    """Fails if this process opens a network connection or looks up a host name inside the block."""
    global _connections
    _connections = []
    try:
        yield
        assert _connections == []
    finally:
        _connections = None


def _wandb_services() -> list[list[str]]:
    """Command lines of the wandb-core service processes started for this process (wandb passes --pid PID)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0") if proc.name.isdigit() else [""]
        except OSError:
            continue
        served = args[args.index("--pid") + 1] if "--pid" in args else None
        if args[0].endswith("wandb-core") and served == str(os.getpid()):
            found.append(args)
    return found


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """wandb's own files in tmp_path, and the variables rlvr reads left unset (restored afterwards)."""
    for name in ("CACHE", "CONFIG", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    for name in ("WANDB_MODE", "WANDB_ERROR_REPORTING"):
        monkeypatch.setenv(name, "")  # records the value to restore at the end, whatever rlvr sets meanwhile
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, at import: every in-process test shares one directory."""
    with pytest.MonkeyPatch.context() as mp:
        if "trackio" in sys.modules:
            import trackio.utils

            yield Path(trackio.utils.TRACKIO_DIR)
        else:
            path = tmp_path_factory.mktemp("trackio")
            mp.setenv("TRACKIO_DIR", str(path))
            yield path


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """Every offline segment's records in <run_dir>/wandb, oldest first, as wandb's own reader prints them."""
    segments = []
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        segments.append([json.loads(line) for line in out.splitlines() if line.strip()])
    return segments


def wandb_history(records: list[dict]) -> dict[int, dict[str, float]]:
    rows = (r["history"] for r in records if r["type"] == "history")
    return {row["step"]["num"]: {k: float(v) for k, v in row["item"].items() if not k.startswith("_")} for row in rows}


def trackio_history(project: str, name: str) -> dict[int, dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    return {row["step"]: {k: float(v) for k, v in row.items() if k not in ("step", "timestamp")}
            for row in SQLiteStorage.get_logs(project, name)}


def jsonl_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """What the trackers are promised: every finite number of every metrics.jsonl record, at its step."""
    return {r["step"]: {k: float(v) for k, v in r.items()
                        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
            for r in read_metrics(run_dir / "metrics.jsonl")}


def test_a_run_logs_the_same_metrics_and_config_to_wandb_and_trackio(tiny_model_dir, tmp_path, trackio_dir):
    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model.name={tiny_model_dir}", "model.lora_r=4", f"output_dir={out}", "task.eval_size=4",
        "rewards=[{name: 'tests.helpers:length_reward'}]", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=2", "train.micro_batch_size=4", "train.steps=2", "eval.batch_size=4",
        "log.progress=false", "log.plot=false", "log.trackers=[tensorboard, wandb, trackio]",
        "log.project=rlvr-test", "log.run_name=first"])
    with no_network():
        train(cfg)
    assert _wandb_services() == []  # the service process ended with the run

    expected = jsonl_scalars(out)
    assert sorted(expected) == [0, 1, 2] and "update/loss" in expected[1] and "eval/accuracy" in expected[2]
    [records] = wandb_records(out)
    assert wandb_history(records) == expected
    assert trackio_history("rlvr-test", "first") == expected
    assert any((out / "tensorboard").iterdir())

    # the resolved config, once, with the project and run name asked for
    runs = [r["run"] for r in records if r["type"] == "run"]
    assert len(runs) == 1 and not [r for r in records if r["type"] == "config"]
    assert (runs[0]["project"], runs[0]["display_name"]) == ("rlvr-test", "first")
    config = {k: v for k, v in runs[0]["config"]["update"].items() if k != "_wandb"}
    assert config == to_dict(cfg)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]

    import trackio

    [run] = trackio.Api().runs("rlvr-test")
    assert run.name == "first" and {k: v for k, v in run.config.items() if not k.startswith("_")} == to_dict(cfg)
    assert not (out / "trackio").exists()  # TRACKIO_DIR, when set, wins over the run directory


def test_resume_continues_the_same_wandb_and_trackio_runs(tmp_path, trackio_dir):
    """The first process fails after logging step 3, its last checkpoint at step 1: the resumed one redoes 2 and 3,
    then logs 4. metrics.jsonl keeps the redone values; wandb and trackio keep the ones they had and get step 4."""
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    trackers = ("wandb", "trackio")
    with no_network():
        with pytest.raises(RuntimeError), MetricsWriter(run_dir, trackers, run_name="resumed", config={"lr": 0.5}) as w:
            services = _wandb_services()
            assert services and all("--no-observability" in args for args in services)  # no error reporting
            for step in (0, 1, 2, 3):
                w.log(step, {"loss": step + 0.5})
            raise RuntimeError("the loop failed")
        writer = MetricsWriter(run_dir, trackers, resume_step=1, run_name="resumed", config={"lr": 0.25})
        for step in (2, 3, 4):
            writer.log(step, {"loss": step + 0.75})
        writer.close()
        writer.close()  # a second close does nothing
    assert _wandb_services() == []

    jsonl = jsonl_scalars(run_dir)
    assert jsonl == {0: {"loss": 0.5}, 1: {"loss": 1.5}, 2: {"loss": 2.75}, 3: {"loss": 3.75}, 4: {"loss": 4.75}}
    held = {0: {"loss": 0.5}, 1: {"loss": 1.5}, 2: {"loss": 2.5}, 3: {"loss": 3.5}, 4: {"loss": 4.75}}
    first, second = wandb_records(run_dir)
    run_ids = [[r["run"]["run_id"] for r in seg if r["type"] == "run"] for seg in (first, second)]
    assert run_ids == [[(run_dir / "wandb_run_id").read_text().strip()]] * 2  # one run, two offline segments
    assert {**wandb_history(first), **wandb_history(second)} == held
    assert sorted(wandb_history(second)) == [4]
    assert [[r["exit"]["exit_code"] for r in seg if r["type"] == "exit"] for seg in (first, second)] == [[1], [0]]
    assert trackio_history("rlvr", "resumed") == held

    import trackio

    assert [r.name for r in trackio.Api().runs("rlvr")].count("resumed") == 1  # continued, not a second run


def test_a_tracker_added_on_resume_gets_every_step_logged_from_then_on(tmp_path, trackio_dir):
    run_dir = tmp_path / "added-later"
    run_dir.mkdir()
    with MetricsWriter(run_dir, ()) as writer:  # metrics.jsonl only
        for step in (0, 1, 2, 3):
            writer.log(step, {"loss": step + 0.5})
    with MetricsWriter(run_dir, ("wandb", "trackio"), resume_step=1) as writer:
        for step in (2, 3):
            writer.log(step, {"loss": step + 0.75})
    expected = {2: {"loss": 2.75}, 3: {"loss": 3.75}}
    [records] = wandb_records(run_dir)
    assert wandb_history(records) == expected
    assert trackio_history("rlvr", "added-later") == expected


def test_an_exception_still_finishes_both_runs_and_trackio_defaults_to_the_run_dir(tmp_path):
    """A fresh process (trackio not yet imported, TRACKIO_DIR unset) whose loop raises after two steps."""
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    script = ("import sys; from pathlib import Path; from rlvr.store.metrics import MetricsWriter\n"
              "w = MetricsWriter(Path(sys.argv[1]), ('wandb', 'trackio'), config={'lr': 0.5})\n"
              "w.log(0, {'eval_accuracy': 0.25}); w.log(1, {'loss': 1.5, 'kl': float('nan')})\n"
              "raise RuntimeError('the loop failed')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRACKIO_DIR", "WANDB_MODE", "WANDB_ERROR_REPORTING")}
    crashed = subprocess.run([sys.executable, "-c", script, str(run_dir)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300, check=False)
    assert crashed.returncode == 1 and "RuntimeError: the loop failed" in crashed.stderr, crashed.stderr[-2000:]

    held = {0: {"eval_accuracy": 0.25}, 1: {"loss": 1.5}}
    [records] = wandb_records(run_dir)
    assert wandb_history(records) == held
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]  # failed, and finished
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage\n"
            "print(json.dumps(SQLiteStorage.get_logs('rlvr', sys.argv[1])))\n")
    logs = subprocess.run([sys.executable, "-c", read, "crashed"], env={**env, "TRACKIO_DIR": str(run_dir / "trackio")},
                          capture_output=True, text=True, check=True, timeout=120).stdout
    assert {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp")}
            for r in json.loads(logs)} == held


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_missing_package_stops_the_run_before_anything_loads(tmp_path, monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, name, None)  # Python then finds no such package, as if not installed
    out = tmp_path / "run"
    code = main(["train", str(ROOT / "examples" / "demo.yaml"), f"output_dir={out}", f"log.trackers=[{name}]",
                 "model.name=/no/such/model"])
    assert code == 2
    assert capsys.readouterr().err == (f"rlvr: error: log.trackers includes {name}, but the {name} package is not "
                                       f"installed: pip install 'rlvr[{name}]'\n")
    assert not out.exists()


def test_trackers_config_and_the_removed_tensorboard_switch():
    assert load_config(None, []).log.trackers == ("tensorboard",)
    assert load_config(None, ["log.trackers=[]"]).log.trackers == ()
    assert load_config(None, ["log.trackers=[tensorboard, wandb, wandb]"]).log.trackers == ("tensorboard", "wandb")
    assert load_config(None, ["log.trackers=wandb"]).log.trackers == ("wandb",)
    with pytest.raises(ConfigError, match=r"^log.tensorboard was removed: list the trackers in log.trackers, e.g. "
                                          r"log.trackers=\[\] for none$"):
        load_config(None, ["log.tensorboard=false"])
    with pytest.raises(ConfigError, match="log.trackers: unknown tracker 'mlflow'; allowed: tensorboard, wandb, "
                                          "trackio"):
        load_config(None, ["log.trackers=[tensorboard, mlflow]"])


def test_a_saved_config_with_trackers_reads_back_equal(tmp_path):
    from rlvr.config.loading import save_config

    cfg = load_config(None, ["log.trackers=[trackio]", "log.run_name=x"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
