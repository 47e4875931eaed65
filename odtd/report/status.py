"""What ``odtctl status`` and ``history`` show: built from SQLite alone (the daemon may be down)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from odtd.atomic import pid_alive
from odtd.errors import OdtdError
from odtd.home.disk import mb, storage_status
from odtd.home.paths import Home
from odtd.home.versions import ModelRepo
from odtd.report.efficiency import cumulative_efficiency
from odtd.store.database import Store
from odtd.store.records import JUDGED, kept
from odtd.table import table

HEARTBEAT_STALE_S = 30.0
_SPARKS = "▁▂▃▄▅▆▇█"


def daemon_status(store: Store) -> dict[str, Any]:
    """Return the ``daemon`` section: running, pid, heartbeat_age_s, next_session_at, paused."""
    row = store.daemon_row() or {}
    age = None
    if row.get("heartbeat_at"):
        beat = datetime.fromisoformat(row["heartbeat_at"])
        age = round((datetime.now(timezone.utc) - beat).total_seconds(), 1)
    alive = row.get("state") == "running" and pid_alive(row.get("pid"))
    running = bool(alive and age is not None and age < HEARTBEAT_STALE_S)
    return {
        "running": running,
        "pid": row.get("pid") if running else None,
        "heartbeat_age_s": age,
        "next_session_at": row.get("next_session_at") if running else None,
        "paused": bool(row.get("paused")) if running else False,
        "started_at": row.get("started_at"),
        # alive but silent: a daemon that cannot write its heartbeat (a read-only disk)
        "silent_pid": row.get("pid") if alive and not running else None,
    }


def model_status(home: Home, store: Store) -> dict[str, Any]:
    """Return the ``model`` section: name, version, accuracy (of the current version), resume.

    The accuracy is the one measured when the version was promoted; for a version that was
    never promoted (version 0) the latest session's measure of it (``Store.measured_accuracy``).

    ``resume`` is the refused candidate the next session goes on from (``training.resume_within``),
    as ``{"session", "accuracy", "current_accuracy"}`` on the validation set, else None.
    """
    name = store.meta("model")
    repo = ModelRepo(home.models, name)
    version = repo.current()
    manifest = repo.manifest(version)
    resume = None
    if repo.resume_path.exists():
        kept = store.last_kept_for_resume()
        if kept:
            resume = {"session": kept.id, "accuracy": kept.accuracy_after,
                      "current_accuracy": kept.accuracy_before}
    accuracy = manifest.get("metrics", {}).get("accuracy")
    if accuracy is None:  # version 0 has no figure until a session measures it
        accuracy = store.measured_accuracy(version)
    return {"name": name, "version": version, "accuracy": accuracy,
            "param_count": manifest.get("param_count"), "sha256": manifest.get("sha256"),
            "resume": resume}


def learning_rate_status(home: Home, store: Store, model: str) -> Optional[dict[str, Any]]:
    """The rate sessions of ``model`` start at under the home's policy (None: invalid policy)."""
    from odtd.policy import load_policy
    from odtd.session.learning_rate import starting_rate

    try:
        policy = load_policy(home.policy_path(home.load_config()))
    except OdtdError:
        return None
    return starting_rate(store, model, policy.training).to_dict()


def gates_status(home: Home) -> dict[str, Any]:
    """Return the ``gates`` section: each configured gate's verdict right now."""
    from odtd.policy import load_policy
    from odtd.session.gates import FORCE_CLOSED_FILE, check_gates

    try:
        policy = load_policy(home.policy_path(home.load_config()))
    except OdtdError as exc:
        return {"error": str(exc), "gates": []}
    results = check_gates(policy.gates, force_file=home.run / FORCE_CLOSED_FILE)
    return {"error": None, "gates": [{"name": r.name, "passed": r.passed, "value": r.value,
                                      "reason": r.reason} for r in results]}


def storage_section(home: Home, store: Store) -> dict[str, Any]:
    """Return the ``storage`` section: the home's disk (``home.disk.storage_status``)."""
    try:
        storage = home.load_config().storage
    except OdtdError as exc:
        return {"error": str(exc)}
    return {"error": None, **storage_status(home, store, storage)}


def status(home: Home, store: Store, limit: int = 10) -> dict[str, Any]:
    """Return the ``odtctl status --json`` object."""
    model = model_status(home, store)
    model["learning_rate"] = learning_rate_status(home, store, model["name"])
    return {
        "home": str(home.root),
        "daemon": daemon_status(store),
        "model": model,
        "samples": store.sample_counts(),
        "storage": storage_section(home, store),
        "gates": gates_status(home),
        "sessions": session_objects(store, limit),
    }


def storage_lines(storage: dict[str, Any]) -> list[str]:
    """The ``storage`` section for people: free space and the floor, a problem, pruning."""
    if storage.get("error"):
        return [f"storage  odtd.yaml invalid: {storage['error']}"]
    free, floor = mb(storage["free_bytes"]), mb(storage["min_free_bytes"])
    lines = [f"storage  {free} free of {mb(storage['total_bytes'])} on the filesystem of "
             f"{storage['path']}; floor {floor} (storage.min_free_mb)"]
    if storage["problem"]:
        lines.append(f"         PROBLEM: {storage['problem']}; sessions and ingest wait, the "
                     "daemon retries on its schedule")
    elif storage["below_floor"]:
        lines.append(f"         BELOW THE FLOOR: ingest refuses and a session that does not fit is "
                     f"skipped; free space on that disk (odtd may prune: "
                     f"{', '.join(storage['prune']) or 'nothing'})")
    pruned = storage["pruned"]
    if pruned["times"]:
        times = "once" if pruned["times"] == 1 else f"{pruned['times']} times"
        lines.append(f"         pruned {times}, {mb(pruned['freed_bytes'])} freed in all "
                     f"({pruned['samples']} samples); last at {pruned['last_at']}: {pruned['last']}")
    return lines


def session_objects(store: Store, limit: Optional[int] = None) -> list[dict[str, Any]]:
    """The most recent sessions' objects, each with its ``cumulative`` energy per point."""
    every = store.sessions()
    figures = cumulative_efficiency(every)
    return [{**s.to_dict(), "cumulative": figures[s.id]} for s in every[:limit]]


def pct(value: Optional[float]) -> str:
    """An accuracy (0..1) as '61.6%', or '-' when unknown."""
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: Optional[float], fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def sparkline(values: list[float]) -> str:
    """Render values as a one-line bar chart."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_SPARKS[int((v - low) / span * (len(_SPARKS) - 1))] for v in values)


def energy_text(session: dict[str, Any]) -> str:
    """'123.4 J (0.034 Wh)' or '-'."""
    energy = session.get("energy_j")
    if energy is None:
        return "-"
    return f"{energy:.1f} J ({energy / 3600:.4f} Wh)"


def _points(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:.1f} pt"


def sessions_table(sessions: list[dict[str, Any]]) -> list[str]:
    """Render sessions (most recent first) as aligned text lines.

    ``acc before/after`` are on the acceptance set (the fixed validation set when there is one),
    ``holdout`` is the candidate's accuracy on the device's held-out samples, ``reference``
    the served model's and the candidate's on the reference set (the original domain; the
    candidate's ``-`` when validation refused it and it was not scored there),
    ``forgetting`` the best earlier accuracy of a kept model minus the kept model's now, in
    points, ``J/pt`` the energy of every session so far per point the kept model gained since
    day 0 (``report.efficiency``; ``-`` without a gain).
    """
    header = ("id", "day", "outcome", "batch", "new", "replay", "acc before", "acc after",
              "holdout", "reference", "forgetting", "energy", "J/pt", "source", "peak MB", "time s")
    rows = []
    for s in sessions:
        details = s.get("details") or {}
        rows.append((
            str(s["id"]), s["day"] or "-", s["outcome"] or s.get("state") or "-",
            _num(s["batch_size"]), _num(s["samples_new"]), _num(s["samples_replay"]),
            pct(s["accuracy_before"]), pct(s["accuracy_after"]),
            pct(details.get("holdout_accuracy_after")), _reference(details),
            _points(details.get("forgetting")),
            energy_text(s), _num((s.get("cumulative") or {}).get("j_per_point")),
            s.get("energy_source") or "-", _num(s["peak_memory_mb"]),
            _num(s["duration_s"], "{:.1f}"),
        ))
    return table(rows, header)


def _reference(details: dict[str, Any]) -> str:
    before, after = details.get("reference_accuracy_before"), details.get("reference_accuracy_after")
    if before is None:
        return "-"
    return f"{pct(before)}->{pct(after)}"


def render_status(data: dict[str, Any]) -> str:
    """Render the status object for people."""
    d, m, s = data["daemon"], data["model"], data["samples"]
    lines = [f"odtd home {data['home']}"]
    if d["running"]:
        state = "paused" if d["paused"] else "running"
        lines.append(f"daemon   {state} (pid {d['pid']}, heartbeat {d['heartbeat_age_s']} s ago); "
                     f"next session {d['next_session_at'] or '-'}")
    elif d.get("silent_pid"):
        lines.append(f"daemon   pid {d['silent_pid']} is alive but its heartbeat is "
                     f"{d['heartbeat_age_s']} s old (see storage; `journalctl -u odtd`)")
    else:
        lines.append("daemon   not running (start it with `odtd run` or `systemctl start odtd`)")
    lines.append(f"model    {m['name']} v{m['version']}  accuracy {pct(m['accuracy'])}  "
                 f"({m['param_count']:,} parameters)")
    if m.get("resume"):
        r = m["resume"]
        lines.append(f"         training goes on from session {r['session']}'s refused candidate: "
                     f"{pct(r['accuracy'])} on validation against the served model's "
                     f"{pct(r['current_accuracy'])}")
    rate = m.get("learning_rate") or {}
    if rate.get("found_by"):
        lines.append(f"         learning rate {rate['rate']:g}: the policy's "
                     f"{rate['policy_rate']:g} diverged on this model ({rate['found_by']}); "
                     "sessions start at the lower rate until training.learning_rate changes")
    lines.append(f"samples  labelled {s['total']} (pending {s['pending']}  trained {s['trained']}  "
                 f"holdout {s['holdout']})  unlabelled {s['unlabelled']}  "
                 f"quarantined {s['quarantined']}" +
                 (f"  pruned {s['pruned']}" if s.get("pruned") else ""))
    if data.get("storage"):
        lines.extend(storage_lines(data["storage"]))
    gates = data.get("gates") or {}
    if gates.get("error"):
        lines.append(f"gates    policy invalid: {gates['error']}")
    elif gates.get("gates"):
        lines.append("gates    " + "; ".join(
            f"{g['name']} {'open' if g['passed'] else 'CLOSED'} ({g['reason']})" for g in gates["gates"]))
    else:
        lines.append("gates    none configured in the policy")
    sessions = data["sessions"]
    if not sessions:
        lines.append("sessions none yet: `odtctl ingest DIR` then `odtctl train-now`")
        return "\n".join(lines)
    lines.append("sessions (most recent first)")
    lines.extend("  " + line for line in sessions_table(sessions))
    last = sessions[0]
    if last["outcome"] in ("failed", "skipped") and last.get("reason"):
        lines.append(f"last session {last['id']} {last['outcome']}: {last['reason']}")
    rails = sessions[0].get("energy_by_rail_j")
    if rails:
        split = "  ".join(f"{rail} {joules:.1f} J" for rail, joules in sorted(rails.items()))
        lines.append(f"last session energy by rail: {split} (coverage "
                     f"{pct(sessions[0].get('energy_coverage'))})")
    per_class = next((x["details"].get("per_class_after") for x in sessions
                      if (x.get("details") or {}).get("per_class_after")), None)
    if per_class:
        lines.append("per class (latest evaluated candidate)  " + "  ".join(
            f"{name} {pct(value)}" for name, value in per_class.items()))
    # The kept model's accuracy after each session: a rolled-back candidate's is not the model's.
    trend = [kept(x["outcome"], x["accuracy_before"], x["accuracy_after"])
             for x in reversed(sessions) if x["outcome"] in JUDGED]
    trend = [value for value in trend if value is not None]
    if trend:
        lines.append(f"accuracy trend  {sparkline(trend)}  {pct(trend[0])} -> {pct(trend[-1])}")
    return "\n".join(lines)
