#!/usr/bin/env bash
# Lays out ringipam-docker as a Docker managed plugin (the directory
# `docker plugin create NAME DIR` takes: config.json plus rootfs/) and, when
# a plugin name is given, creates the plugin in the local dockerd.
#
#   docker-driver/plugin/build.sh OUTDIR [PLUGIN_NAME]
#
# OUTDIR defaults to bin/docker-plugin. The rootfs holds only the static
# binary and the directories the plugin's mounts and socket need.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/bin/docker-plugin}
name=${2:-}
go=${GO:-go}

case $out in
/*) ;;
*) out=$PWD/$out ;;
esac
if [[ -e $out && ! -f $out/config.json ]]; then
	echo "build.sh: $out exists and is not a plugin directory; refusing to replace it" >&2
	exit 1
fi
rm -rf "$out"
mkdir -p "$out/rootfs"/{run/docker/plugins,var/lib/ringipam,etc/ringipam,tmp}
(cd "$root" && CGO_ENABLED=0 "$go" build -trimpath -ldflags "$("$root/scripts/version.sh" --ldflags)" -o "$out/rootfs/ringipam-docker" ./docker-driver)
cp "$here/config.json" "$out/config.json"
echo "plugin laid out in $out"

if [[ -n $name ]]; then
	docker plugin create "$name" "$out"
	echo "created plugin $name: configure it with docker plugin set $name RINGIPAM_DOCKER_HOST=\$(hostname) ..., then docker plugin enable $name"
fi
