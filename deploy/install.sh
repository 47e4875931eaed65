#!/usr/bin/env bash
# Install odtd as a systemd service: user, venv, config, unit, odtctl link, enable.
# Idempotent: re-run it to upgrade; an edited /etc/odtd/*.yaml is never overwritten.
# See docs/jetson.md. Run with --help for the options.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: sudo deploy/install.sh [options]

Installs odtd from this checkout:
  user     system user and group odtd (no login shell, home /var/lib/odtd), added to the
           jtop group if it exists (and to video on Jetson, for the GPU device nodes)
  venv     /opt/odtd/venv with `pip install CHECKOUT[trainer]` ([jetson] on a Jetson,
           where the venv also sees the system's site-packages, so NVIDIA's TensorFlow)
  config   /etc/odtd/odtd.yaml and /etc/odtd/policy.yaml, only if absent; on a JetPack 4
           Jetson (/usr/bin/python3.6, for which NVIDIA builds TensorFlow) the config names
           that interpreter as the worker's (trainer.python) when the daemon's is another
  worker   the worker's interpreter: Python and TensorFlow versions, or why it cannot run
  state    /var/lib/odtd (mode 0770, owner odtd), so `odtctl init` can run before the first
           start, with odtd.yaml there linked to /etc/odtd/odtd.yaml (one config for both)
  unit     /etc/systemd/system/odtd.service (+ a drop-in when the jtop/video groups are missing)
  odtctl   /usr/local/bin/odtctl -> /opt/odtd/venv/bin/odtctl
  systemd  daemon-reload and enable (it does not start odtd; it prints how)

Options:
  --dry-run      print every action, change nothing
  --root DIR     install into DIR instead of / (a scratch root or an image tree); the user,
                 the venv and daemon-reload are skipped there, with a note saying why
  --jetson       treat this as a Jetson (default: auto, from /etc/nv_tegra_release)
  --no-jetson    treat this as a non-Jetson machine
  --python PY    interpreter for the venv (default: python3; it must be >= 3.8; on a TX2
                 with JetPack 4.6 use python3.8)
  --no-trainer   off Jetson, leave out the [trainer] extra (TensorFlow)
  --worker-python PY
                 the trainer worker's interpreter, written as trainer.python into a new
                 odtd.yaml (default: auto, /usr/bin/python3.6 on a JetPack 4 Jetson whose
                 daemon runs another Python, else none: the daemon's own)
  --no-venv      skip the venv and pip step (print it instead)
  -h, --help     this text
EOF
}

die() { printf 'Error: %s\n' "$*" >&2; exit 1; }
step() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }

DRY_RUN=0
ROOT=/
JETSON=auto
PYTHON=python3
TRAINER=1
VENV_STEP=1
WORKER_PYTHON=auto

while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --root) (($# >= 2)) || die "--root needs a directory"; ROOT=$2; shift ;;
    --root=*) ROOT=${1#--root=} ;;
    --jetson) JETSON=1 ;;
    --no-jetson) JETSON=0 ;;
    --python) (($# >= 2)) || die "--python needs an interpreter"; PYTHON=$2; shift ;;
    --python=*) PYTHON=${1#--python=} ;;
    --no-trainer) TRAINER=0 ;;
    --worker-python) (($# >= 2)) || die "--worker-python needs an interpreter (or none)"; WORKER_PYTHON=$2; shift ;;
    --worker-python=*) WORKER_PYTHON=${1#--worker-python=} ;;
    --no-venv) VENV_STEP=0 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1'; see --help" ;;
  esac
  shift
done

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -f $SRC/pyproject.toml && -f $SRC/deploy/odtd.service && -f $SRC/docs/jetson.md ]] ||
  die "$SRC does not look like an odtd checkout (no pyproject.toml, deploy/odtd.service or docs/jetson.md)"

[[ $ROOT == /* ]] || die "--root $ROOT: give an absolute path"
ROOT=$(realpath -m "$ROOT")
# P prefixes every target path: empty when installing into the running system.
P=${ROOT%/}
if [[ $ROOT != / && ! -d $ROOT ]]; then
  die "--root $ROOT: no such directory; create it first"
fi
if [[ $ROOT == / && $DRY_RUN == 0 && $EUID != 0 ]]; then
  die "installing into / needs root; run it with sudo (or try --dry-run)"
fi

VENV=/opt/odtd/venv
ETC=/etc/odtd
STATE=/var/lib/odtd
UNIT_DIR=/etc/systemd/system
UNIT=$UNIT_DIR/odtd.service
DROPIN=$UNIT_DIR/odtd.service.d/10-groups.conf
LINK=/usr/local/bin/odtctl
UNIT_GROUPS="jtop video"

# Print a command, then run it unless --dry-run.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if ((DRY_RUN == 0)); then
    "$@"
  fi
}

# Write CONTENT to DEST with MODE (printed in full, written unless --dry-run).
write_file() {
  local dest=$1 mode=$2 content=$3
  printf '+ write %s (mode %s):\n' "$dest" "$mode"
  printf '%s\n' "$content" | sed 's/^/    | /'
  if ((DRY_RUN == 0)); then
    mkdir -p "$(dirname "$dest")"
    printf '%s\n' "$content" >"$dest.tmp"
    chmod "$mode" "$dest.tmp"
    mv -f "$dest.tmp" "$dest"
  fi
}

# Whether group $1 exists on the target system (its /etc/group under --root).
group_exists() {
  if [[ $ROOT == / ]]; then
    getent group "$1" >/dev/null
  else
    grep -q "^$1:" "$P/etc/group" 2>/dev/null
  fi
}

if [[ $JETSON == auto ]]; then
  if [[ -f $P/etc/nv_tegra_release ]]; then JETSON=1; else JETSON=0; fi
fi
if ((JETSON)); then
  EXTRA="[jetson]"
elif ((TRAINER)); then
  EXTRA="[trainer]"
else
  EXTRA=""
fi
VENV_ARGS=()
if ((JETSON)); then VENV_ARGS=(--system-site-packages); fi
# JetPack 4 ships Python 3.6, the only one NVIDIA builds its TensorFlow for, while the daemon
# needs >= 3.8 (--python python3.8): the worker then runs JetPack's Python (docs/jetson.md).
JETPACK_PYTHON=/usr/bin/python3.6
if [[ $WORKER_PYTHON == auto ]]; then
  WORKER_PYTHON=none
  if ((JETSON)) && [[ -e $P$JETPACK_PYTHON && $(basename "$PYTHON") != python3.6 ]]; then
    WORKER_PYTHON=$JETPACK_PYTHON
  fi
fi
[[ $WORKER_PYTHON == none || $WORKER_PYTHON == /* ]] ||
  die "--worker-python $WORKER_PYTHON: give an absolute path (or none)"

# The supplementary groups the unit can have here: a group missing from the system would
# make systemd fail the unit with status 216/GROUP.
WANT_GROUPS=()
group_exists jtop && WANT_GROUPS+=(jtop)
((JETSON)) && group_exists video && WANT_GROUPS+=(video)

printf 'odtd install: checkout %s, root %s, jetson: %s\n' "$SRC" "$ROOT" "$(if ((JETSON)); then echo yes; else echo no; fi)"
if ((DRY_RUN)); then printf 'dry run: every action is printed, nothing is changed\n'; fi

# -- user ----------------------------------------------------------------------------------
step "user: system user and group odtd (home $STATE, no login shell)"
if [[ $ROOT != / ]]; then
  # useradd --root would chroot into DIR and needs a complete system there (passwd, group,
  # shadow, login.defs); a scratch root is not one. For an image, run this script in a
  # chroot of it instead.
  note "skipped: --root $ROOT is not the running system; on the target this step runs:"
  note "groupadd --system odtd"
  note "useradd --system --gid odtd --home-dir $STATE --no-create-home --shell /usr/sbin/nologin odtd"
  for group in "${WANT_GROUPS[@]}"; do note "usermod -a -G $group odtd"; done
else
  if getent group odtd >/dev/null; then
    note "ok: group odtd exists"
  else
    run groupadd --system odtd
  fi
  if id -u odtd >/dev/null 2>&1; then
    note "ok: user odtd exists"
  else
    run useradd --system --gid odtd --home-dir "$STATE" --no-create-home \
      --shell /usr/sbin/nologin --comment "odtd daemon" odtd
  fi
  for group in "${WANT_GROUPS[@]}"; do
    if id -nG odtd 2>/dev/null | tr ' ' '\n' | grep -qx "$group"; then
      note "ok: odtd is in group $group"
    else
      run usermod -a -G "$group" odtd
    fi
  done
  if ! group_exists jtop; then
    note "no jtop group (jetson-stats not installed): the jtop telemetry backend is off;"
    note "re-run this script after installing jetson-stats"
  fi
fi

# -- venv ----------------------------------------------------------------------------------
if ((JETSON)); then
  step "venv: $VENV with --system-site-packages (the system's TensorFlow), pip install $SRC$EXTRA"
else
  step "venv: $VENV, pip install $SRC$EXTRA"
fi
venv_plan=(
  "$PYTHON -m venv ${VENV_ARGS[*]:+${VENV_ARGS[*]} }$VENV"
  "$VENV/bin/python -m pip install --upgrade pip"
  "$VENV/bin/python -m pip install --upgrade $SRC$EXTRA"
)
if ((VENV_STEP == 0)); then
  note "skipped (--no-venv); it would run:"
  for line in "${venv_plan[@]}"; do note "$line"; done
elif [[ $ROOT != / ]]; then
  # A venv is not relocatable: its scripts name their interpreter by absolute path, so one
  # built under $ROOT would point into $ROOT once that tree becomes /.
  note "skipped: a venv built under --root $ROOT would not work once that tree is /;"
  note "on the target it runs:"
  for line in "${venv_plan[@]}"; do note "$line"; done
else
  command -v "$PYTHON" >/dev/null || die "--python $PYTHON: not found; install it or pass --python PATH"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 8))' ||
    die "$PYTHON is $("$PYTHON" -V 2>&1); odtd needs Python >= 3.8 (on JetPack 4.6: apt install python3.8 python3.8-venv, then --python python3.8)"
  "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null ||
    die "$PYTHON has no venv/ensurepip module; install it (apt install $(basename "$PYTHON")-venv)"
  want_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  want_site=$( ((JETSON)) && echo true || echo false)
  if [[ -x $VENV/bin/python ]]; then
    have_version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
    have_site=$(sed -n 's/^include-system-site-packages *= *//p' "$VENV/pyvenv.cfg" 2>/dev/null || true)
    if [[ $have_version == "$want_version" && $have_site == "$want_site" ]]; then
      note "ok: $VENV exists (Python $have_version, system site-packages $have_site)"
    else
      note "rebuilding $VENV: it has Python $have_version, system site-packages ${have_site:-?}"
      run "$PYTHON" -m venv --clear "${VENV_ARGS[@]}" "$VENV"
    fi
  else
    run "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV"
  fi
  run "$VENV/bin/python" -m pip install --upgrade pip
  run "$VENV/bin/python" -m pip install --upgrade "$SRC$EXTRA"
fi

# -- config --------------------------------------------------------------------------------
step "config: $ETC/odtd.yaml and $ETC/policy.yaml (installed only if absent)"
# Install $1 as $2 unless $2 exists; never overwrite a file the user may have edited.
install_config() {
  local src=$1 dest=$P$2
  if [[ ! -e $dest ]]; then
    run install -D -m 0644 "$src" "$dest"
  elif cmp -s "$src" "$dest"; then
    note "ok: $dest is the current default"
    if [[ -e $dest.default ]]; then run rm -f "$dest.default"; fi
  elif [[ -e $dest.default ]] && cmp -s "$src" "$dest.default"; then
    note "kept: $dest differs from the default; the new default is at $dest.default"
  else
    note "kept: $dest differs from the default; the new default is at $dest.default"
    run install -m 0644 "$src" "$dest.default"
  fi
}
if [[ ! -d $P$ETC ]]; then run install -d -m 0755 "$P$ETC"; fi
CONFIG_SRC=$SRC/deploy/odtd.yaml
if [[ $WORKER_PYTHON != none ]]; then
  # The shipped default with the worker's interpreter set: what a new odtd.yaml gets, and the
  # default an existing one is compared with.
  CONFIG_SRC=$(mktemp)
  trap 'rm -f "$CONFIG_SRC"' EXIT
  sed "s|^  python: null\$|  python: $WORKER_PYTHON|" "$SRC/deploy/odtd.yaml" >"$CONFIG_SRC"
  grep -q "^  python: $WORKER_PYTHON\$" "$CONFIG_SRC" ||
    die "$SRC/deploy/odtd.yaml has no '  python: null' line under trainer: to set"
  note "trainer.python: $WORKER_PYTHON (the worker's interpreter)"
fi
install_config "$CONFIG_SRC" "$ETC/odtd.yaml"
if [[ $WORKER_PYTHON != none && -f $P$ETC/odtd.yaml ]] &&
  ! grep -q "^  python: $WORKER_PYTHON\$" "$P$ETC/odtd.yaml"; then
  note "your $P$ETC/odtd.yaml does not name $WORKER_PYTHON as trainer.python; set it there"
fi
if [[ -f $SRC/policies/default.yaml ]]; then
  install_config "$SRC/policies/default.yaml" "$ETC/policy.yaml"
else
  note "skipped $ETC/policy.yaml: $SRC/policies/default.yaml does not exist"
fi

# -- worker --------------------------------------------------------------------------------
step "worker: the trainer worker's interpreter"
if [[ $WORKER_PYTHON == none ]]; then
  note "the daemon's own Python (trainer.python: null)"
elif [[ ! -e $P$WORKER_PYTHON ]]; then
  note "$P$WORKER_PYTHON does not exist: install it, or pass --worker-python"
# What a worker needs, asked of the interpreter itself (read-only, so also under --dry-run);
# after the venv, `odtctl doctor` checks it as a worker runs (the next steps below).
elif found=$("$P$WORKER_PYTHON" -c 'import sys, tensorflow as tf; print("Python %d.%d.%d, TensorFlow %s" % (sys.version_info[:3] + (tf.__version__,)))' 2>/dev/null); then
  note "ok: $WORKER_PYTHON: $found"
else
  note "$WORKER_PYTHON cannot import TensorFlow: install NVIDIA's wheel for this JetPack (docs/jetson.md, step 2)"
fi

# -- state ---------------------------------------------------------------------------------
step "state: $STATE (mode 0770, user and group odtd)"
if [[ -d $P$STATE ]]; then
  note "ok: $P$STATE exists (kept as it is; systemd fixes its owner at start)"
elif [[ $ROOT == / ]]; then
  run install -d -m 0770 -o odtd -g odtd "$STATE"
else
  # No odtd user to chown to here; StateDirectory= chowns it at the first start.
  run install -d -m 0770 "$P$STATE"
fi
# odtctl reads ODTD_HOME/odtd.yaml while the service reads /etc/odtd/odtd.yaml: a link makes
# them one file, so `odtctl init` and `odtctl profile` run the worker as the daemon does
# (trainer.python on a TX2). An existing file there is the user's and stays.
if [[ -e $P$STATE/odtd.yaml || -L $P$STATE/odtd.yaml ]]; then
  note "ok: $P$STATE/odtd.yaml exists (left as it is)"
else
  run ln -s "$ETC/odtd.yaml" "$P$STATE/odtd.yaml"
  if [[ $ROOT == / ]]; then run chown -h odtd:odtd "$STATE/odtd.yaml"; fi
fi

# -- unit ----------------------------------------------------------------------------------
step "unit: $UNIT"
if [[ -f $P$UNIT ]] && cmp -s "$SRC/deploy/odtd.service" "$P$UNIT"; then
  note "ok: $P$UNIT is current"
else
  run install -D -m 0644 "$SRC/deploy/odtd.service" "$P$UNIT"
fi
DOC=/opt/odtd/docs/jetson.md
if [[ -f $P$DOC ]] && cmp -s "$SRC/docs/jetson.md" "$P$DOC"; then
  note "ok: $P$DOC (the unit's Documentation=) is current"
else
  run install -D -m 0644 "$SRC/docs/jetson.md" "$P$DOC"
fi
if [[ "${WANT_GROUPS[*]}" == "$UNIT_GROUPS" ]]; then
  if [[ -e $P$DROPIN ]]; then run rm -f "$P$DROPIN"; fi
  note "ok: groups $UNIT_GROUPS exist, the unit's SupplementaryGroups= applies as is"
else
  dropin="# Written by odtd's deploy/install.sh: the unit's SupplementaryGroups=$UNIT_GROUPS
# names groups this machine lacks, and a missing group fails the unit (status 216/GROUP).
# Re-run install.sh after installing jetson-stats (group jtop) to update this file.
[Service]
SupplementaryGroups="
  if ((${#WANT_GROUPS[@]})); then dropin+=$'\n'"SupplementaryGroups=${WANT_GROUPS[*]}"; fi
  if [[ -f $P$DROPIN ]] && [[ $(cat "$P$DROPIN") == "$dropin" ]]; then
    note "ok: $P$DROPIN is current"
  else
    write_file "$P$DROPIN" 0644 "$dropin"
  fi
fi

# -- odtctl --------------------------------------------------------------------------------
step "odtctl: $LINK -> $VENV/bin/odtctl"
if [[ -L $P$LINK && $(readlink "$P$LINK") == "$VENV/bin/odtctl" ]]; then
  note "ok: $P$LINK points at $VENV/bin/odtctl"
elif [[ -e $P$LINK && ! -L $P$LINK ]]; then
  note "left alone: $P$LINK exists and is not a symlink; remove it to get odtd's odtctl"
else
  run install -d -m 0755 "$(dirname "$P$LINK")"
  run ln -sfn "$VENV/bin/odtctl" "$P$LINK"
fi

# -- systemd -------------------------------------------------------------------------------
step "systemd: daemon-reload, enable odtd.service"
if ! command -v systemctl >/dev/null; then
  note "skipped: no systemctl on this machine"
elif [[ $ROOT != / ]]; then
  note "daemon-reload skipped: no service manager runs for --root $ROOT"
  if systemctl --root="$ROOT" is-enabled --quiet odtd.service 2>/dev/null; then
    note "ok: odtd.service is enabled in $ROOT"
  else
    run systemctl --root="$ROOT" enable odtd.service
  fi
else
  if [[ -d /run/systemd/system ]]; then
    run systemctl daemon-reload
  else
    note "daemon-reload skipped: systemd is not running here (no /run/systemd/system)"
  fi
  if systemctl is-enabled --quiet odtd.service 2>/dev/null; then
    note "ok: odtd.service is enabled"
  else
    run systemctl enable odtd.service
  fi
fi

step "done"
if ((DRY_RUN)); then note "dry run: nothing was changed"; fi
if [[ $ROOT == / ]] && systemctl is-active --quiet odtd.service 2>/dev/null; then
  note "odtd is running the previous version: sudo systemctl restart odtd"
else
  note "first time: check the worker, create the state (once, as odtd, with the service's umask), then start:"
  note "  $VENV/bin/odtctl doctor --home $STATE"
  note "  sudo -u odtd sh -c 'umask 0007; ODTD_HOME=$STATE exec $VENV/bin/odtctl init --model densenet40'"
  note "  sudo systemctl start odtd"
fi
note "logs: journalctl -u odtd -f    status: odtctl status (members of group odtd, no sudo)"
note "let a user run odtctl without sudo: sudo usermod -a -G odtd USER (then log in again)"
