#!/usr/bin/env bash
# Prints the path of a nats-server binary for the fleet tests and benchmark: the
# Debian package nats-server 2.9.10, downloaded with apt-get (no root needed) and
# unpacked into ${XDG_CACHE_HOME:-$HOME/.cache}/inferencecache/nats-server-2.9.10/,
# reused when present. Fails loudly when it cannot be had. $NATS_SERVER_BIN, when
# set, is used as is.
set -euo pipefail
if [[ -n "${NATS_SERVER_BIN:-}" ]]; then
  [[ -x "$NATS_SERVER_BIN" ]] || { echo "NATS_SERVER_BIN=$NATS_SERVER_BIN is not executable" >&2; exit 1; }
  echo "$NATS_SERVER_BIN"
  exit 0
fi
version=2.9.10
dir="${XDG_CACHE_HOME:-$HOME/.cache}/inferencecache/nats-server-$version"
bin="$dir/usr/sbin/nats-server"
if [[ ! -x "$bin" ]]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  fetch() { (cd "$work" && apt-get download -q "nats-server=$version*" >&2); }
  if ! fetch; then
    # No package lists yet: only root can fetch them.
    if [[ "$(id -u)" == 0 ]]; then
      apt-get update -q >&2
      fetch
    else
      echo "cannot download the Debian package nats-server $version (apt-get download; run apt-get update as root first)" >&2
      exit 1
    fi
  fi
  deb="$(ls "$work"/nats-server_*.deb)"
  mkdir -p "$dir.tmp"
  dpkg-deb -x "$deb" "$dir.tmp"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
fi
"$bin" --version >&2
echo "$bin"
