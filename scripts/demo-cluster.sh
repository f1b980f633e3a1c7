#!/usr/bin/env bash
# demo-cluster.sh: the second act of `make demo`: two hosts on one etcd.
#
# Starts an etcd of its own (Debian's /usr/bin/etcd, temporary data dir)
# inside a "LAN" network namespace, two "host" namespaces on that LAN
# (198.18.70.1 and .2) each running ringipamd --routes --ingress on it, puts
# one container on each through bridge + ipam-ring + portmap-ingress (the
# plugins go through their host's agent), pings from one container to the
# other across the hosts (the agents route each other's ranges), publishes
# an ingress port on host-a and reaches it through host-b's address (host-b's
# agent forwards it), then prints the agents' routes and `ringctl status`.
# Everything it made (namespaces with their nftables tables and routes,
# processes, the temporary directory) is removed on exit, failure or
# Ctrl-C. Needs root, etcd, nft and nc (scripts/install-deps.sh). Run by
# scripts/demo.sh; BIN and CACHE_BIN name the built binaries.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="${BIN:-$ROOT/bin}"
CACHE_BIN="${CACHE_BIN:-${RINGIPAM_CNI_BIN:-$ROOT/.cache/bin}}"
T=30 # seconds allowed for any one step

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo-cluster: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces); try: sudo make demo"
for c in ip ping nft nc; do command -v $c >/dev/null || die "needs $c (scripts/install-deps.sh)"; done
ETCD=${ETCD:-/usr/bin/etcd}
[ -x "$ETCD" ] || die "needs etcd at $ETCD (scripts/install-deps.sh)"
for b in ipam-ring portmap-ingress ringipamd ringctl; do [ -x "$BIN/$b" ] || die "missing $BIN/$b"; done
for b in bridge loopback cnitool; do [ -x "$CACHE_BIN/$b" ] || die "missing $CACHE_BIN/$b"; done

ID=$$
NET="ringdemo2-$ID"
LAN="ringdemo-lan-$ID"
HOSTS=(host-a host-b)
HOST_NS=("ringdemo-a-$ID" "ringdemo-b-$ID")
HOST_IP=(198.18.70.1 198.18.70.2)
CTR_NS=("ringdemo-ca-$ID" "ringdemo-cb-$ID")
LAN_IP=198.18.70.254
ENDPOINT="http://$LAN_IP:2379"
PREFIX="/ringdemo-$ID/"
PORT=8080
WORK=$(mktemp -d /tmp/ringdemo-cluster.XXXXXX)
PLUGINS="$WORK/plugins"
etcd_pid=
agent_pids=()
added=() # indexes of the hosts whose container was added

# inns NS CMD...: CMD inside namespace NS, bounded by T.
inns() { local ns=$1; shift; timeout $T ip netns exec "$ns" "$@"; }
cni() { # cni VERB i: cnitool VERB for host i's container, in host i's namespace
	inns "${HOST_NS[$2]}" env CNI_PATH="$PLUGINS" NETCONFPATH="$WORK/net.d-$2" \
		CNI_CONTAINERID="ctr-${HOSTS[$2]}" ${CAP_ARGS:+CAP_ARGS="$CAP_ARGS"} \
		"$CACHE_BIN/cnitool" "$1" "$NET" "/var/run/netns/${CTR_NS[$2]}"
}
# stop PID: SIGTERM, then SIGKILL after T seconds.
stop() {
	local pid=$1 i
	kill -TERM "$pid" 2>/dev/null || return 0
	for ((i = 0; i < T * 10; i++)); do
		kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
		sleep 0.1
	done
	echo "demo-cluster: pid $pid did not stop on SIGTERM; killing it" >&2
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}
# waitfor WHAT CMD...: run CMD until it succeeds, for at most T seconds.
waitfor() {
	local what=$1 i
	shift
	for ((i = 0; i < T * 2; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.5
	done
	die "timed out waiting for $what"
}

cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	trap '' INT TERM # a second Ctrl-C does not cut the cleanup short
	exec 1>&3 2>&4
	say "cluster: cleaning up"
	# DEL first, while the agents that run the plugins' calls are up.
	for i in "${added[@]}"; do
		CAP_ARGS= cni del "$i" || rc=1
	done
	# Processes left inside the namespaces (the demo's listener).
	for ns in "${CTR_NS[@]}"; do
		for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
	done
	# The agents remove their routes, rules, proxy ARP and forwards on SIGTERM.
	for p in "${agent_pids[@]}"; do stop "$p"; done
	[ -z "$etcd_pid" ] || stop "$etcd_pid"
	for ns in "${CTR_NS[@]}" "${HOST_NS[@]}" "$LAN"; do
		ip netns delete "$ns" 2>/dev/null || true
	done
	rm -f /var/lib/cni/results/"$NET"-* 2>/dev/null || true
	# ipam-ring's per-host notes of the demo's pool (pkg/hostlock).
	rm -f /run/ringipam/locks/"$NET"-* 2>/dev/null || true
	if [ $rc -ne 0 ] && [ $rc -ne 130 ]; then # failed, not interrupted
		for f in "$WORK"/*.log; do
			[ -f "$f" ] || continue
			echo "--- last lines of $(basename "$f")" >&2
			tail -n 20 "$f" >&2
		done
	fi
	rm -rf "$WORK"
	if [ $rc -eq 0 ]; then
		say "cluster act passed"
	elif [ $rc -eq 130 ]; then
		echo "cluster act interrupted; everything it made is removed" >&2
	else
		echo "cluster act FAILED (exit $rc)" >&2
	fi
	exit $rc
}
# The cleanup writes to the script's own output even when Ctrl-C lands
# inside a step whose output goes to /dev/null (waitfor): fds 3 and 4 keep it.
exec 3>&1 4>&2
trap cleanup EXIT
trap 'exit 130' INT TERM

say "cluster: a LAN namespace $LAN with etcd on $LAN_IP, hosts ${HOST_NS[*]} on it"
ip netns add "$LAN"
ip -n "$LAN" link set lo up
ip -n "$LAN" link add br0 type bridge
ip -n "$LAN" addr add "$LAN_IP/24" dev br0
ip -n "$LAN" link set br0 up
for i in 0 1; do
	ns=${HOST_NS[$i]}
	ip netns add "$ns"
	ip -n "$ns" link set lo up
	ip -n "$LAN" link add "p$i" type veth peer name eth0 netns "$ns"
	ip -n "$LAN" link set "p$i" master br0 up
	ip -n "$ns" addr add "${HOST_IP[$i]}/24" dev eth0
	ip -n "$ns" link set eth0 up
	ip netns add "${CTR_NS[$i]}"
	ip -n "${CTR_NS[$i]}" link set lo up
done

# etcd and the agents run in sessions of their own, so that a Ctrl-C reaches
# only this script, whose cleanup DELs the containers through the agents and
# then stops the agents (they remove their routes) and etcd, in that order.
# (setsid execs in place here: a background job is no group leader.)
mkdir -p "$WORK/etcd"
setsid ip netns exec "$LAN" "$ETCD" --name demo --data-dir "$WORK/etcd" \
	--listen-client-urls "$ENDPOINT" --advertise-client-urls "$ENDPOINT" \
	--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
	--initial-cluster demo=http://127.0.0.1:2380 --log-level warn >"$WORK/etcd.log" 2>&1 3>&- 4>&- &
etcd_pid=$!
ringctl() { inns "$LAN" "$BIN/ringctl" --etcd-endpoints "$ENDPOINT" --etcd-prefix "$PREFIX" "$@"; }
waitfor "etcd on $ENDPOINT" ringctl status
echo "etcd $("$ETCD" --version | head -n1 | sed 's/.*: *//') on $ENDPOINT (pid $etcd_pid), prefix $PREFIX"

say "cluster: ringipamd --routes --ingress on each host"
mkdir -p "$PLUGINS"
for p in ipam-ring portmap-ingress; do ln -s "$BIN/$p" "$PLUGINS/$p"; done
for p in bridge loopback; do ln -s "$CACHE_BIN/$p" "$PLUGINS/$p"; done
for i in 0 1; do
	d="$WORK/${HOSTS[$i]}"
	mkdir -p "$d"
	setsid ip netns exec "${HOST_NS[$i]}" "$BIN/ringipamd" --host "${HOSTS[$i]}" --addr "${HOST_IP[$i]}" \
		--store etcd --etcd-endpoints "$ENDPOINT" --etcd-prefix "$PREFIX" \
		--agent-socket "$d/agent.sock" --del-queue "$d/del-queue" \
		--routes --ingress --listen off --lease-ttl 5s --sync-interval 1s \
		>"$WORK/ringipamd-${HOSTS[$i]}.log" 2>&1 3>&- 4>&- &
	agent_pids+=($!)
	echo "${HOSTS[$i]} (${HOST_IP[$i]}): ringipamd pid $!, socket $d/agent.sock"
done
for i in 0 1; do waitfor "${HOSTS[$i]}'s agent socket" test -S "$WORK/${HOSTS[$i]}/agent.sock"; done

# One conflist per host: the same network, the host's name and agent.
for i in 0 1; do
	d="$WORK/${HOSTS[$i]}"
	store="{ \"type\": \"etcd\", \"endpoints\": [\"$ENDPOINT\"], \"prefix\": \"$PREFIX\", \"agentSocket\": \"$d/agent.sock\", \"delQueue\": \"$d/del-queue\" }"
	mkdir -p "$WORK/net.d-$i"
	cat >"$WORK/net.d-$i/$NET.conflist" <<JSON
{
  "cniVersion": "1.1.0",
  "name": "$NET",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "ring1",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "ipam-ring",
        "host": "${HOSTS[$i]}",
        "store": $store,
        "ranges": [ [ { "subnet": "198.18.71.0/24" } ] ],
        "routes": [ { "dst": "0.0.0.0/0" } ]
      }
    },
    {
      "type": "portmap-ingress",
      "host": "${HOSTS[$i]}",
      "store": $store,
      "mode": "ingress",
      "capabilities": { "portMappings": true }
    }
  ]
}
JSON
done

say "cluster: one container on each host (bridge + ipam-ring on etcd, through the agent); host-a's publishes $PORT/tcp (ingress) -> 80"
caddrs=()
for i in 0 1; do
	CAP_ARGS=
	[ "$i" -eq 0 ] && CAP_ARGS="{\"portMappings\": [{\"hostPort\": $PORT, \"containerPort\": 80, \"protocol\": \"tcp\"}]}"
	out=$(cni add "$i")
	added+=("$i")
	a=$(printf '%s' "$out" | sed -n 's/.*"address": *"\([0-9.]*\)\/[0-9]*".*/\1/p' | head -n1)
	[ -n "$a" ] || die "no address in the result for ${HOSTS[$i]}'s container: $out"
	caddrs+=("$a")
	echo "${HOSTS[$i]}: container ${CTR_NS[$i]} -> $a"
done
CAP_ARGS=

say "cluster: ping across hosts: ${HOSTS[0]}'s container ${caddrs[0]} <-> ${HOSTS[1]}'s ${caddrs[1]}"
pingable() { inns "$1" ping -c 1 -W 1 "$2"; }
waitfor "a route from host-a's container to ${caddrs[1]}" pingable "${CTR_NS[0]}" "${caddrs[1]}"
inns "${CTR_NS[0]}" ping -c 2 -W 5 "${caddrs[1]}"
waitfor "a route from host-b's container to ${caddrs[0]}" pingable "${CTR_NS[1]}" "${caddrs[0]}"
inns "${CTR_NS[1]}" ping -c 2 -W 5 "${caddrs[0]}"
for i in 0 1; do
	echo "${HOSTS[$i]}'s agent routes (ip route show table 4212):"
	ip -n "${HOST_NS[$i]}" route show table 4212 | sed 's/^/  /'
done

say "cluster: ingress port $PORT of host-a's container, reached through host-b (${HOST_IP[1]}:$PORT) from the LAN"
# The container's listener: answers every connection with one line.
ip netns exec "${CTR_NS[0]}" bash -c \
	"while :; do echo 'hello from host-a container ${caddrs[0]}' | nc -l -N 80 >/dev/null 2>&1 || sleep 0.2; done" \
	</dev/null >/dev/null 2>&1 3>&- 4>&- &
disown $! # killed with everything else in the namespace on cleanup
forwarded() { ip netns exec "${HOST_NS[1]}" nft list map inet ringipam-ingress fwd4 | grep -q "tcp . $PORT "; }
waitfor "host-b's agent to forward $PORT to host-a" forwarded
echo "host-b's forward (nft list map inet ringipam-ingress fwd4):"
ip netns exec "${HOST_NS[1]}" nft list map inet ringipam-ingress fwd4 | grep "$PORT" | sed 's/^ */  /'
answered() { inns "$LAN" nc -d -w 2 "$1" "$PORT" | grep -q hello; }
waitfor "an answer through ${HOST_IP[1]}:$PORT" answered "${HOST_IP[1]}"
echo "nc ${HOST_IP[1]} $PORT (host-b) -> $(inns "$LAN" nc -d -w 2 "${HOST_IP[1]}" "$PORT")"
waitfor "an answer through ${HOST_IP[0]}:$PORT" answered "${HOST_IP[0]}"
echo "nc ${HOST_IP[0]} $PORT (host-a) -> $(inns "$LAN" nc -d -w 2 "${HOST_IP[0]}" "$PORT")"

say "cluster: ringctl status"
ringctl status
ringctl ports
