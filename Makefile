# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap
# what is missing (OpenMPI, a virtualenv, torch, a cached Horovod build).
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: bootstrap demo test test-fast test-netns lint typecheck protos bench bench-emulated clean

bootstrap: $(STAMP)

$(STAMP): scripts/bootstrap.sh requirements-dev.txt setup.py
	./scripts/bootstrap.sh
	touch $@

# Two runs. The in-process tiers mostly wait on sockets and timeouts (about 28 s of CPU in
# 60 s), so three workers share them, a file each (`loadfile` keeps module fixtures whole).
# Every other tier starts real jobs that fill both cores and time what they do: one at a time.
# pytest exits 5 when it collects nothing, so an empty run cannot pass.
# mypy (12 s on a fresh clone, one core) runs beside the first run; either failing fails the target.
IN_PROCESS := tests/unit tests/integration tests/fuzz
test: bootstrap
	.venv/bin/ruff check .
	.venv/bin/mypy & mypy=$$!; \
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra -n 3 --dist loadfile $(IN_PROCESS); tests=$$?; \
	wait $$mypy && exit $$tests
	CROSSOVER_TEST_STRICT=1 $(PY) -m pytest -ra --durations=25 $(addprefix --ignore=,$(IN_PROCESS))

# The inner loop: lint, then the unit and integration tiers (in-process daemons; about 50 s on 2 cores).
test-fast: bootstrap
	.venv/bin/ruff check .
	$(PY) -m pytest -ra -q -n 3 --dist loadfile tests/unit tests/integration

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
	rm -rf .venv build *.egg-info .pytest_cache results/demo
