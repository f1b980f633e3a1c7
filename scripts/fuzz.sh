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
	pkg/cni/ipam:FuzzConfigAndArgs
	pkg/cni/ipam:FuzzLoad
	docker-driver/driver:FuzzRequests
	docker-driver/driver:FuzzParsePoolID
	pkg/storeconfig:FuzzDuration
	pkg/cni/portmap:FuzzLoadMappings
)
for pkg in pkg/portalloc; do
	[[ -d $pkg ]] || continue
	for t in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$pkg"/*_test.go 2>/dev/null | sed 's/^func //'); do
		TARGETS+=("$pkg:$t")
	done
done
# FUZZ_ONLY="pkg:Target ..." runs just those.
if [[ -n ${FUZZ_ONLY:-} ]]; then
	read -r -a TARGETS <<<"$FUZZ_ONLY"
fi
for entry in "${TARGETS[@]}"; do
	pkg=${entry%%:*}
	target=${entry##*:}
	echo "fuzz: $pkg $target for $FUZZTIME"
	go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -parallel "${FUZZ_PARALLEL:-2}" "./$pkg"
	src="$cache/$pkg/$target"
	dst="$pkg/testdata/fuzz/$target"
	if [[ -d $src ]]; then
		mkdir -p "$dst"
		# the newest interesting inputs; the pipeline ends early on purpose
		mapfile -t newest < <(ls -t "$src" | head -n "$KEEP" || true)
		for f in "${newest[@]}"; do
			[[ -e "$dst/$f" ]] || cp "$src/$f" "$dst/$f"
		done
	fi
done
echo "fuzz: all targets ran $FUZZTIME without a finding"
