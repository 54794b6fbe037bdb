"""benchmarks/gpu.py end to end in its dry mode (--device cpu): the code path the GPU run takes, on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _measured(run: dict) -> None:
    summary = run["summary"]
    assert summary["steady_step_s"] > 0 and summary["first_step_s"] > 0
    assert summary["gen_tokens_per_s"] > 0
    assert summary["peak_mb"] > 0
    assert all(t > 0 for t in run["step_s"])


@pytest.mark.long
def test_gpu_benchmark_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True
    assert list(results["runs"]) == ["tiny"]
    runs = results["runs"]["tiny"]
    assert set(runs) == {"rlvr_equal", "rlvr_default", "trl_equal", "trl_default", "trl_vllm", "rlvr_colocate_s1"}
    assert runs["rlvr_colocate_s1"] == {"skipped": "vLLM not installed: skipped"}  # rlvr's venv has no vLLM
    _measured(runs["rlvr_equal"])
    _measured(runs["rlvr_default"])
    assert runs["rlvr_equal"]["settings"]["model.gradient_checkpointing"] is True
    for key in ("trl_equal", "trl_default"):
        if results["trl"] == "measured":
            _measured(runs[key])
        else:
            assert results["trl"] == runs[key]["skipped"] == "TRL not installed: skipped"
    assert "skipped" in runs["trl_vllm"]  # TRL missing, or a CPU: colocated vLLM is measured on a GPU only
    smoke = results["smoke"]
    assert smoke["steps"] == 2
    assert 0 <= smoke["accuracy_before"] <= 1 and 0 <= smoke["accuracy_after"] <= 1
    assert smoke["memory"]["peak_mb"] > 0
    assert {p["phase"] for p in results["phases"]} >= {"tiny rlvr_equal", "tiny rlvr_default", "smoke"}
    assert results["models"]["tiny"]["params"] > 0
    assert "| tiny (" in done.stdout and "## GPU: rlvr vs TRL on one CUDA device" in done.stdout  # the table
