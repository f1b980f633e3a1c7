#!/usr/bin/env bash
# Shows that the real-parts suites cannot pass by skipping: one integration
# suite's test binary (built here, as the caller) run as user nobody with
# CI=true must fail and name the suite. Needs root (to switch users); as
# another user it only says so.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) -ne 0 ]]; then
	echo "ci-nonroot-check: needs root to run a suite as nobody" >&2
	exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
go test -c -tags integration -o "$tmp/containernet.test" ./integration/containernet
set +e
out=$(cd "$tmp" && setpriv --reuid=65534 --regid=65534 --clear-groups env -i CI=true PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$tmp" \
	"$tmp/containernet.test" -test.v 2>&1)
rc=$?
set -e
if [[ $rc -eq 0 ]]; then
	echo "ci-nonroot-check: the containernet suite PASSED as nobody with CI=true:"
	echo "$out"
	exit 1
fi
if ! grep -q "suite containernet needs root" <<<"$out"; then
	echo "ci-nonroot-check: the suite failed as nobody, but without naming itself:"
	echo "$out"
	exit 1
fi
echo "ci-nonroot-check: as nobody with CI=true the suite fails and says: $(grep 'needs root' <<<"$out" | head -1)"
