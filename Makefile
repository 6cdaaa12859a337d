# The two front-door commands. Each creates .venv on first use and installs the project into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opd pretrain
	$(VENV)/bin/opd train --set family=llama --run-dir runs/demo-llama --overwrite
	$(VENV)/bin/opd train --set family=qwen3 --run-dir runs/demo-qwen3 --overwrite

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
