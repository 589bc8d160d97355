# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap
# what is missing (OpenMPI, a virtualenv, torch, a cached Horovod build).
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: bootstrap demo test test-fast test-netns lint typecheck protos bench bench-emulated clean

bootstrap: $(STAMP)

$(STAMP): scripts/bootstrap.sh requirements-dev.txt setup.py
	./scripts/bootstrap.sh
	touch $@

# pytest exits 5 when it collects nothing, so an empty run cannot pass.
test: bootstrap typecheck
	.venv/bin/ruff check .
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra

# The inner loop: lint, then the unit and integration tiers (in-process daemons; about 1 minute on 2 cores).
test-fast: bootstrap
	.venv/bin/ruff check .
	$(PY) -m pytest -ra -q tests/unit tests/integration

demo: bootstrap
	$(PY) -m scripts.demo

lint: bootstrap
	.venv/bin/ruff check .

# The source tree itself: the product lives in `crossover/`, so paths are import paths.
typecheck: bootstrap
	.venv/bin/mypy

protos: bootstrap
	$(PY) -m scripts.gen_protos

bench: bootstrap
	$(PY) -m bench.overhead

bench-emulated: bootstrap
	$(PY) -m bench.emulated

test-netns: bootstrap
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra -m netns tests/netns

clean:
	rm -rf .venv build *.egg-info .pytest_cache results/conformance.json results/demo
