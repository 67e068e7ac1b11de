# Two commands matter: `make serve` and `make test`. Each does its own set-up in .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
GLM53  := $(VENV)/bin/glm53
STAMP  := $(VENV)/.installed
DEV    := $(VENV)/.installed-dev

.PHONY: serve test test-gpu lint plan preflight settings fmt clean build-image

$(STAMP): pyproject.toml setup.py docker/install.sh $(wildcard glm53/cpu_lane/*.cpp glm53/cpu_lane/*.h store/csrc/*.cpp store/csrc/*.h glm53/bench/*.cpp)
	test -x $(PY) || python3 -m venv $(VENV)
	bash docker/install.sh $(PY)
	touch $(STAMP)

# The test and lint tools (pytest, schemathesis, hadolint, the SDKs...): only `make test` and `make lint` need them.
$(DEV): $(STAMP)
	bash docker/install.sh $(PY) dev
	touch $(DEV)

serve: $(STAMP)
	$(GLM53) serve

test: $(DEV)
	bash tests/clients/install.sh
	$(PY) -m pytest -q --durations=15
	$(PY) -m pytest -q --durations=5 -m 'slow and not gpu'

test-gpu: $(DEV)
	$(PY) -m pytest -q -m gpu

lint: $(DEV)
	$(VENV)/bin/ruff check glm53 store tests
	$(VENV)/bin/shellcheck entrypoint.sh docker/*.sh tests/gpu/*.sh .ci/run
	$(VENV)/bin/hadolint Dockerfile
	$(PY) -m glm53 settings --check

plan: $(STAMP)
	$(GLM53) plan

preflight: $(STAMP)
	$(GLM53) preflight

settings: $(STAMP)
	$(GLM53) settings --write

# The image README's Docker section builds; one CUDA arch (8.6 = RTX 30xx) compiles much faster than all of them.
TORCH_CUDA_ARCH_LIST ?= 8.6
build-image:
	docker build --build-arg TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST) -t glm53 .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
