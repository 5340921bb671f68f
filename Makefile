# Two commands on a fresh machine with python3, pip and make: `make demo`, `make test`.
PYTHON ?= python3
UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
# The tests marked `lowest_prefect` also run on the lowest Prefect pyproject.toml allows, in here.
VENV_LOWEST := .venv-lowest
# `make test` keeps the lowest-Prefect run's output here until the main suite is done.
LOWEST_LOG := .test-lowest.log
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export UV_PYTHON_DOWNLOADS := never

.PHONY: demo demo-stop deploy-local worker-local e2e test test-main test-lowest test-lowest-beside lint bench clean

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# --compile-bytecode (about 30 s): where PYTHONDONTWRITEBYTECODE is set, as on this
# machine, every process would otherwise compile each module it imports from source.
$(VENV)/.synced: $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --compile-bytecode --python $(PYTHON)
	touch $@

# The lock's pins with Prefect at its lower bound (tests/support/lowest_prefect.py).
$(VENV_LOWEST)/.synced: $(UV) pyproject.toml uv.lock tests/support/lowest_prefect.py
	rm -rf $(VENV_LOWEST)
	$(UV) venv --quiet --python $(PYTHON) $(VENV_LOWEST)
	$(UV) export --frozen --no-hashes --no-emit-project --quiet \
		| $(PYTHON) tests/support/lowest_prefect.py > $(VENV_LOWEST)/requirements.txt
	VIRTUAL_ENV=$(VENV_LOWEST) $(UV) pip install --quiet --compile-bytecode \
		-r $(VENV_LOWEST)/requirements.txt
	VIRTUAL_ENV=$(VENV_LOWEST) $(UV) pip install --quiet --no-deps -e .
	touch $@

demo: $(VENV)/.synced
	$(VENV)/bin/python deployments/local_server.py -- $(VENV)/bin/python blocks/save_local.py
	$(VENV)/bin/python deployments/local_server.py -- $(VENV)/bin/python flows/quickstart.py

# The quickstart sweep as deployments (deployments/prefect.yaml) on a `kinetic` work pool of
# the local Prefect server, started if none answers. Then `make worker-local` and
# `prefect deployment run quickstart-sweep/sweep`.
deploy-local: $(VENV)/.synced
	$(VENV)/bin/python deployments/local_server.py -- sh -c '\
		$(VENV)/bin/prefect block register -m kinetic_prefect && \
		{ $(VENV)/bin/prefect work-pool inspect kinetic >/dev/null 2>&1 || \
		  $(VENV)/bin/prefect work-pool create --type kinetic kinetic; } && \
		$(VENV)/bin/prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --all'

# A worker for the `kinetic` pool, in the foreground (Ctrl-C stops it; running pods go on).
worker-local: $(VENV)/.synced
	$(VENV)/bin/python deployments/local_server.py -- env PREFECT_WORKER_ENABLE_CANCELLATION=true \
		$(VENV)/bin/prefect worker start --pool kinetic

# Not part of `make test`: needs Debian's chromium (apt-get install chromium).
e2e: $(VENV)/.synced
	@test -x /usr/bin/chromium || (echo "make e2e needs Debian's chromium: apt-get install chromium" && exit 1)
	$(UV) sync --frozen --compile-bytecode --group e2e --python $(PYTHON)
	$(MAKE) demo
	$(VENV)/bin/python deployments/local_server.py -- $(VENV)/bin/python flows/pretrain_finetune.py
	$(VENV)/bin/python deployments/local_server.py -- $(VENV)/bin/python tests/e2e/ui_screenshots.py

demo-stop: $(VENV)/.synced
	$(VENV)/bin/python deployments/local_server.py --stop

# Four pytest workers share the suite (many cases wait on pods and timeouts rather than
# use a CPU); tests/support/scheduling.py says how: the worker tests on one worker.
# Beside it, the tests marked `lowest_prefect` (the private-API adapters' tests and the
# conformance tests) on the lowest Prefect that pyproject.toml allows, with that
# environment's set-up: about a minute on one core, which the main suite leaves idle
# while its cases wait. Its output follows the main suite's.
# A failure in either, or collecting no test (pytest's exit 5), fails.
test: $(VENV)/.synced $(UV)
	# The project's own bytecode, once: where PYTHONDONTWRITEBYTECODE is set, every pod and
	# process would compile the modules it imports from here (about 0.2 s each).
	$(VENV)/bin/python -m compileall -q kinetic_prefect tests flows blocks deployments
	@rm -f $(LOWEST_LOG)
	@$(MAKE) --no-print-directory -j2 test-main test-lowest-beside; status=$$?; \
		echo "=== make test-lowest (ran beside the main suite) ==="; \
		cat $(LOWEST_LOG) 2>/dev/null || echo "(no output: it did not start)"; \
		exit $$status

test-main: $(VENV)/.synced
	$(VENV)/bin/python -m pytest -n 4 --dist loadgroup

test-lowest-beside:
	@$(MAKE) --no-print-directory test-lowest > $(LOWEST_LOG) 2>&1

test-lowest: $(VENV_LOWEST)/.synced
	$(VENV_LOWEST)/bin/python -c 'import prefect; print("Conformance on prefect", prefect.__version__)'
	# Two workers: each starts a Prefect server, which costs more here than the tests share.
	$(VENV_LOWEST)/bin/python -m pytest -n 2 --dist loadgroup -m lowest_prefect \
		-o cache_dir=$(VENV_LOWEST)/.pytest_cache

lint: $(VENV)/.synced
	$(VENV)/bin/ruff check kinetic_prefect tests flows blocks
	$(VENV)/bin/ruff format --check kinetic_prefect tests flows blocks
	$(VENV)/bin/mypy kinetic_prefect

bench: $(VENV)/.synced
	for b in tests/benchmarks/bench_*.py; do $(VENV)/bin/python $$b; done

clean:
	rm -rf $(VENV) $(VENV_LOWEST) $(TOOLS) .kinetic
