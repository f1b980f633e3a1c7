#!/usr/bin/env bash
# demo.sh: ipam-ring end to end on one machine, with nothing left behind.
#
# Builds bin/ipam-ring (and the reference CNI plugins and cnitool into
# .cache/bin when missing), creates a "host" network namespace and three
# "container" namespaces, adds the containers to a bridge network through
# the real bridge plugin with ipam-ring on the embedded local store, shows
# their addresses and pings between them, then deletes everything (also on
# failure or Ctrl-C). Then scripts/demo-cluster.sh: an etcd of its own, two
# namespace hosts with their agents (ringipamd --routes --ingress), a
# container on each pinging the other across the hosts, an ingress port of
# one reached through the other, and `ringctl status`. Needs root. Exits
# non-zero if any step fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$ROOT/bin"
CACHE_BIN="${RINGIPAM_CNI_BIN:-$ROOT/.cache/bin}"
T=30 # seconds allowed for any one step

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces); try: sudo make demo"
command -v ip >/dev/null || die "needs iproute2 (apt-get install iproute2)"
command -v ping >/dev/null || die "needs ping (apt-get install iputils-ping)"
GO=${GO:-go}
command -v "$GO" >/dev/null || GO=/usr/local/go/bin/go

say "building"
for p in plugins/ipam-ring plugins/portmap-ingress cmd/ringipamd cmd/ringctl; do
	(cd "$ROOT" && CGO_ENABLED=0 timeout 600 "$GO" build -trimpath -ldflags "$(scripts/version.sh --ldflags)" -o "$BIN/${p##*/}" "./$p")
done
need=()
for p in bridge loopback cnitool; do [ -x "$CACHE_BIN/$p" ] || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
	if [ -x "$ROOT/scripts/install-deps.sh" ]; then
		RINGIPAM_K8S_BUILD=no timeout 900 "$ROOT/scripts/install-deps.sh"
	else
		mkdir -p "$CACHE_BIN"
		GOBIN="$CACHE_BIN" timeout 900 "$GO" install \
			github.com/containernetworking/plugins/plugins/main/bridge@v1.9.1 \
			github.com/containernetworking/plugins/plugins/main/loopback@v1.9.1 \
			github.com/containernetworking/cni/cnitool@v1.3.1
	fi
fi
echo "ipam-ring, portmap-ingress, ringipamd, ringctl: $BIN; reference plugins and cnitool: $CACHE_BIN"

ID=$$
NET="ringdemo-$ID"
HOST="ringdemo-host-$ID"
CTRS=("ringdemo-c1-$ID" "ringdemo-c2-$ID" "ringdemo-c3-$ID")
WORK=$(mktemp -d /tmp/ringdemo.XXXXXX)
PLUGINS="$WORK/plugins"
added=()

cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	say "cleaning up"
	for c in "${added[@]}"; do
		timeout $T ip netns exec "$HOST" env CNI_PATH="$PLUGINS" NETCONFPATH="$WORK/net.d" \
			"$CACHE_BIN/cnitool" del "$NET" "/var/run/netns/$c" || rc=1
	done
	for ns in "${CTRS[@]}" "$HOST"; do
		ip netns delete "$ns" 2>/dev/null || true
	done
	rm -f /var/lib/cni/results/"$NET"-* 2>/dev/null || true
	rm -rf "$WORK"
	if [ $rc -eq 0 ]; then say "demo passed"; else echo "demo FAILED (exit $rc)" >&2; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$PLUGINS" "$WORK/net.d"
ln -s "$BIN/ipam-ring" "$PLUGINS/ipam-ring"
ln -s "$CACHE_BIN/bridge" "$PLUGINS/bridge"
ln -s "$CACHE_BIN/loopback" "$PLUGINS/loopback"
cat >"$WORK/net.d/$NET.conflist" <<JSON
{
  "cniVersion": "1.1.0",
  "name": "$NET",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "ring0",
      "isGateway": true,
      "ipam": {
        "type": "ipam-ring",
        "host": "demo-host",
        "store": { "type": "local", "path": "$WORK/store.db" },
        "ranges": [ [ { "subnet": "198.18.0.0/24" } ] ],
        "routes": [ { "dst": "0.0.0.0/0" } ]
      }
    }
  ]
}
JSON

say "network namespaces: host $HOST, containers ${CTRS[*]}"
ip netns add "$HOST"
ip -n "$HOST" link set lo up
for c in "${CTRS[@]}"; do
	ip netns add "$c"
	ip -n "$c" link set lo up
done

say "CNI ADD through the bridge plugin with ipam-ring (local store $WORK/store.db)"
addrs=()
for c in "${CTRS[@]}"; do
	out=$(timeout $T ip netns exec "$HOST" env CNI_PATH="$PLUGINS" NETCONFPATH="$WORK/net.d" \
		"$CACHE_BIN/cnitool" add "$NET" "/var/run/netns/$c")
	added+=("$c")
	a=$(printf '%s' "$out" | sed -n 's/.*"address": *"\([0-9.]*\)\/[0-9]*".*/\1/p' | head -n1)
	[ -n "$a" ] || die "no address in the result for $c: $out"
	addrs+=("$a")
	echo "$c -> $a"
done

say "addresses inside the containers"
for c in "${CTRS[@]}"; do
	echo "$c:"
	ip -n "$c" -4 -brief addr show dev eth0
done
uniq=$(printf '%s\n' "${addrs[@]}" | sort -u | wc -l)
[ "$uniq" -eq ${#addrs[@]} ] || die "addresses are not distinct: ${addrs[*]}"

say "ping ${CTRS[0]} (${addrs[0]}) -> ${CTRS[1]} (${addrs[1]}) and -> gateway 198.18.0.1"
timeout $T ip netns exec "${CTRS[0]}" ping -c 2 -W 5 "${addrs[1]}"
timeout $T ip netns exec "${CTRS[0]}" ping -c 1 -W 5 198.18.0.1

say "CNI CHECK"
for c in "${CTRS[@]}"; do
	timeout $T ip netns exec "$HOST" env CNI_PATH="$PLUGINS" NETCONFPATH="$WORK/net.d" \
		"$CACHE_BIN/cnitool" check "$NET" "/var/run/netns/$c"
	echo "$c: ok"
done

# Act two: the cluster (it cleans up after itself; this act's namespaces are
# removed when this script exits).
BIN="$BIN" CACHE_BIN="$CACHE_BIN" "$ROOT/scripts/demo-cluster.sh"
