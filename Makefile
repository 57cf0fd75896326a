# The two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both build (once) the cached virtualenv keyed by requirements/runtime.txt and
# resolve (once) the Kafka broker jars from Maven Central; nothing is installed by hand.
SHELL := /bin/bash
RUN := scripts/with-venv.sh

.PHONY: demo demo-mqtt test chaos soak unit integration lint bench-ingest broker-start broker-stop venv clean help

help:
	@echo "make demo   - local Kafka broker + 10 simulated devices + workers, live view, summary"
	@echo "make demo-mqtt - real smartwatch data over MQTT -> bridge -> Kafka -> workers, held-out accuracy"
	@echo "make test   - the full test suite (unit + integration against the real broker)"
	@echo "make chaos  - the long fault runs on the real stack (3-broker cluster, testbed hosts; root)"
	@echo "make soak   - 30 minutes with device bursts: memory, buffers, lag, accounting (benchmarks/results/soak.*)"
	@echo "make unit | integration | lint | bench-ingest | broker-start | broker-stop | clean"

venv:
	@bash scripts/venv.sh >/dev/null

demo: venv
	@$(RUN) python -m edgestream run --job examples/demo.toml --garbage 3

# Real smartwatch data (BasicMotions, converted once) published over MQTT to a local
# Mosquitto, bridged into Kafka and trained on (docs/devices.md). DEMO_ARGS: e.g. --publish 40.
demo-mqtt: venv
	@bash scripts/system-deps.sh
	@$(RUN) python scripts/demo_mqtt.py $(DEMO_ARGS)

# One file per process, in the order given: the long integration files first, then the
# ~110 unit files, most of them short, which even out the processes' ends (xdist's
# default order, most tests first, left the long integration files, with one to five
# tests each, as the tail of the run). Three processes on two cores: the integration
# tests wait on brokers and streams much of the time (the cores were about a fifth idle
# with two).
test: venv
	@bash scripts/system-deps.sh
	@bash scripts/deploy-tools.sh >/dev/null
	@bash scripts/fuzz-deps.sh
	@$(RUN) python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=25 tests/integration tests/unit

chaos: venv
	@bash scripts/system-deps.sh
	@$(RUN) python -m pytest -q -p no:cacheprovider tests/chaos

soak: venv
	@bash scripts/system-deps.sh
	@$(RUN) python -m edgestream bench soak $(SOAK_ARGS)

unit: venv
	@$(RUN) python -m pytest -q tests/unit

integration: venv
	@$(RUN) python -m pytest -q tests/integration

lint: venv
	@$(RUN) ruff check edgestream cli job pipeline streams trainers compression monitoring deploy tests benchmarks

bench-ingest: venv
	@$(RUN) python -m edgestream bench ingest

broker-start: venv
	@$(RUN) python -m edgestream broker start

broker-stop: venv
	@$(RUN) python -m edgestream broker stop

clean:
	rm -rf .edgestream .pytest_cache

# The worker container image (deploy/container/): buildah, no daemon or registry needed;
# slow the first time (debootstrap base + torch wheels), not part of `make test`.
.PHONY: image
image:
	@bash deploy/container/build.sh

# Coverage-guided fuzzing of the decoders (tests/fuzz/README.md): FUZZ_TARGETS (default
# all) in turn for FUZZ_SECONDS each (default 600), growing the work corpus in
# .edgestream/fuzz/; `make test` runs each for a few seconds. FUZZ_ARGS: e.g. --jobs 2.
.PHONY: fuzz
FUZZ_SECONDS ?= 600
FUZZ_TARGETS ?= all
fuzz: venv
	@bash scripts/fuzz-deps.sh
	@$(RUN) python -m tests.fuzz.run $(FUZZ_TARGETS) --seconds $(FUZZ_SECONDS) $(FUZZ_ARGS)
