#!/usr/bin/env bash
# Builds ringipam's image (make image) without any container registry:
#   1. the plugins, ringipamd, ringctl and ringipam-uninstall (the
#      DaemonSet's preStop hook), static (CGO_ENABLED=0);
#   2. the base layer: a Debian root filesystem made by mmdebstrap from
#      Debian's archive (the essential packages and nftables, for
#      portmap-ingress's and the agent's `nft`). It is kept in
#      ./.cache/image/ and reused by the next build for a day (as an image
#      builder's cache reuses a base layer): RINGIPAM_IMAGE_FRESH=1 makes
#      it anew, as a release build should; RINGIPAM_IMAGE_BASE_MAX_AGE
#      (minutes, default 1440) sets the day;
#   3. the binaries' layer: those binaries and the reference bridge and
#      loopback of ./.cache/bin (make deps);
#   4. an OCI image of those two layers (umoci), written as an OCI archive:
#        bin/ringipam-image-<version>.oci.tar, tag <version> = git describe
#      (scripts/version.sh, which also stamps the binaries: --version).
#      Built at a release's tag (git tag v0.1.0), <version> is that tag, the
#      one deploy/kubernetes/ringipam.yaml pins (see CHANGELOG.md).
# Layout inside the image (what deploy/kubernetes/ringipam.yaml expects):
#   /usr/local/bin/{ringipamd,ringctl,ringipam-uninstall} (entrypoint ringipamd),
#   /opt/ringipam/cni/{ipam-ring,portmap-ingress}   (always installed),
#   /opt/ringipam/cni-reference/{bridge,loopback}   (installed where missing).
# Load it into containerd with
#   ctr -n k8s.io images import --base-name docker.io/ringipam/ringipam bin/ringipam-image-<version>.oci.tar
# Needs root (mmdebstrap --mode=root), network access to the Debian mirror
# of /etc/apt/sources.list, mmdebstrap and umoci (Debian packages).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

for tool in mmdebstrap umoci go git; do
	command -v "$tool" >/dev/null || die "$tool not found (Debian packages mmdebstrap and umoci; go in /usr/local/go/bin)"
done
[[ $(id -u) -eq 0 ]] || die "mmdebstrap --mode=root needs root"
SUITE=${RINGIPAM_IMAGE_SUITE:-bookworm}
VERSION=$(scripts/version.sh)
LDFLAGS=$(scripts/version.sh --ldflags)
# File times (mmdebstrap) and the image's dates (umoci) are the commit's.
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
export SOURCE_DATE_EPOCH

for ref in bridge loopback; do
	[[ -x .cache/bin/$ref ]] || die ".cache/bin/$ref missing: run make deps first"
done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin" "$WORK/cni" "$WORK/cni-reference" bin

log "building the binaries ($VERSION)"
for p in ipam-ring portmap-ingress; do
	CGO_ENABLED=0 go build -trimpath -ldflags "$LDFLAGS" -o "$WORK/cni/$p" "./plugins/$p"
done
for c in ringipamd ringctl ringipam-uninstall; do
	CGO_ENABLED=0 go build -trimpath -ldflags "$LDFLAGS" -o "$WORK/bin/$c" "./cmd/$c"
done
cp .cache/bin/bridge .cache/bin/loopback "$WORK/cni-reference/"

# The base layer: its cache file is named by what makes it (the suite and
# mmdebstrap's arguments), so a change of either makes a new one.
BASE_ARGS=(--mode=root --variant=essential --include=nftables --skip=output/dev
	--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
	--dpkgopt='path-exclude=/usr/share/locale/*'
	--customize-hook='rm -rf "$1/var/cache/apt" "$1/var/lib/apt/lists"; mkdir -p "$1/var/cache/apt" "$1/var/lib/apt/lists"')
CACHE=.cache/image
BASE="$CACHE/base-$SUITE-$(printf '%s\n' "$SUITE" "${BASE_ARGS[@]}" | sha256sum | cut -c1-16).tar"
mkdir -p "$CACHE"
if [[ -z ${RINGIPAM_IMAGE_FRESH:-} && -f $BASE && -n $(find "$BASE" -mmin -"${RINGIPAM_IMAGE_BASE_MAX_AGE:-1440}") ]]; then
	log "reusing the base layer $BASE (made $(date -u -r "$BASE" +%Y-%m-%dT%H:%MZ); RINGIPAM_IMAGE_FRESH=1 makes it anew)"
else
	log "making the base layer ($SUITE, essential + nftables)"
	# Device nodes stay out of the layer: runtimes give a container its /dev.
	mmdebstrap "${BASE_ARGS[@]}" "$SUITE" "$WORK/base.tar"
	mv -f "$WORK/base.tar" "$BASE"
fi

log "making the binaries' layer"
APP="$WORK/app"
mkdir -p "$APP/usr/local/bin" "$APP/opt/ringipam/cni" "$APP/opt/ringipam/cni-reference"
cp "$WORK/bin/ringipamd" "$WORK/bin/ringctl" "$WORK/bin/ringipam-uninstall" "$APP/usr/local/bin/"
cp "$WORK/cni/ipam-ring" "$WORK/cni/portmap-ingress" "$APP/opt/ringipam/cni/"
cp "$WORK/cni-reference/bridge" "$WORK/cni-reference/loopback" "$APP/opt/ringipam/cni-reference/"
chmod -R u=rwX,go=rX "$APP"
tar -C "$APP" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
	-cf "$WORK/app.tar" usr opt

log "making the OCI image ringipam:$VERSION"
L="$WORK/layout"
umoci init --layout "$L"
umoci new --image "$L:$VERSION"
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
umoci raw add-layer --image "$L:$VERSION" --history.created "$CREATED" \
	--history.created_by "mmdebstrap $SUITE (essential, nftables)" "$BASE"
umoci raw add-layer --image "$L:$VERSION" --history.created "$CREATED" \
	--history.created_by "ringipam's binaries ($VERSION), the reference bridge and loopback" "$WORK/app.tar"
umoci config --image "$L:$VERSION" --created "$CREATED" --history.created "$CREATED" --os linux --architecture "$(go env GOARCH)" \
	--config.entrypoint /usr/local/bin/ringipamd --config.workingdir / \
	--config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
	--config.label "org.opencontainers.image.version=$VERSION" \
	--config.label "org.opencontainers.image.source=https://github.com/ringipam/ringipam" \
	--history.created_by "scripts/build-image.sh ($SUITE, $VERSION)"
umoci gc --layout "$L"
OUT="bin/ringipam-image-$VERSION.oci.tar"
tar -C "$L" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner -cf "$OUT.tmp" .
mv -f "$OUT.tmp" "$OUT"
log "wrote $ROOT/$OUT ($(du -h "$OUT" | cut -f1)), tag $VERSION"
