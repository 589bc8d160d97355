# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap
# what is missing (OpenMPI, a virtualenv, torch, a cached Horovod build).
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: bootstrap demo test test-fast test-netns lint typecheck protos bench bench-crossover clean

bootstrap: $(STAMP)

$(STAMP): scripts/bootstrap.sh requirements-dev.txt setup.py
	./scripts/bootstrap.sh
	touch $@

# pytest exits 5 when it collects nothing, so an empty run cannot pass.
test: bootstrap typecheck
	.venv/bin/ruff check client daemon plugins scripts tests bench
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra

test-fast: bootstrap
	$(PY) -m pytest -ra -m "not multiprocess and not netns"

demo: bootstrap
	$(PY) scripts/demo.py

lint: bootstrap
	.venv/bin/ruff check client daemon plugins scripts tests bench

# mypy cannot see through the editable install's import hook: check a regular install instead.
typecheck: bootstrap
	rm -rf build/typecheck && .venv/bin/pip install -q --no-deps --no-build-isolation --no-index --target build/typecheck .
	cd build/typecheck && ../../.venv/bin/mypy --ignore-missing-imports --exclude '_pb2' crossover

protos: bootstrap
	$(PY) scripts/gen_protos.py

bench: bootstrap
	$(PY) bench/overhead.py

bench-crossover: bootstrap
	$(PY) bench/crossover.py

test-netns: bootstrap
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra -m netns tests/netns

clean:
	rm -rf .venv build *.egg-info results .pytest_cache
