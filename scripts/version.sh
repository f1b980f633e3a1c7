#!/usr/bin/env bash
# Prints the version every ringipam binary and the image are stamped with:
# `git describe --tags --always --dirty` of this checkout (RINGIPAM_VERSION
# overrides it; "dev" outside a git checkout). With --ldflags it prints the
# go build -ldflags that stamp it, and the commit, into internal/version:
#   go build -ldflags "$(scripts/version.sh --ldflags)" ./cmd/ringipamd
# Used by the Makefile (build), scripts/build-image.sh (the image's tag),
# scripts/demo.sh and docker-driver/plugin/build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${RINGIPAM_VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo dev)}
commit=$(git rev-parse HEAD 2>/dev/null || true)
case ${1:-} in
"") printf '%s\n' "$version" ;;
--ldflags)
	pkg=github.com/ringipam/ringipam/internal/version
	printf -- '-X %s.Version=%s -X %s.Commit=%s\n' "$pkg" "$version" "$pkg" "$commit"
	;;
*) echo "usage: $0 [--ldflags]" >&2; exit 2 ;;
esac
