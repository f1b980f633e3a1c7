#!/usr/bin/env bash
# Installs what ringipam's tests, benchmarks and demo need, idempotently:
#   1. Debian packages (etcd server, docker, packet filter and network tools),
#      touching apt only when one is missing;
#   2. the reference CNI tools (cnitool, bridge, ptp, loopback, macvlan,
#      host-local, portmap) built from their Go modules at pinned versions
#      into ./.cache/bin, skipping any already built at that version;
#   3. the Kubernetes control plane integration/k8s runs (scripts/build-k8s.sh:
#      kube-apiserver, kube-controller-manager, kube-scheduler, kubelet
#      v1.36.3 into ./.cache/bin/k8s; about 12 minutes the first time).
#      RINGIPAM_K8S_BUILD=background starts it detached (niced, logging to
#      .cache/build-k8s.log) and returns: make test does, and runs
#      build-k8s.sh again before integration/k8s, which waits for it (a
#      lock) and fails if it failed. RINGIPAM_K8S_BUILD=no skips it.
# Runs unattended (CI=true, no stdin). Needs root only when a package is
# missing. Re-running it changes nothing.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)

log() { printf 'install-deps: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- 1. Debian packages -------------------------------------------------------
# make runs the build; gcc and libc6-dev are what `go test -race` (cgo) needs.
PACKAGES=(etcd-server etcd-client docker.io nftables iptables iproute2 iputils-ping netcat-openbsd conntrack chromium podman
	make gcc libc6-dev ca-certificates)
# containerd and runc come with docker.io; named because integration/cri runs
# containerd (CRI) itself, with util-linux's unshare and nsenter (and mount).
PACKAGES+=(containerd runc util-linux)
# make image: a Debian root filesystem (mmdebstrap) made into an OCI image (umoci).
PACKAGES+=(mmdebstrap umoci)

missing=()
for p in "${PACKAGES[@]}"; do
	if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
		missing+=("$p")
	fi
done

if ((${#missing[@]})); then
	log "installing Debian packages: ${missing[*]}"
	SUDO=()
	if [[ $(id -u) -ne 0 ]]; then
		command -v sudo >/dev/null || die "packages missing (${missing[*]}) and not root: run this script as root"
		SUDO=(sudo -n)
	fi
	export DEBIAN_FRONTEND=noninteractive
	"${SUDO[@]}" apt-get update -q </dev/null
	"${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
	# The Debian etcd-server package starts a system etcd on 2379; the tests
	# start their own on free ports and do not need it.
else
	log "Debian packages present"
fi

[[ -x /usr/bin/etcd ]] || die "/usr/bin/etcd missing after install"

# --- 2. reference CNI tools ---------------------------------------------------
if ! command -v go >/dev/null; then
	[[ -x /usr/local/go/bin/go ]] && export PATH=/usr/local/go/bin:$PATH
fi
command -v go >/dev/null || die "go not found (expected on PATH or in /usr/local/go/bin)"

BIN="$ROOT/.cache/bin"
mkdir -p "$BIN"

CNI_VERSION=v1.3.1
PLUGINS_VERSION=v1.9.1
TOOLS=(
	"github.com/containernetworking/cni/cnitool@$CNI_VERSION"
	"github.com/containernetworking/plugins/plugins/main/bridge@$PLUGINS_VERSION"
	"github.com/containernetworking/plugins/plugins/main/ptp@$PLUGINS_VERSION"
	"github.com/containernetworking/plugins/plugins/main/loopback@$PLUGINS_VERSION"
	"github.com/containernetworking/plugins/plugins/main/macvlan@$PLUGINS_VERSION"
	"github.com/containernetworking/plugins/plugins/ipam/host-local@$PLUGINS_VERSION"
	"github.com/containernetworking/plugins/plugins/meta/portmap@$PLUGINS_VERSION"
)

for tool in "${TOOLS[@]}"; do
	pkg=${tool%@*}
	ver=${tool#*@}
	name=${pkg##*/}
	stamp="$BIN/.$name.version"
	if [[ -x "$BIN/$name" && -f "$stamp" && $(<"$stamp") == "$tool" ]]; then
		continue
	fi
	log "building $name $ver"
	# Outside the ringipam module, so its go.mod and GOFLAGS do not apply.
	(cd / && GOBIN="$BIN" GOFLAGS=-buildvcs=false CGO_ENABLED=0 go install "$tool") </dev/null
	printf '%s\n' "$tool" >"$stamp"
done
log "CNI tools in $BIN: $(cd "$BIN" && ls | tr '\n' ' ')"

# --- 3. the Kubernetes control plane (integration/k8s) -------------------------
case ${RINGIPAM_K8S_BUILD:-yes} in
no) log "Kubernetes binaries: skipped (RINGIPAM_K8S_BUILD=no)" ;;
background)
	command -v setsid >/dev/null || die "setsid (util-linux) missing"
	log "Kubernetes binaries: building in the background (log: .cache/build-k8s.log)"
	setsid -f nice -n 10 scripts/build-k8s.sh >"$ROOT/.cache/build-k8s.log" 2>&1 </dev/null
	;;
yes) scripts/build-k8s.sh ;;
*) die "RINGIPAM_K8S_BUILD=${RINGIPAM_K8S_BUILD}: want yes, background or no" ;;
esac
