#!/usr/bin/env bash
# make scale-churn (and the last step of make scale): issue 42 item 4's
# churn side by side (integration/churn, TestChurn; docs/benchmarks.md,
# "Churn side by side"). 10 network-namespace hosts x 100 pods created,
# deleted and created again through libcni, the bridge plugin and the IPAM
# plugin, with ringipam (its agents on an etcd), host-local and whereabouts
# v0.9.2 (on a kube-apiserver with its own etcd) in turn, then the table,
# the ratios and the goal's verdict. Builds what it needs first:
# whereabouts from its Go module (scripts/build-whereabouts.sh) and
# kube-apiserver (scripts/build-k8s.sh, niced; about 12 minutes the first
# time). The whole output is kept in scale-churn.out, the table in
# scale-churn.md.
#
#   CHURN_HOSTS=10 CHURN_PODS=100 CHURN_PARALLEL=4   the size
#   CHURN_IPAMS=ringipam,host-local,whereabouts       which IPAMs, in order
#   CHURN_MODES=cni,ipam      through the CNI chain, and the IPAM plugin alone
#   CHURN_TIMEOUT=90m
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
GO=${GO:-go}
if [[ ${CHURN_IPAMS:-whereabouts} == *whereabouts* ]]; then
	scripts/build-whereabouts.sh
	nice -n 10 scripts/build-k8s.sh
fi
bin=$(mktemp -d /tmp/ringipam-churn.XXXXXX)
trap 'rm -rf "$bin"' EXIT
$GO test -c -tags integration,scale -o "$bin/churn.test" ./integration/churn/
set +e
(cd integration/churn && CHURN_OUT=$root/scale-churn.md "$bin/churn.test" -test.run '^TestChurn$' -test.v \
	-test.timeout "${CHURN_TIMEOUT:-90m}") 2>&1 | tee "$root/scale-churn.out"
status=${PIPESTATUS[0]}
set -e
echo "table: scale-churn.md, whole output: scale-churn.out"
exit "$status"
