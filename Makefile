# pdlib's two set-up commands (README "Quick start"): `make demo` and `make test`.
# Both install what is missing (scripts/install-deps.sh), configure and build first.
#   make demo DEMO_ARGS="--rates 0,20 --requests 32"   pass flags to pd-demo (pd-demo --help)
#   make test PRESET=asan     run the tests of another CMake preset (release|debug|asan|tsan)
#   make bench                run the microbenchmarks
#   make format / format-check
PRESET ?= release
JOBS ?= $(shell nproc)
BUILD_DIR := build/$(PRESET)
# CI builds treat warnings as errors. CI's release build keeps line tables only (-g1, as the
# sanitizer presets do): a third less to compile and link on CI's two cores (docs/DEVELOPERS.md,
# "CI time"); a local release build keeps full debug info.
CI_RELEASE_FLAGS := "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
CMAKE_FLAGS := $(if $(CI),-DPDLIB_WERROR=ON,) \
  $(if $(CI),$(if $(filter release,$(PRESET)),$(CI_RELEASE_FLAGS),),) $(CMAKE_EXTRA_FLAGS)

.PHONY: all deps configure build test demo bench format format-check clean
all: build

deps:
	@scripts/install-deps.sh

configure: deps
	@mkdir -p build
	cmake --preset $(PRESET) $(CMAKE_FLAGS) > $(BUILD_DIR).configure.log 2>&1 || \
	  (cat $(BUILD_DIR).configure.log; exit 1)
	@grep -E '^-- pdlib' $(BUILD_DIR).configure.log || true

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS) || { scripts/ctest-failures.sh $(BUILD_DIR); exit 8; }

# Builds only what the demo runs (pd-demo, the hosts, the router, pdlib-bootstrap).
demo: configure
	cmake --build --preset $(PRESET) -j $(JOBS) --target pd-demo
	$(BUILD_DIR)/examples/demo/pd-demo $(DEMO_ARGS)

bench: build
	$(BUILD_DIR)/bench/pdlib_micro_bench

FORMAT_FILES = $(shell git ls-files '*.h' '*.cc' '*.cu' '*.cuh' 2>/dev/null)
format:
	clang-format -i $(FORMAT_FILES)

format-check:
	@clang-format --dry-run --Werror $(FORMAT_FILES) && echo "format-check: $(words $(FORMAT_FILES)) files clean"

clean:
	rm -rf build
