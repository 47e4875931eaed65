# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed

.PHONY: install test quick test-compat demo lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[trainer,dev]'
	@touch $(STAMP)

install: $(STAMP)

# odtd's modules are compiled first: the tests start hundreds of Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (the development machine's environment sets it) each would
# compile the odtd modules it imports again: about 0.1 s of CPU for the CLI's.
# Three pytest workers on two cores: most tests wait on subprocesses (the trainer worker, the
# daemon); tests/conftest.py gives the TensorFlow workers they start one thread per pool.
# `--dist worksteal`: a pytest worker that runs out of tests takes some of another's queue, so
# the run does not end on one worker working through a batch of slow tests alone.
test: $(STAMP)
	@$(BIN)/python -m compileall -q odtd
	$(BIN)/python -m pytest -q -n 3 --dist worksteal

# The edit loop: everything that starts no TensorFlow worker (tests marked `trains` are left out).
quick: $(STAMP)
	@$(BIN)/python -m compileall -q odtd
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not trains"

# Pre-train DenseNet40 briefly on the built-in synthetic "server" images, then simulate 7 days
# of 64 new "device" images each through the real session path, and show the result.
demo: $(STAMP)
	$(BIN)/odtctl --home demo-home simulate --fresh --model densenet40 --days 7 --per-day 64 \
		--pretrain-samples 1500 --pretrain-epochs 3 --validation-samples 300 --policy policies/demo.yaml
	$(BIN)/odtctl --home demo-home status

# The oldest stack odtd supports, beside the current one: a Keras-2 TensorFlow (2.15, what a
# JetPack-era worker looks like to tf.keras) and sqlite-utils 3.x (the Python 3.8 daemons' line).
$(COMPAT_STAMP): pyproject.toml
	@test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT)/bin/python -m pip install --quiet 'tensorflow==2.15.1' 'numpy<2' 'sqlite-utils>=3.35,<4' pytest 'pytest-xdist>=3.2'
	$(COMPAT)/bin/python -m pip install --quiet -e .
	@touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -m pytest -q -n 2 --dist worksteal -p no:cacheprovider tests/test_worker.py tests/test_store.py \
		tests/test_session.py tests/test_learning.py tests/test_ingest.py tests/test_config.py \
		tests/test_byom.py tests/test_arithmetic.py tests/test_upgrade.py tests/test_suite.py tests/test_batchnorm_choice.py \
		tests/test_fused_batchnorm.py tests/test_dense_blocks.py

lint: $(STAMP)
	$(BIN)/ruff check odtd tests scripts
	$(BIN)/vermin -t=3.6- --no-tips --violations --eval-annotations odtd/trainer odtd/atomic.py odtd/errors.py
	# Annotations are not evaluated on 3.8 (`from __future__ import annotations`), so not checked.
	$(BIN)/vermin -t=3.8- --no-tips --violations --exclude-regex 'odtd/trainer/.*' odtd

bench: $(STAMP)
	$(BIN)/python scripts/bench_trainer.py --json
	$(BIN)/python scripts/bench_telemetry.py --json
	$(BIN)/python scripts/bench_memory.py --json

clean:
	rm -rf $(VENV) $(COMPAT) demo-home .pytest_cache .ruff_cache
