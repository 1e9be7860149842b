#!/usr/bin/env bash
# Builds (once) the Kubernetes binaries the real-apiserver tests run:
# kube-apiserver and kubectl from k8s.io/kubernetes, etcd from go.etcd.io, and
# helm, all from the Go module proxy, pinned. Binaries, the Go build cache and
# the module cache live under ${XDG_CACHE_HOME:-$HOME/.cache}/inferencecache/
# keyed by version, so a second run only checks that they exist.
# Prints the bin directory on stdout. Fails loudly when it cannot build.
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-v1.36.3}
ETCD_VERSION=${ETCD_VERSION:-v3.6.17}
HELM_VERSION=${HELM_VERSION:-v3.22.0}

command -v go >/dev/null || { echo "build.sh: go is required (Go >= 1.25)" >&2; exit 1; }

cache=${XDG_CACHE_HOME:-$HOME/.cache}/inferencecache
bin=$cache/kube-$KUBE_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION/bin
mkdir -p "$bin"
export GOMODCACHE=$cache/go/mod GOCACHE=$cache/go/build GOFLAGS=-mod=mod GOTOOLCHAIN=local
# One package at a time: the machines this runs on are small and shared.
build_flags=(-p 1 -trimpath -ldflags=-s)

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

if [[ ! -x $bin/kube-apiserver || ! -x $bin/kubectl ]]; then
    echo "build.sh: building kube-apiserver and kubectl $KUBE_VERSION (several minutes, cached after)" >&2
    start=$SECONDS
    mkdir -p "$scratch/kube" && cd "$scratch/kube"
    go mod init kubebuild >/dev/null 2>&1
    # k8s.io/kubernetes replaces its staging modules with local paths; pin each
    # to the matching v0.x release so the module builds outside its own tree.
    gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
    [[ -f $gomod ]] || { echo "build.sh: cannot download k8s.io/kubernetes@$KUBE_VERSION" >&2; exit 1; }
    staging_version=v0.${KUBE_VERSION#v1.}
    go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION"
    while read -r mod; do
        go mod edit -replace="$mod=$mod@$staging_version"
    done < <(sed -n 's#^\s*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomod")
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    go mod tidy
    go build "${build_flags[@]}" -o "$bin/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    go build "${build_flags[@]}" -o "$bin/kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
    mv "$bin/kube-apiserver.tmp" "$bin/kube-apiserver"
    mv "$bin/kubectl.tmp" "$bin/kubectl"
    echo "build.sh: kube-apiserver + kubectl built in $((SECONDS - start)) s" >&2
fi

if [[ ! -x $bin/etcd ]]; then
    echo "build.sh: building etcd $ETCD_VERSION" >&2
    start=$SECONDS
    # etcd's server module carries replace directives too: build it from a
    # scratch module that requires it.
    mkdir -p "$scratch/etcd" && cd "$scratch/etcd"
    go mod init etcdbuild >/dev/null 2>&1
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
    go mod tidy
    go build "${build_flags[@]}" -o "$bin/etcd" go.etcd.io/etcd/server/v3
    echo "build.sh: etcd built in $((SECONDS - start)) s" >&2
fi

if [[ ! -x $bin/helm ]]; then
    echo "build.sh: building helm $HELM_VERSION" >&2
    start=$SECONDS
    GOBIN=$scratch/helm go install "${build_flags[@]}" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    mv "$scratch/helm/helm" "$bin/helm"
    echo "build.sh: helm built in $((SECONDS - start)) s" >&2
fi

# The build cache only speeds up rebuilds of a new version; binaries are what
# later runs need, so keep it bounded.
go clean -cache >/dev/null 2>&1 || true
echo "$bin"
