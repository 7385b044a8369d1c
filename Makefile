# attngen: spec-driven CUDA attention kernels. `make help` lists the targets.
PYTHON ?= python3
SPEC ?=
FILTER ?= *
JOBS ?=

SHELL := /bin/bash
.PHONY: help setup gen build tune test gpu-test gpu-check bench report list info clean

help:
	@echo "setup      install what a fresh machine lacks (torch if missing, jinja2, pyyaml, ninja, pytest)"
	@echo "gen        generate generated/ from specs/ (python -m codegen gen)"
	@echo "build      gen, then ninja: the torch extension, or every kernel cubin without CUDA torch"
	@echo "test       CPU tiers: unit, compile (nvcc), reference"
	@echo "gpu-test   gpu tier (needs the built extension and a GPU)"
	@echo "gpu-check  on the GPU machine: build, gpu tests, sanitizers, quick bench; logs under \$$OUT"
	@echo "bench      side-by-side benchmarks, results under bench/results/<gpu>/"
	@echo "tune       autotune SPEC's grids on the GPU (SPEC=specs/x.yaml; BUCKETS=\"a b\": those buckets only), write tuned/<arch>/, then make gen"
	@echo "report     static resource report of the built cubins (registers, spills, occupancy, bank ways) and the roofline of the committed benchmarks, into build/report/ (REFRESH=1: the committed bench/results/h100/; no GPU)"
	@echo "list       instances a build would contain (FILTER=glob)"
	@echo "info       what this build holds: families, instances, arch, torch, tuned tables (python -m attngen.info)"
	@echo "clean      remove build/"

setup:
	@$(PYTHON) -c "import torch; print('setup: torch', torch.__version__, 'is installed')" 2>/dev/null \
	  || { echo "setup: installing torch 2.13.0 (no torch found)"; $(PYTHON) -m pip install -q torch==2.13.0; }
	@echo "setup: installing what requirements.txt lists: $$(grep -o '^[a-z0-9-]*' requirements.txt | tr '\n' ' ')"
	$(PYTHON) -m pip install -q -r requirements.txt

gen:
	$(PYTHON) -m codegen gen $(SPEC)

build: gen
	$(PYTHON) -m codegen build $(if $(JOBS),-j $(JOBS))

test:
	$(PYTHON) -m pytest -q tests
	@echo "(the gpu tier, tests marked gpu, is deselected here: run 'make gpu-test' on a machine with a GPU and the built extension)"

gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests

gpu-check:
	bash bench/gpu_check.sh

bench:
	$(PYTHON) -m bench.causal_linear && $(PYTHON) -m bench.rwkv && $(PYTHON) -m bench.paged && $(PYTHON) -m bench.flash_attention && $(PYTHON) -m bench.flash_attention_fp8 && $(PYTHON) -m bench.flash_attention_grad && $(PYTHON) -m bench.delta_rule && $(PYTHON) -m bench.paged_attention

tune:
	$(PYTHON) -m codegen tune $(or $(SPEC),specs/causal_linear.yaml) $(if $(JOBS),-j $(JOBS)) $(foreach b,$(BUCKETS),--bucket $(b))

# build/report/ unless REFRESH=1, which rewrites the committed copy in bench/results/h100/.
REPORT_DIR = $(if $(REFRESH),bench/results/h100,build/report)
report:
	$(PYTHON) -m codegen report --out $(REPORT_DIR) && $(PYTHON) -m bench.roofline --out $(REPORT_DIR)

list:
	@$(PYTHON) -m codegen list --filter '$(FILTER)' $(SPEC)

info:
	$(PYTHON) -m attngen.info

clean:
	rm -rf build
