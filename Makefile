# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed

.PHONY: install test test-fleet test-fleet-faults quick test-compat test-tx2 tx2-tests tx2-sqlite demo lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[trainer,dev,fleet]'
	@touch $(STAMP)

install: $(STAMP)

# odtd's modules are compiled first: the tests start hundreds of Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (the development machine's environment sets it) each would
# compile the odtd modules it imports again: about 0.1 s of CPU for the CLI's.
# Three pytest workers on two cores: most tests wait on subprocesses (the trainer worker, the
# daemon); tests/conftest.py gives the TensorFlow workers they start one thread per pool.
# `--dist worksteal`: a pytest worker that runs out of tests takes some of another's queue, so
# the run does not end on one worker working through a batch of slow tests alone.
# The fleet's test (tests/test_fleet.py, marked `fleet`) is dealt first (tests/conftest.py): a
# minute, most of it Flower's processes polling, beside the others.
# A fleet's slow faults (tests/test_fleet_faults.py: a killed SuperNode, a minute of Flower's
# heartbeat patience) are `make test-fleet-faults`', which .ci/run runs after it.
test: $(STAMP)
	@$(BIN)/python -m compileall -q odtd
	$(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not fleet_faults"

# The fleet's tests alone: three devices through Flower's real SuperLink, SuperNodes and
# `flwr run`, and a device's SuperNode killed mid-round (two devices), side by side.
test-fleet: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "fleet or fleet_faults" tests/test_fleet.py tests/test_fleet_faults.py

test-fleet-faults: $(STAMP)
	$(BIN)/python -m pytest -q -m fleet_faults tests/test_fleet_faults.py

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
		tests/test_fused_batchnorm.py tests/test_dense_blocks.py tests/test_divergence.py

# The stack a Jetson TX2 ships (JetPack 4.6): the daemon on Python 3.8, the worker on Python 3.6
# with NVIDIA's TensorFlow 2.7. PyPI has its two halves for x86_64: Python 3.6 with TensorFlow
# 2.6.2 and Python 3.7 with 2.7.4; each worker runs beside the daemon's 3.8 venv, which holds odtd
# as `pip install .` installs it (not editable). Interpreters from PATH or pyenv
# (scripts/find_python.sh); without a Python 3.6 or 3.8 the target says so and passes.
TX2_DAEMON := .venv-tx2-daemon
TX2_PY36 := .venv-tx2-py36
TX2_PY37 := .venv-tx2-py37
ODTD_SOURCES := $(wildcard odtd/*.py odtd/*/*.py odtd/*/*/*.py odtd/*.yaml)
# The core tests (test-compat's and more) on the daemon's Python 3.8: those of the worker's
# TensorFlow code with each worker, those of the daemon's side (which start workers too) with the
# Python 3.6 one. Left out: two scenarios that hold only for the tinycnn that seed 7 draws under
# TensorFlow >= 2.15 (other seeds fail them on the main stack as well).
TX2_WORKER_TESTS := tests/test_tx2.py tests/test_worker.py tests/test_byom.py tests/test_arithmetic.py \
	tests/test_suite.py tests/test_batchnorm_choice.py tests/test_fused_batchnorm.py \
	tests/test_dense_blocks.py tests/test_pool_first.py
TX2_DAEMON_TESTS := tests/test_tx2_install.py tests/test_session.py tests/test_learning.py \
	tests/test_upgrade.py tests/test_keras_dialects.py tests/test_precision.py tests/test_store.py \
	tests/test_ingest.py tests/test_config.py tests/test_daemon.py tests/test_control.py \
	tests/test_scheduler.py tests/test_divergence.py
TX2_DESELECT := --deselect tests/test_worker.py::test_trained_share_auto_keeps_the_best_share_that_spares_the_reference \
	--deselect tests/test_worker.py::test_distillation_holds_the_served_models_predictions_on_rehearsed_images

$(TX2_DAEMON)/.deps: pyproject.toml
	scripts/make_venv.sh $(TX2_DAEMON) 3.8 pip . pytest 'pytest-xdist>=3.2' h5py 'vermin>=1.6'
	@touch $@

$(TX2_DAEMON)/.installed: $(TX2_DAEMON)/.deps $(ODTD_SOURCES)
	$(TX2_DAEMON)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	@touch $@

$(TX2_PY36)/.installed:
	scripts/make_venv.sh $(TX2_PY36) 3.6 'pip<22' 'tensorflow==2.6.2'
	@touch $@

$(TX2_PY37)/.installed:
	scripts/make_venv.sh $(TX2_PY37) 3.7 'pip<24.1' 'tensorflow==2.7.4'
	@touch $@

test-tx2: $(STAMP)
	@start=$$(date +%s); \
	if ! scripts/find_python.sh 3.8 >/dev/null || ! scripts/find_python.sh 3.6 >/dev/null; then \
		echo "test-tx2: skipped: no Python 3.6 or 3.8 here (pyenv install 3.6 3.8)"; exit 0; fi; \
	$(MAKE) --no-print-directory tx2-tests || exit 1; \
	echo "test-tx2: $$(( $$(date +%s) - start )) s"

# Ubuntu 18.04's SQLite (3.22; 3.21 built here, scripts/build_sqlite.sh) under the daemon's tests
# where npm and a C compiler can build it; this machine's otherwise (or where the build fails,
# say without the npm registry), said in one line.
TX2_SQLITE := .sqlite-tx2
TX2_SQLITE_LIB := $(TX2_SQLITE)/lib/libsqlite3.so.0
tx2-sqlite:
	@if [ -f $(TX2_SQLITE_LIB) ]; then :; \
	elif ! command -v npm >/dev/null || ! command -v cc >/dev/null; then \
		echo "test-tx2: the daemon's tests on this machine's SQLite: no npm or cc to build a TX2's"; \
	elif ! scripts/build_sqlite.sh $(TX2_SQLITE); then rm -rf $(TX2_SQLITE); \
		echo "test-tx2: the daemon's tests on this machine's SQLite: building a TX2's failed (above)"; fi

tx2-tests: $(TX2_DAEMON)/.installed $(TX2_PY36)/.installed tx2-sqlite
	env $$([ -f $(TX2_SQLITE_LIB) ] && echo LD_LIBRARY_PATH=$(abspath $(TX2_SQLITE))/lib \
		ODTD_TEST_SQLITE_VERSION=$$(sed -n 's/^#define SQLITE_VERSION *"\(.*\)"/\1/p' $(TX2_SQLITE)/include/sqlite3.h)) \
	ODTD_TEST_WORKER_PYTHON=$(abspath $(TX2_PY36))/bin/python $(TX2_DAEMON)/bin/python -m pytest -q \
		-n 2 --dist worksteal -p no:cacheprovider --durations=5 $(TX2_WORKER_TESTS) $(TX2_DAEMON_TESTS) \
		$(TX2_DESELECT)
	@if scripts/find_python.sh 3.7 >/dev/null; then \
		$(MAKE) --no-print-directory $(TX2_PY37)/.installed && \
		ODTD_TEST_WORKER_PYTHON=$(abspath $(TX2_PY37))/bin/python $(TX2_DAEMON)/bin/python -m pytest \
			-q -n 2 --dist worksteal -p no:cacheprovider --durations=5 $(TX2_WORKER_TESTS) $(TX2_DESELECT); \
	else echo "test-tx2: the Python 3.7 / TensorFlow 2.7 worker skipped: no Python 3.7 here"; fi

lint: $(STAMP)
	$(BIN)/ruff check odtd tests scripts
	# The layering (pyproject.toml's [tool.importlinter] contracts; docs/architecture.md).
	$(BIN)/lint-imports
	$(BIN)/vermin -t=3.6- --no-tips --violations --eval-annotations odtd/trainer odtd/atomic.py odtd/errors.py
	# Annotations are not evaluated on 3.8 (`from __future__ import annotations`), so not checked.
	$(BIN)/vermin -t=3.8- --no-tips --violations --exclude-regex 'odtd/trainer/.*' odtd

bench: $(STAMP)
	$(BIN)/python scripts/bench_trainer.py --json
	$(BIN)/python scripts/bench_telemetry.py --json
	$(BIN)/python scripts/bench_memory.py --json

clean:
	rm -rf $(VENV) $(COMPAT) $(TX2_DAEMON) $(TX2_PY36) $(TX2_PY37) $(TX2_SQLITE) demo-home .pytest_cache .ruff_cache
