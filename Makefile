# One-command set-up on a fresh machine. `make train` runs the main job on real
# data (scikit-learn's digits, the `examples` extra) on a local Ray cluster tracked in a local MLflow
# store; `make test` runs the default test suite. Both create .venv if missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch that lies on this machine's disk. Installed first, and
# alone, so pip never resolves an unpinned torch (a CUDA build of several GB).
# Set TORCH_SPEC= (empty) to keep a torch that is already in the environment.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test test-fast test-all clean

# Quiet (-qq: errors only, no build-backend chatter): `make train` on a fresh clone
# prints one set-up line, then the job.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): pip, $(or $(TORCH_SPEC),the existing torch), elastic-ddp with the dev, examples and hf extras"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -qq "$(TORCH_SPEC)"; fi
	@$(PY) -m pip install -qq -e ".[dev,examples,hf]"
	@touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/elastic-ddp prepare digits data/digits
	$(VENV)/bin/elastic-ddp train experiments/configs/digits_cnn.yaml

# xdist workers for the tests that start no Ray cluster. Four on two cores: many of that
# pass's tests wait (a CLI subprocess's start, a server's timeout, MLflow's sqlite lock,
# gloo ranks' rendezvous), and with four the cores stay busy through the pass (on the
# 2-core CI machine: 338 s, against 387 s on two workers). `make test XDIST=2` for less memory.
XDIST ?= 4

# The default suite (`-m "not slow"`) in two passes: the tests that start no Ray cluster on
# $(XDIST) xdist workers, then the Ray tests one at a time (a Ray test's local cluster and its
# workers take the machine's cores). `--dist loadfile` gives each test file to one worker,
# so a module's fixtures (the gloo jobs of test_parallel, the checkpoints of
# test_checkpoint_sharded) run once, not once per worker. Both passes always run; the
# target fails when either fails or selects no test (pytest exit 5). The durations
# (every Ray test's, the fast tier's 15 longest) show where the suite's time goes.
# $(call two_passes,MARKS,RAY_DURATIONS): the tests without Ray (`not ray MARKS`) on
# $(XDIST) workers, then the Ray tests (`ray MARKS`) one at a time; both always run.
two_passes = rc=0; \
	$(PY) -m pytest -m "not ray$(1)" -q -n $(XDIST) --dist loadfile --durations=15 || rc=$$?; \
	$(PY) -m pytest -m "ray$(1)" -q --durations=$(2) || { r=$$?; [ $$rc -ne 0 ] || rc=$$r; }; \
	exit $$rc

test: $(STAMP)
	$(call two_passes, and not slow,0)

# Every change: the tests that start no Ray cluster (config, batching, order, readers,
# task protocol, data scan, strategies on gloo process groups).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not ray and not slow" -q -n $(XDIST) --dist loadfile

# The slow tier adds the `ui` extra (playwright's driver: tests/project/test_ui_screenshots.py).
UI_STAMP := $(VENV)/.installed-ui
$(UI_STAMP): $(STAMP)
	@$(PY) -m pip install -qq -e ".[ui]"
	@touch $(UI_STAMP)

# Every test, the slow tier included, in the same two passes as `make test`.
test-all: $(UI_STAMP)
	$(call two_passes,,30)

clean:
	rm -rf data mlruns mlflow.db ray_results outputs
