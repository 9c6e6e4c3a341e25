# make setup | demo | test | test-cuda12 | lint | fuzz | test-gpu | sanitize (memcheck, racecheck)
# | bench | clean
# setup/demo/test/lint use a local .venv; test-gpu and bench run on the GPU machine, where
# nothing can be installed, with the system python3 and the source tree on PYTHONPATH.

PYTHON ?= python3
VENV := .venv
# torch for the CPU tests of fuser.torch (custom ops, fake tensors, modules' shapes and state
# dicts). torch 2.13.0 is a CPU build on this workplace's machines (19 s to install); elsewhere
# pip fetches a CUDA build. TORCH= leaves torch out, and those tests skip.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.stamp

.PHONY: setup demo test test-cuda12 test-gpu sanitize memcheck racecheck synccheck initcheck bench lint clean fuzz

setup: $(STAMP)

# Reinstall only when pyproject.toml is newer than the last install. The CUDA packages are the
# cuda13 extra. Before 0.2.0 the distribution was named fuser: a .venv made then still has it,
# and two distributions would claim the package (pip says "Skipping" where there is none).
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip uninstall -q -y fuser
	$(VENV)/bin/python -m pip install -e '.[cuda13,dev,bench,sass]' $(TORCH)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/python -m fuser demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -m "not gpu" -q

# The offline path on CUDA 12, in a venv of its own (only one cupy-cuda* wheel may be installed)
# with the cuda12 extra (cupy-cuda12x, cuda-bindings 12.9, NVRTC 12.9 and its headers): every
# kernel variant rendered against its golden and compiled by NVRTC 12 with zero spills, show,
# the wheel. (tests/test_kernels.py's 128-input row sum builds spill-free there too, but after
# 31 compiles where ptxas 13.5 needs one, so that count fails with NVRTC 12.9.)
VENV12 := .venv-cuda12
CUDA12_TESTS ?= tests/test_offline_compile.py tests/test_compile.py tests/test_goldens.py \
  tests/test_cli.py tests/test_packaging.py
test-cuda12: $(VENV12)/.stamp
	$(VENV12)/bin/python -m fuser --version
	$(VENV12)/bin/python -c "from fuser.compile import nvrtc_version as v; assert v()[0] == 12, v()"
	$(VENV12)/bin/python -m pytest -m "not gpu" -q -p no:cacheprovider $(CUDA12_TESTS) $(PYTEST_ARGS)

$(VENV12)/.stamp: pyproject.toml
	test -x $(VENV12)/bin/python || $(PYTHON) -m venv $(VENV12)
	$(VENV12)/bin/python -m pip install -e '.[cuda12,dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Random fusions (tests/fuzz_fusions.py) through analyze -> schedule -> plan checks -> render ->
# NVRTC on the CPU: FUZZ_CASES cases in FUZZ_SHARDS Hypothesis shards over FUZZ_JOBS
# pytest-xdist workers, FUZZ_NVRTC per mille of them compiled (1000: every rendered kernel),
# then the outcome counts. A failure prints its shrunk repr(fd); FUSER_FUZZ_STRICT=1 fails on
# the filed failure classes too; FUSER_FUZZ_SEED=n draws other cases.
FUZZ_CASES ?= 10000
FUZZ_SHARDS ?= 40
FUZZ_JOBS ?= 8
FUZZ_NVRTC ?= 1000
FUZZ_REPORT := build/fuzz
fuzz: setup
	rm -rf $(FUZZ_REPORT)
	FUSER_FUZZ_CASES=$(FUZZ_CASES) FUSER_FUZZ_SHARDS=$(FUZZ_SHARDS) FUSER_FUZZ_NVRTC=$(FUZZ_NVRTC) \
	  FUSER_FUZZ_REPORT=$(FUZZ_REPORT) $(VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  -n $(FUZZ_JOBS) -k fuzz_shard tests/test_fuzz.py $(PYTEST_ARGS); \
	  status=$$?; $(VENV)/bin/python tests/fuzz_fusions.py summary $(FUZZ_REPORT); exit $$status

# FUSER_REQUIRE_GPU=1 turns a missing GPU into errors instead of skips.
test-gpu:
	FUSER_REQUIRE_GPU=1 PYTHONPATH=. python3 -m pytest -m gpu -q $(PYTEST_ARGS)

# compute-sanitizer (GPU machine), through tests/sanitize.py: one sanitizer process per test,
# SANITIZE_JOBS at a time, so racecheck of the cluster kernels fits one 10-minute device call.
# memcheck / synccheck / initcheck: the seed case, every row storage (registers, smem,
# re-read), a persistent kernel of each fusion (4096 x 7 rows), a cluster-split kernel of each
# fusion, aligned-copy kernels (24578 x 400, and over forced clusters), and a staging ring of
# each fusion (bulk, cp.async and cluster, 400 rows). racecheck, about ten times slower: one
# persistent and one cluster-split kernel of each fusion, the aligned copies at 24578 and four
# rings; the outer-persistent kernels at every cluster size (racecheck: the backward's);
# skewed rows at 24578 in exact allocations (1 and 7 rows: the last row's edge), and the
# column sums of skewed rows (130, 5003 rows, one to four rows a block); rows held in
# registers, streamed slabs wider than 128 bytes and a spread masked mean. API
# errors are not reported: cuda-bindings probes the driver's entry points with
# cuGetProcAddress, and every probe this driver lacks counts as one (34 on the H200's 580
# driver); fuser raises on any API error it gets itself.
SANITIZE_TESTS ?= seed_case or each_storage_path or 4096-7-BFloat16 or cluster2 or (aligned_copy_matches_reference and 24578-400) or aligned_copy_over_a_forced_cluster or (staging_ring and 400-BFloat16) or (every_cluster_size and 1001) or exact_allocations or (column_sums and 130 and 5003) or rows_held or (wider_slabs and mean) or (masked_mean_matches and column_kernel and BFloat16)
RACECHECK_TESTS ?= 4096-7-BFloat16 or cluster2 or (aligned_copy_matches_reference and 24578-400-BFloat16) or (staging_ring and 400-BFloat16 and ((softmax_fwd-24576 and not log_softmax) or rmsnorm_bwd-4096 or rmsnorm_bwd-24578)) or (every_cluster_size and 1001 and batchnorm_bwd) or exact_allocations or (column_sums and 130 and 5003 and (smem or registers)) or (rows_held and Half) or (wider_slabs and mean and 2048)
SANITIZE_FILES ?= tests/test_gpu_fusions.py tests/test_gpu_outer.py tests/test_gpu_skewed.py tests/test_streamed.py tests/test_spread.py
SANITIZE_JOBS ?= 12
SANITIZE_TIMEOUT ?= 480
SANITIZE_OUT ?= build/sanitize
SANITIZER := PYTHONPATH=. python3 tests/sanitize.py --jobs $(SANITIZE_JOBS) \
  --timeout $(SANITIZE_TIMEOUT) --out $(SANITIZE_OUT)
sanitize: memcheck racecheck synccheck initcheck

memcheck synccheck initcheck:
	$(SANITIZER) --tool $@ -k "$(SANITIZE_TESTS)" $(SANITIZE_FILES)

racecheck:
	$(SANITIZER) --tool racecheck -k "$(RACECHECK_TESTS)" $(SANITIZE_FILES)

bench:
	PYTHONPATH=. python3 bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV12) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
