#!/usr/bin/env bash
# Runs every fuzz target for FUZZTIME each (default 10m), one at a time,
# then keeps up to KEEP of the interesting inputs each found in the
# package's testdata/fuzz/<Target>/, where `go test` replays them as
# regression seeds. A finding fails the run (go test leaves the crasher in
# testdata/fuzz too: fix it, keep the file as its regression test).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10m}
KEEP=${KEEP:-20}
cache=$(go env GOCACHE)/fuzz/github.com/ringipam/ringipam
# package:target
TARGETS=(
	pkg/pool:FuzzRingAgainstModel
	plugins/ipam-ring/ipamring:FuzzConfigAndArgs
	plugins/ipam-ring/ipamring:FuzzLoad
	docker-driver/driver:FuzzRequests
	docker-driver/driver:FuzzParsePoolID
	pkg/storeconfig:FuzzDuration
)
for pkg in pkg/portalloc; do
	[[ -d $pkg ]] || continue
	for t in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$pkg"/*_test.go 2>/dev/null | sed 's/^func //'); do
		TARGETS+=("$pkg:$t")
	done
done
for entry in "${TARGETS[@]}"; do
	pkg=${entry%%:*}
	target=${entry##*:}
	echo "fuzz: $pkg $target for $FUZZTIME"
	go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -parallel "${FUZZ_PARALLEL:-2}" "./$pkg"
	src="$cache/$pkg/$target"
	dst="$pkg/testdata/fuzz/$target"
	if [[ -d $src ]]; then
		mkdir -p "$dst"
		# the newest interesting inputs, by name so reruns are stable
		find "$src" -type f -printf '%T@ %p\n' | sort -rn | head -n "$KEEP" | cut -d' ' -f2- |
			while read -r f; do cp -n "$f" "$dst/"; done
	fi
done
echo "fuzz: all targets ran $FUZZTIME without a finding"
