#!/usr/bin/env bash
# Print the path of a working Python X.Y interpreter, or nothing and exit 1: `find_python.sh 3.6`.
# `make test-tx2` builds its venvs from these. PATH first (a pyenv shim counts only if it runs:
# pyenv's shims fail for a version not selected), then pyenv's own versions, newest patch first.
set -u
version=${1:?usage: find_python.sh X.Y}
candidates=("python$version")
roots=()
if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root 2>/dev/null)"); fi
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  [[ -n $root && -d $root/versions ]] || continue
  while IFS= read -r found; do candidates+=("$found"); done < <(
    find "$root/versions" -maxdepth 3 -path "*/versions/$version.*/bin/python$version" 2>/dev/null | sort -rV)
done
for python in "${candidates[@]}"; do
  # The interpreter's own path, not a shim's: the venvs built from it must not go through pyenv.
  if found=$("$python" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.'))); print(sys.executable)" 2>/dev/null); then
    printf '%s\n' "$found"
    exit 0
  fi
done
exit 1
