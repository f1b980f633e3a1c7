#!/usr/bin/env bash
# make scale: the scale harness (integration/scale; docs/benchmarks.md,
# "Scale: what a host costs etcd"), on this checkout, and with
# SCALE_BEFORE=<commit> also on that commit first (a git worktree in a temp
# dir with this checkout's harness copied in), so that both are measured
# by the same harness. Then the picture, docs/scale.svg, from the JSON of
# both (SCALE_BEFORE_JSON and SCALE_AFTER_JSON name them; each run writes
# its own to scale-<label>.json; docs/scale-before.json, the before run
# recorded in docs/benchmarks.md, is drawn when no before run was made).
#
#   SCALE_SIZES=10,100,1000   the sizes (default 10,100,1000: about 16 minutes here;
#                             the commit of SCALE_BEFORE runs SCALE_BEFORE_SIZES, 10,100)
#   SCALE_IDLE=60s            the idle phase
#   SCALE_CHURN=20s SCALE_CHURN_RATE=10
#   SCALE_ORPHAN_AFTER=20s    the agents' orphanAfter (the orphan phase)
#   SCALE_MEMBERS=3           etcd members (default 3: every size alike)
#   SCALE_CHAOS=1             the chaos phase (etcd leader killed, an agent cut off)
#   SCALE_LEASE_TTL=60s       the agents' --lease-ttl (default the shipped 15s)
#   SCALE_START=4             first ADDs at most 4 at a time (default: all at once)
#   SCALE_FULL=50             the whole agent on 50 hosts (default 100), a hollow one (no --routes,
#                             no --ingress) on the others (default: the whole agent on all)
#   SCALE_BEFORE=082f606      also run the harness on this commit, first
#   SCALE_ONLY_BEFORE=1       run the commit only
#   SCALE_TIMEOUT=3h
#   SCALE_CHURN_SIDE=0        leave out the churn side by side (scripts/scale-churn.sh,
#                             make scale-churn), which runs last otherwise
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
GO=${GO:-go}
timeout=${SCALE_TIMEOUT:-3h}
status=0

# run <dir> <label> <commit>: the harness of this checkout on the tree in dir.
run() {
	local dir=$1 label=$2 commit=$3
	local out=$root/scale-$label.json
	echo "== scale harness on $label ($commit) in $dir"
	(cd "$dir" && $GO test -c -tags scale -o "$dir/.scale.test" ./integration/scale/)
	local sizes=${SCALE_SIZES:-10,100,1000}
	[[ $label == before ]] && sizes=${SCALE_BEFORE_SIZES:-10,100}
	(cd "$dir/integration/scale" && SCALE_LABEL=$label SCALE_COMMIT=$commit SCALE_OUT=$out \
		SCALE_SIZES=$sizes SCALE_MEMBERS=${SCALE_MEMBERS:-3} SCALE_FULL=${SCALE_FULL:-100} \
		nice -n 10 "$dir/.scale.test" -test.run '^TestScale$' -test.timeout "$timeout" -test.v) 2>&1 | tee "$root/scale-$label.out"
	rm -f "$dir/.scale.test"
}

if [[ -n ${SCALE_BEFORE:-} ]]; then
	wt=$(mktemp -d /tmp/ringipam-scale-before.XXXXXX)
	trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true; rm -rf "$wt"' EXIT
	git worktree add --detach "$wt" "$SCALE_BEFORE" >/dev/null
	# The harness, and the agent's exported test options it needs, copied
	# in: the commit's own code is what runs.
	mkdir -p "$wt/integration/scale"
	cp -r "$root/integration/scale/." "$wt/integration/scale/"
	cp "$root/cmd/ringipamd/agent/export_harness.go" "$wt/cmd/ringipamd/agent/"
	run "$wt" before "$(git rev-parse --short "$SCALE_BEFORE")" || status=1
	SCALE_BEFORE_JSON=${SCALE_BEFORE_JSON:-$root/scale-before.json}
	if [[ -n ${SCALE_ONLY_BEFORE:-} ]]; then exit $status; fi
fi
run "$root" after "$(git rev-parse --short HEAD)$(git diff --quiet || echo +)" || status=1
args=(-after "${SCALE_AFTER_JSON:-$root/scale-after.json}" -out docs/scale.svg)
if [[ -n ${SCALE_BEFORE_JSON:-} && -f $SCALE_BEFORE_JSON ]]; then
	args+=(-before "$SCALE_BEFORE_JSON")
elif [[ -f docs/scale-before.json ]]; then
	args+=(-before docs/scale-before.json)
fi
$GO run ./integration/scale/cmd/scalesvg "${args[@]}"
echo "picture: docs/scale.svg"
# Issue 42 item 4: the churn beside host-local and whereabouts, on real
# namespace hosts through the CNI binaries (its own target too).
if [[ ${SCALE_CHURN_SIDE:-1} != 0 ]]; then
	scripts/scale-churn.sh || status=1
fi
# A failed phase or check fails make scale (the figures are still drawn).
exit $status
