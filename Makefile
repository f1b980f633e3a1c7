# ringipam build, test and benchmark entry points. See README.md.
#
#   make build   every command into bin/
#   make test    deps, format check, vet, unit tests (-race), then the
#                integration tests (-race, real etcd/netns/docker; needs root),
#                integration/k8s last (its control plane builds meanwhile)
#   make bench   deps, build, all benchmarks (BENCHTIME each; heavy ones run once)
#   make demo    deps without Kubernetes, scripts/demo.sh (builds what it runs)
#   make lint    format check, vet (both build tags), staticcheck if installed
#   make fuzz    every fuzz target for FUZZTIME each (default 10m), keeping
#                interesting inputs in the packages' testdata/fuzz
#   make image   the OCI image (bin/ringipam-image-<git describe>.oci.tar) from a
#                Debian root filesystem (mmdebstrap) and the static binaries;
#                needs root and the Debian mirror, no registry; not in make test
#   make scale   the scale harness (integration/scale, scripts/scale.sh): N
#                simulated hosts on a real etcd, what each costs etcd;
#                SCALE_SIZES, SCALE_IDLE, SCALE_BEFORE=<commit>; then make
#                scale-churn (SCALE_CHURN_SIDE=0 leaves it out); not in make test
#   make scale-churn  10 namespace hosts x 100 pods created, deleted and created
#                again through libcni + bridge with ringipam, host-local and
#                whereabouts side by side (integration/churn; its short form
#                runs in make integration); not in make test
#   make chaos   the fault suite at full size (integration/chaos: 10 000 calls
#                under faults; its short form runs in make integration)
#   make clean   remove bin/ (distclean also removes the .cache/ tools)

SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
export PATH := /usr/local/go/bin:$(CURDIR)/.cache/bin:$(PATH)

GO            ?= go
BIN           := $(CURDIR)/bin
# Integration tests run one package at a time: they start servers, docker
# daemons and network namespaces on a 2-core machine.
INTEGRATION_TIMEOUT ?= 25m
BENCHTIME     ?= 1s
BENCH_TIMEOUT ?= 45m
BENCH         ?= .
# Every binary is stamped with scripts/version.sh's version (git describe;
# RINGIPAM_VERSION=v1.2.3 make build overrides it) and commit: see
# internal/version. `<binary> --version` prints them.
LDFLAGS       := $(shell scripts/version.sh --ldflags)

# Main packages: plugins/<name> -> bin/<name>, cmd/<name> -> bin/<name>,
# docker-driver -> bin/ringipam-docker. Directories that do not exist yet
# (or hold no Go file yet) are skipped.
define main_dirs
for d in plugins/*/ cmd/*/ docker-driver/; do \
	d=$${d%/}; \
	compgen -G "$$d/*.go" >/dev/null || continue; \
	case $$d in docker-driver) n=ringipam-docker ;; *) n=$${d##*/} ;; esac; \
	echo "$$d:$$n"; \
done
endef

.PHONY: scale scale-churn tidy-check ci-nonroot-check all build deps image test unit model-check integration integration-k8s fmt-check vet lint bench fuzz chaos demo docker-plugin clean distclean

all: build

build:
	@mkdir -p $(BIN)
	@for e in $$($(main_dirs)); do \
		d=$${e%%:*}; n=$${e##*:}; \
		echo "go build -o bin/$$n ./$$d"; \
		CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/$$n ./$$d; \
	done

# The Kubernetes control plane (integration/k8s) builds in the foreground
# for make deps; make test starts it in the background (K8S_BUILD=background)
# so that it overlaps the other suites, and integration-k8s waits for it.
K8S_BUILD ?= yes
deps:
	RINGIPAM_K8S_BUILD=$(K8S_BUILD) scripts/install-deps.sh

fmt-check:
	@out=$$(gofmt -l $$(find . -name '*.go' -not -path './.cache/*' -not -path './.git/*')); \
	if [[ -n "$$out" ]]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...
	$(GO) vet -tags integration ./...

# The exhaustive model check of pkg/containernet runs on its own, verbosely,
# so that the number of states it visited is printed.
unit:
	$(GO) test -race -skip '^TestModelCheck' ./...

# The port allocator's check is single-threaded pure code: it runs without
# -race, which would only make it six times slower. So do the ring's and the
# reclaim's (pkg/pool): their operations run one at a time, each in a
# goroutine the checker waits for; their traces and findings are shown.
model-check:
	$(GO) test -race -run '^TestModelCheck' -v ./pkg/containernet/ | grep -E -- '^(--- |ok|FAIL|PASS)|model check'
	$(GO) test -run '^TestModelCheck' -v ./pkg/portalloc/ | grep -E -- '^(--- |ok|FAIL|PASS)|model check|caught after'
	$(GO) test -timeout 20m -run '^TestModelCheck' -v ./pkg/pool/ | grep -E -- '^(--- |ok|FAIL|PASS)|model check|^ {8}'

# The run is summarised per package (passed, failed, skipped); a suite under
# integration/ that ran no test fails the target, as does any failure.
# -count=1: the suites build the plugins, driver and agent they run, which
# go test's result cache does not see, so a cached pass may not have run the
# code being tested.
# scripts/integration.sh runs the packages whose files the integration tag
# changes, and of a package that also has untagged tests (unit ran those)
# only the tests of its tagged files.
# integration/k8s runs last, on its own (integration-k8s): it needs the
# Kubernetes binaries, which may still be building when the others start.
integration:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/.testsummary ./internal/testsummary
	GO=$(GO) scripts/integration.sh $(INTEGRATION_TIMEOUT) | $(BIN)/.testsummary

K8S_TIMEOUT ?= 20m
integration-k8s:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/.testsummary ./internal/testsummary
	scripts/build-k8s.sh
	$(GO) test -json -race -tags integration -count=1 -timeout $(K8S_TIMEOUT) ./integration/k8s/ | $(BIN)/.testsummary

# As a non-root user with CI=true a real-parts suite fails and names itself.
ci-nonroot-check:
	scripts/ci-nonroot-check.sh

test: K8S_BUILD = background
test: deps fmt-check tidy-check vet unit model-check ci-nonroot-check integration integration-k8s

# go.mod and go.sum must be what `go mod tidy` makes of the code.
tidy-check:
	@if ! out=$$($(GO) mod tidy -diff 2>&1); then echo "go mod tidy would change go.mod/go.sum:"; echo "$$out"; exit 1; fi

lint: fmt-check vet tidy-check
	@if command -v staticcheck >/dev/null; then \
		staticcheck ./... && staticcheck -tags integration ./...; \
	else echo "staticcheck not installed: skipped"; fi

bench: deps build
	$(GO) test -tags integration -p 1 -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) \
		-timeout $(BENCH_TIMEOUT) ./... 2>&1 | tee bench.out

FUZZTIME ?= 10m
fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

# The fault suite at full size (10 000 CNI and Docker calls on four hosts
# and a 3-member etcd, faults in cycles until the calls are done), then the
# broken allocator it must catch. The whole output is kept in chaos.out;
# the summary lines, the faults and any finding are shown.
CHAOS_TIMEOUT ?= 60m
chaos: deps
	$(GO) test -race -tags integration -count=1 -timeout $(CHAOS_TIMEOUT) -run '^TestChaos' -v \
		./integration/chaos/ -args -chaos.full 2>&1 | tee chaos.out | \
		grep -E '^(chaos |--- |ok|FAIL|PASS)|fault:|duplicate:|leak:|lost:|unclear|linearizability:|store:'

# The scale harness: docs/benchmarks.md, "Scale: what a host costs etcd".
scale:
	scripts/scale.sh

# The churn side by side: docs/benchmarks.md, "Churn side by side". It
# builds whereabouts and kube-apiserver itself (scripts/scale-churn.sh).
scale-churn: deps
	scripts/scale-churn.sh

# The demo needs no Kubernetes: deps skips its build, and scripts/demo.sh
# builds only the four binaries it runs.
demo: K8S_BUILD = no
demo: deps
	scripts/demo.sh

# The image deploy/kubernetes/ringipam.yaml runs: see scripts/build-image.sh.
image: deps
	scripts/build-image.sh

# Managed Docker plugin: lays out bin/docker-plugin (rootfs + config.json);
# with PLUGIN_NAME=repo/name:tag it also runs docker plugin create.
PLUGIN_NAME ?=
docker-plugin: build
	GO=$(GO) docker-driver/plugin/build.sh $(BIN)/docker-plugin $(PLUGIN_NAME)

clean:
	rm -rf $(BIN) bench.out chaos.out

distclean: clean
	rm -rf .cache
