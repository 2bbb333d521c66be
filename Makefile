# Two commands do everything on a fresh machine (README): `make demo` and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: setup demo test test-slow check lint render cluster-up cluster-down image clean

setup:
	@scripts/setup.sh

## Main job: start the built-in two-node Slurm cluster and run the whole GPT chain on it.
demo: setup
	scripts/cluster.sh up
	. $${MDPP_CLUSTER_DIR:-.cluster}/env && $(PYTHON) -m workflows.submit gpt --nodes 2 --wait

## Every CPU test tier (unit, dist, slurm) plus the golden sbatch check, less the tests marked slow.
## CI runs exactly this.
test: setup
	$(PYTHON) -m workflows.render --check
	$(PYTHON) -m pytest -m "not gpu and not slow" --durations=25 tests

## The tests marked slow (broad sweeps, long end-to-end runs): what `make test` leaves out.
test-slow: setup
	$(PYTHON) -m pytest -m "slow and not gpu" tests

lint:
	$(PYTHON) -m ruff check trainer workflows tests

check: lint test

render:
	$(PYTHON) -m workflows.render

cluster-up:
	scripts/cluster.sh up

cluster-down:
	scripts/cluster.sh down

## The CPU enroot image of the containers tier, without Docker (root; installs debootstrap and
## squashfs-tools itself). The tier also needs enroot and Pyxis: docs/workflows.md gives the order.
image:
	containers/build-offline.sh

clean:
	rm -rf build *.egg-info .pytest_cache benchmark runs
