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

# Bumped whenever the way the binaries are built changes, so a cache made the
# old way is not reused.
RECIPE=2

cache=${XDG_CACHE_HOME:-$HOME/.cache}/inferencecache
bin=$cache/kube-$KUBE_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION-r$RECIPE/bin
mkdir -p "$bin"
export GOMODCACHE=$cache/go/mod GOCACHE=$cache/go/build GOFLAGS=-mod=mod GOTOOLCHAIN=local
# One package at a time: the machines this runs on are small and shared.
build_flags=(-p 1 -trimpath)

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
    # The version stamps a release build carries, so /version and kubectl
    # report the real version (unstamped: v0.0.0-master).
    minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
    stamp="-s -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION"
    stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
    stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"
    stamp+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION"
    stamp+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
    go build "${build_flags[@]}" -ldflags="$stamp" -o "$bin/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    go build "${build_flags[@]}" -ldflags="$stamp" -o "$bin/kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
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
    go build "${build_flags[@]}" -ldflags=-s -o "$bin/etcd" go.etcd.io/etcd/server/v3
    echo "build.sh: etcd built in $((SECONDS - start)) s" >&2
fi

if [[ ! -x $bin/helm ]]; then
    echo "build.sh: building helm $HELM_VERSION" >&2
    start=$SECONDS
    # Stamped as a release build is; `helm template` assumes the Kubernetes
    # version the suite runs (unstamped: v1.20).
    minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
    stamp="-s -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    for pkg in pkg/chartutil pkg/lint/rules; do
        stamp+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$minor"
    done
    GOBIN=$scratch/helm go install "${build_flags[@]}" -ldflags="$stamp" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    mv "$scratch/helm/helm" "$bin/helm"
    echo "build.sh: helm built in $((SECONDS - start)) s" >&2
fi

# The build cache only speeds up rebuilds of a new version; binaries are what
# later runs need, so keep it bounded.
go clean -cache >/dev/null 2>&1 || true
echo "$bin"
