# Thin wrapper over CMake: the two commands a user needs.
#   make run   - install what running needs, build moed/moec/moe-mkset (CPU-only unless
#                RUN_GPU=AUTO|CUDA|HIP), write a demo model repository, start moed
#   make test  - install deps, build, run every test (then again under ASan+UBSan)
#   make venv  - only the Python side (.venv: numpy, ml_dtypes, tritonclient, perf_analyzer)
BUILD ?= build
ASAN_BUILD ?= build-asan
HIP_BUILD ?= build-hip
JOBS ?= $(shell nproc)
DEMO ?= demo-models
MOED_FLAGS ?=
GPU ?= AUTO
RUN_GPU ?= OFF

.PHONY: all deps venv build run-build run test test-asan build-hip demo clean

all: build

deps:
	bash scripts/deps.sh

# The Python side alone, for the README's examples after make run (which
# installs no Python): the test venv and perf_analyzer, no HIP toolchain.
venv:
	bash scripts/deps.sh --no-hip

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMOE_GPU=$(GPU)
	cmake --build $(BUILD) -j$(JOBS)

# What running needs and no more: no HIP toolchain or test venv, no GPU
# kernels (the CPU backend serves every op), only the binaries make run uses.
run-build:
	bash scripts/deps.sh --no-hip --no-python
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMOE_GPU=$(RUN_GPU)
	cmake --build $(BUILD) -j$(JOBS) --target moed moec moe-mkset

# A small expert set for trying the service (docs/expert-set.md).
demo: run-build
	@[ -f $(DEMO)/demo/config.json ] || $(BUILD)/tools/moe-mkset --out $(DEMO)/demo --scheme bf16 \
	  --experts 8 --hidden 256 --intermediate 128 --top-k 2 --seed 1

run: demo
	$(BUILD)/server/moed --model-repository $(DEMO) $(MOED_FLAGS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)
	$(MAKE) test-asan
	$(MAKE) build-hip

# The default build takes nvcc when present (the NVIDIA path); the AMD path
# is compile-checked in a build of its own (one GPU backend per build).
build-hip: deps
	@if command -v hipcc >/dev/null; then \
	  cmake -S . -B $(HIP_BUILD) -DMOE_GPU=HIP -DMOE_BUILD_SERVER=OFF && \
	  cmake --build $(HIP_BUILD) -j$(JOBS) --target moe moe_shared; \
	else echo "build-hip: skipped: hipcc not installed (scripts/deps.sh installs it)"; fi

# The C tests and moed (integration tests) again under AddressSanitizer +
# UndefinedBehaviorSanitizer; the Python oracles load libmoe through ctypes
# and run in the plain build only. Needs `make build` first (its libmoe is
# what the integration tests' Python side compares against).
test-asan: build
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DMOE_SANITIZE=ON -DMOE_GPU=OFF \
	  -DMOE_ORACLE_LIB=$(CURDIR)/$(BUILD)/kernels/libmoe.so
	cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j$(JOBS) -E '^oracle_'

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(HIP_BUILD)
