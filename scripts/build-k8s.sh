#!/usr/bin/env bash
# Builds the Kubernetes control plane that integration/k8s runs (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet) from the Go modules pinned
# in tools/k8s/go.mod, into ./.cache/bin/k8s. Skips the build when the
# binaries there were built from the same go.mod and go.sum (a stamp file).
# About 12 minutes on 2 cores the first time; nothing after.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/.cache/bin/k8s"
STAMP="$OUT/.stamp"
TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)

log() { printf 'build-k8s: %s\n' "$*" >&2; }

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
	export PATH=/usr/local/go/bin:$PATH
fi

mkdir -p "$OUT"
# One build at a time: a second run (make test's, while install-deps's
# background build is under way) waits for the first, then finds the stamp
# current. The wait is bounded.
exec 9>"$OUT/.lock"
if ! flock -w "${RINGIPAM_K8S_BUILD_WAIT:-2400}" 9; then
	log "error: another build-k8s.sh still holds $OUT/.lock after ${RINGIPAM_K8S_BUILD_WAIT:-2400} s"
	exit 1
fi

want=$(cat tools/k8s/go.mod tools/k8s/go.sum | sha256sum | cut -d' ' -f1)
have_all=1
for t in "${TOOLS[@]}"; do [[ -x "$OUT/$t" ]] || have_all=0; done
if ((have_all)) && [[ -f "$STAMP" && $(<"$STAMP") == "$want" ]]; then
	log "Kubernetes binaries in $OUT are current"
	exit 0
fi

log "building ${TOOLS[*]} into $OUT (about 12 minutes on 2 cores the first time)"
start=$SECONDS
# Static binaries (no cgo), stripped: faster to link, smaller to cache.
(cd tools/k8s && CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
	go build -trimpath -ldflags='-s -w' -o "$OUT/" tool) </dev/null
for t in "${TOOLS[@]}"; do
	[[ -x "$OUT/$t" ]] || { log "error: $t was not built"; exit 1; }
done
printf '%s\n' "$want" >"$STAMP"
log "built in $((SECONDS - start)) s"
