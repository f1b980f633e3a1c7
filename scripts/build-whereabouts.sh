#!/usr/bin/env bash
# Builds whereabouts (the cluster-wide CNI IPAM on Kubernetes CRDs, the one
# `make scale-churn` compares ringipam with) from its Go module at a pinned
# version, into ./.cache/bin/whereabouts, and copies the CRDs its module
# ships (doc/crds/) to ./.cache/whereabouts/crds/. Idempotent: skips the
# build when both are there for the same version (a stamp file).
#
# Its go.mod has a replace directive, so `go install module@version`
# refuses it: the module is downloaded through the module proxy
# (go mod download) and built in a copy of its directory, with its own
# go.mod and go.sum. About a minute on 2 cores the first time.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODULE=github.com/k8snetworkplumbingwg/whereabouts
VERSION=${WHEREABOUTS_VERSION:-v0.9.2}
BIN="$ROOT/.cache/bin"
CRDS="$ROOT/.cache/whereabouts/crds"
STAMP="$BIN/.whereabouts.version"

log() { printf 'build-whereabouts: %s\n' "$*" >&2; }

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
	export PATH=/usr/local/go/bin:$PATH
fi

if [[ -x "$BIN/whereabouts" && -f "$CRDS/whereabouts.cni.cncf.io_ippools.yaml" && -f "$STAMP" &&
	$(<"$STAMP") == "$MODULE@$VERSION" ]]; then
	log "whereabouts $VERSION in $BIN is current"
	exit 0
fi

mkdir -p "$BIN" "$CRDS"
dir=$(cd / && GOFLAGS=-mod=mod go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -n $dir && -d $dir ]] || { log "error: go mod download $MODULE@$VERSION gave no directory"; exit 1; }
src=$(mktemp -d /tmp/whereabouts-src.XXXXXX)
trap 'rm -rf "$src"' EXIT
cp -r "$dir/." "$src/"
chmod -R u+w "$src"
log "building whereabouts $VERSION"
(cd "$src" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags='-s -w' -o "$BIN/whereabouts" ./cmd/) </dev/null
cp "$dir"/doc/crds/whereabouts.cni.cncf.io_*.yaml "$CRDS/"
printf '%s\n' "$MODULE@$VERSION" >"$STAMP"
log "whereabouts in $BIN, CRDs in $CRDS"
