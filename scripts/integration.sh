#!/usr/bin/env bash
# make integration's test runs: `go test -json -race -tags integration` on
# every package whose files the integration build tag changes (each suite
# under integration/ but integration/k8s, which make integration-k8s runs;
# and the packages with tests of their own on real parts), JSON on stdout
# for internal/testsummary.
#
# A package whose test files all carry the tag runs whole. A package that
# also has untagged tests (make unit has run those, with -race) runs only
# the tests its tagged files define (-run '^(TestA|TestB)$'), so that its
# unit tests do not run a second time; one with no test of its tagged
# files runs whole (its tagged files may change what its tests do).
# Packages the tag does not touch are left to make unit.
#
#   scripts/integration.sh [timeout]    (default 25m, each go test run)
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
timeout=${1:-25m}
args=(-json -race -tags integration -count=1 -p 1 -timeout "$timeout" -skip '^TestModelCheck')
tagged() { grep -l -E '^//go:build .*\bintegration\b' "$@" 2>/dev/null || true; }
untagged() { grep -L -E '^//go:build .*\bintegration\b' "$@" 2>/dev/null || true; }

f='{{.ImportPath}}|{{.Dir}}|{{.GoFiles}}{{.TestGoFiles}}{{.XTestGoFiles}}'
mapfile -t changed < <(comm -13 <($GO list -f "$f" ./... | sort) <($GO list -tags integration -f "$f" ./... | sort) |
	grep -v '^[^|]*/integration/k8s|')

whole=()
parts=() # "package|regexp"
for line in "${changed[@]}"; do
	pkg=${line%%|*}
	rest=${line#*|}
	dir=${rest%%|*}
	shopt -s nullglob
	tests=("$dir"/*_test.go)
	shopt -u nullglob
	if ((${#tests[@]} == 0)) || [[ -z $(untagged "${tests[@]}") ]]; then
		whole+=("$pkg")
		continue
	fi
	mapfile -t files < <(tagged "${tests[@]}")
	names=""
	if ((${#files[@]} > 0)); then
		names=$(grep -h -o -E '^func Test[A-Za-z0-9_]*\(' "${files[@]}" | sed -e 's/^func //' -e 's/($//' |
			grep -v '^TestMain$' | sort -u | paste -sd'|' || true)
	fi
	if [[ -z $names ]]; then
		whole+=("$pkg")
	else
		parts+=("$pkg|$names")
	fi
done

status=0
if ((${#whole[@]} > 0)); then
	$GO test "${args[@]}" "${whole[@]}" || status=1
fi
for p in "${parts[@]}"; do
	$GO test "${args[@]}" -run "^(${p#*|})\$" "${p%%|*}" || status=1
done
exit $status
