#!/usr/bin/env bash
# Remove what deploy/install.sh installed. Keeps the configuration (/etc/odtd), the state
# (/var/lib/odtd: samples, models, history) and the odtd user unless --purge.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: sudo deploy/uninstall.sh [options]

Stops and disables odtd.service, then removes the unit (and install.sh's drop-in), /opt/odtd
(the venv) and the /usr/local/bin/odtctl link. Keeps /etc/odtd, /var/lib/odtd and the odtd
user and group, unless --purge.

Options:
  --purge      also remove /etc/odtd, /var/lib/odtd (every sample, model and session
               record), your drop-ins in odtd.service.d, and the odtd user and group
  --dry-run    print every action, change nothing
  --root DIR   uninstall from DIR instead of / (the user step is skipped there)
  -h, --help   this text
EOF
}

die() { printf 'Error: %s\n' "$*" >&2; exit 1; }
step() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }

DRY_RUN=0
ROOT=/
PURGE=0

while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --purge) PURGE=1 ;;
    --root) (($# >= 2)) || die "--root needs a directory"; ROOT=$2; shift ;;
    --root=*) ROOT=${1#--root=} ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1'; see --help" ;;
  esac
  shift
done

[[ $ROOT == /* ]] || die "--root $ROOT: give an absolute path"
ROOT=$(realpath -m "$ROOT")
P=${ROOT%/}
[[ -d $ROOT ]] || die "--root $ROOT: no such directory"
if [[ $ROOT == / && $DRY_RUN == 0 && $EUID != 0 ]]; then
  die "uninstalling from / needs root; run it with sudo (or try --dry-run)"
fi

OPT=/opt/odtd
VENV=$OPT/venv
ETC=/etc/odtd
STATE=/var/lib/odtd
UNIT_DIR=/etc/systemd/system
UNIT=$UNIT_DIR/odtd.service
DROPIN_DIR=$UNIT_DIR/odtd.service.d
DROPIN=$DROPIN_DIR/10-groups.conf
LINK=/usr/local/bin/odtctl

# Print a command, then run it unless --dry-run.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if ((DRY_RUN == 0)); then
    "$@"
  fi
}

SYSTEMD_RUNNING=0
if [[ $ROOT == / && -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
  SYSTEMD_RUNNING=1
fi

printf 'odtd uninstall: root %s, purge: %s\n' "$ROOT" "$(if ((PURGE)); then echo yes; else echo no; fi)"
if ((DRY_RUN)); then printf 'dry run: every action is printed, nothing is changed\n'; fi

# -- service -------------------------------------------------------------------------------
step "service: stop and disable odtd.service"
if ((SYSTEMD_RUNNING)) && systemctl is-active --quiet odtd.service; then
  run systemctl stop odtd.service
else
  note "ok: odtd.service is not running here"
fi
if [[ ! -e $P$UNIT ]]; then
  note "ok: no $P$UNIT"
elif command -v systemctl >/dev/null; then
  if [[ $ROOT == / ]]; then
    run systemctl disable odtd.service
  else
    run systemctl --root="$ROOT" disable odtd.service
  fi
else
  # No systemctl: undo what `systemctl enable` did (the [Install] WantedBy= link).
  run rm -f "$P$UNIT_DIR/multi-user.target.wants/odtd.service"
fi

# -- unit ----------------------------------------------------------------------------------
step "unit: $UNIT and install.sh's drop-in"
if [[ -e $P$UNIT ]]; then run rm -f "$P$UNIT"; else note "ok: $P$UNIT is gone"; fi
if [[ -e $P$DROPIN ]]; then run rm -f "$P$DROPIN"; fi
if [[ -d $P$DROPIN_DIR ]]; then
  if ((PURGE)); then
    run rm -rf "$P$DROPIN_DIR"
  elif [[ -z $(ls -A "$P$DROPIN_DIR") ]]; then
    run rmdir "$P$DROPIN_DIR"
  else
    note "kept: your drop-ins in $P$DROPIN_DIR (--purge removes them)"
  fi
fi
if ((SYSTEMD_RUNNING)); then
  run systemctl daemon-reload
  if systemctl is-failed --quiet odtd.service; then run systemctl reset-failed odtd.service; fi
else
  note "daemon-reload skipped: no running service manager for $ROOT"
fi

# -- venv ----------------------------------------------------------------------------------
step "venv: $OPT (the venv $VENV and the installed docs)"
if [[ -e $P$OPT ]]; then run rm -rf "$P$OPT"; else note "ok: no $P$OPT"; fi

# -- odtctl --------------------------------------------------------------------------------
step "odtctl: $LINK"
if [[ -L $P$LINK && $(readlink "$P$LINK") == "$VENV/bin/odtctl" ]]; then
  run rm -f "$P$LINK"
elif [[ -e $P$LINK || -L $P$LINK ]]; then
  note "left alone: $P$LINK is not install.sh's link to $VENV/bin/odtctl"
else
  note "ok: no $P$LINK"
fi

# -- config --------------------------------------------------------------------------------
step "config: $ETC"
if [[ ! -e $P$ETC ]]; then
  note "ok: no $P$ETC"
elif ((PURGE)); then
  run rm -rf "$P$ETC"
else
  note "kept: $P$ETC (your configuration; --purge removes it)"
fi

# -- state ---------------------------------------------------------------------------------
step "state: $STATE"
if [[ ! -e $P$STATE ]]; then
  note "ok: no $P$STATE"
elif ((PURGE)); then
  run rm -rf "$P$STATE"
else
  note "kept: $P$STATE (samples, models and session history; --purge removes it)"
fi

# -- user ----------------------------------------------------------------------------------
step "user: odtd"
if ((PURGE == 0)); then
  note "kept: user and group odtd (they own the kept state; --purge removes them)"
elif [[ $ROOT != / ]]; then
  note "skipped: --root $ROOT is not the running system; on the target this step runs:"
  note "userdel odtd; groupdel odtd"
else
  if id -u odtd >/dev/null 2>&1; then run userdel odtd; else note "ok: no user odtd"; fi
  # userdel removes a same-named primary group only with USERGROUPS_ENAB; make sure.
  if getent group odtd >/dev/null; then run groupdel odtd; else note "ok: no group odtd"; fi
fi

step "done"
if ((DRY_RUN)); then note "dry run: nothing was changed"; fi
