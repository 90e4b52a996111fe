# Everything starts from nothing: `make demo` and `make test` create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean browser lint validate-plan native

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0, the CPU wheel available offline on this machine kind.
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,torch,web,browser-tests,s3,gguf,orbax,flax,pictures,notebook]"
	# DeepSpeed (the ZeRO test fixtures) builds against the torch installed above, so it comes after it, without
	# build isolation; the constraints keep that torch.
	$(BIN)/pip install --quiet --no-build-isolation -c constraints.txt "deepspeed>=0.19,<0.20"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py $(DEMO_ARGS)

# The browser tests drive Debian's chromium (no browser download); without root or apt they skip loudly.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "WARNING: could not install Debian's chromium; the browser tests will be skipped"

# The native parts (setup.py: the DCP metadata reader, the GF(2^8) kernel of parity), rebuilt in place when their
# sources changed since the install.
native: $(STAMP)
	@$(BIN)/python setup.py -q build_ext --inplace >/dev/null 2>&1; \
		$(BIN)/python -c "import tensormorph.formats._dcp_pickle, tensormorph.tmformat._gf256" 2>/dev/null \
		|| echo "WARNING: the native parts did not build (no C compiler?): DCP metadata and parity take the slower way"

# Lint, types and the layer contracts first: they take seconds and fail fast.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports

test: $(STAMP) native browser lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# The planner's memory against llama.cpp's own (issue 19); not part of `make test`. llama-cpp-python compiles
# llama.cpp here (10-20 min on 2 cores, CPU only), so it lives in its own venv, made from the project's python.
VALIDATE := .venv-validate
validate-plan: $(STAMP)
	test -x $(VALIDATE)/bin/python || $(BIN)/python -m venv $(VALIDATE)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
		-DLLAMA_BUILD_SERVER=OFF" $(VALIDATE)/bin/pip install --quiet -c constraints.txt "llama-cpp-python==0.3.36" gguf -e .
	$(VALIDATE)/bin/python -m benchmarks.validate_plan

clean:
	rm -rf $(VENV) $(VALIDATE) demo tests/.fixture-cache benchmarks/.work
