#!/usr/bin/env bash
# Make (or bring up to date) a venv of Python X.Y and install packages into it:
#   make_venv.sh DIR X.Y PIP_SPEC [PACKAGE...]
# PIP_SPEC: the pip to upgrade to first, e.g. 'pip<22', the last that runs on Python 3.6.
# `make test-tx2` builds its venvs with it; the interpreter comes from scripts/find_python.sh.
set -euo pipefail
dir=${1:?usage: make_venv.sh DIR X.Y PIP_SPEC [PACKAGE...]}
version=${2:?usage: make_venv.sh DIR X.Y PIP_SPEC [PACKAGE...]}
pip_spec=${3:?usage: make_venv.sh DIR X.Y PIP_SPEC [PACKAGE...]}
shift 3
if [[ ! -x $dir/bin/python ]]; then
  python=$("$(dirname "$0")/find_python.sh" "$version") ||
    { echo "Error: no Python $version here (scripts/find_python.sh $version; pyenv install $version)" >&2; exit 1; }
  echo "+ $python -m venv $dir"
  "$python" -m venv "$dir"
fi
"$dir/bin/python" -m pip install --quiet --upgrade "$pip_spec"
if (($#)); then
  echo "+ $dir/bin/python -m pip install $*"
  "$dir/bin/python" -m pip install --quiet "$@"
fi
