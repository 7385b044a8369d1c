# attngen: spec-driven CUDA attention kernels. `make help` lists the targets.
PYTHON ?= python3
SPEC ?=
FILTER ?= *
JOBS ?=

.PHONY: help gen build test gpu-test gpu-check bench list clean

help:
	@echo "gen        generate generated/ from specs/ (python -m codegen gen)"
	@echo "build      gen, then ninja: the torch extension, or every kernel cubin without CUDA torch"
	@echo "test       CPU tiers: unit, compile (nvcc), reference"
	@echo "gpu-test   gpu tier (needs the built extension and a GPU)"
	@echo "gpu-check  on the GPU machine: build, gpu tests, sanitizers, quick bench; logs under \$$OUT"
	@echo "bench      side-by-side benchmarks, results under bench/results/<gpu>/"
	@echo "list       instances a build would contain (FILTER=glob)"
	@echo "clean      remove build/"

gen:
	$(PYTHON) -m codegen gen $(SPEC)

build: gen
	$(PYTHON) -m codegen build $(if $(JOBS),-j $(JOBS))

test:
	$(PYTHON) -m pytest -q tests

gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests

gpu-check:
	bash bench/gpu_check.sh

bench:
	$(PYTHON) -m bench.causal_linear

list:
	@$(PYTHON) -m codegen list --filter '$(FILTER)' $(SPEC)

clean:
	rm -rf build
