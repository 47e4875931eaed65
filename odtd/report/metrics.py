"""Prometheus text exposition of odtd's state, for node_exporter's textfile collector."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from odtd import atomic
from odtd.home.paths import Home
from odtd.report.status import daemon_status, storage_section
from odtd.store.database import OUTCOMES, Store
from odtd.store.records import kept


def _line(name: str, value: Optional[float], labels: str = "") -> list[str]:
    return [] if value is None else [f"odtd_{name}{labels} {float(value):g}"]


def prometheus_text(home: Home, store: Store) -> str:
    """Return the metrics page: the last finished session's figures, counts, daemon liveness."""
    metrics: list[tuple[str, str, str, list[str]]] = []
    done = store.sessions(limit=1, done_only=True)
    last: dict[str, Any] = done[0].to_dict() if done else {}
    counts = store.sample_counts()
    model = store.meta("model")
    daemon = daemon_status(store)
    outcomes = store.outcome_counts()

    def add(name: str, kind: str, help_text: str, lines: list[str]) -> None:
        metrics.append((name, kind, help_text, lines))

    add("up", "gauge", "1 when the daemon's heartbeat is fresh", _line("up", int(daemon["running"])))
    add("sessions_total", "counter", "Finished sessions by outcome",
        [f'odtd_sessions_total{{outcome="{o}"}} {outcomes[o]}' for o in OUTCOMES])
    add("samples_pending", "gauge", "Samples waiting for a session",
        _line("samples_pending", counts["pending"]))
    add("samples_total", "gauge", "Samples stored", _line("samples_total", counts["total"]))
    add("samples_quarantined", "gauge", "Inputs rejected at ingest",
        _line("samples_quarantined", counts["quarantined"]))
    labels = f'{{model="{model}"}}'
    kept_accuracy = kept(last.get("outcome"), last.get("accuracy_before"), last.get("accuracy_after"))
    add("model_accuracy", "gauge", "Validation accuracy of the model kept after the last session (0..1)",
        _line("model_accuracy", kept_accuracy, labels))
    add("last_session_accuracy_before", "gauge", "Validation accuracy before the last session",
        _line("last_session_accuracy_before", last.get("accuracy_before"), labels))
    add("last_session_accuracy_after", "gauge", "Validation accuracy of the last session's candidate",
        _line("last_session_accuracy_after", last.get("accuracy_after"), labels))
    add("last_session_energy_joules", "gauge", "Board energy of the last session",
        _line("last_session_energy_joules", last.get("energy_j"), labels))
    rails = last.get("energy_by_rail_j") or {}
    add("last_session_rail_energy_joules", "gauge", "Energy of the last session per power rail",
        [f'odtd_last_session_rail_energy_joules{{rail="{r}"}} {j:g}' for r, j in sorted(rails.items())])
    add("last_session_peak_memory_bytes", "gauge", "Peak RSS of the last session's worker",
        _line("last_session_peak_memory_bytes",
              None if last.get("peak_memory_mb") is None else last["peak_memory_mb"] * 1024 * 1024, labels))
    add("last_session_duration_seconds", "gauge", "Duration of the last session",
        _line("last_session_duration_seconds", last.get("duration_s"), labels))
    storage = storage_section(home, store)
    if not storage.get("error"):
        pruned = storage["pruned"]
        add("storage_free_bytes", "gauge", "Free bytes on the home's filesystem",
            _line("storage_free_bytes", storage["free_bytes"]))
        add("storage_min_free_bytes", "gauge", "The floor odtd keeps free (storage.min_free_mb)",
            _line("storage_min_free_bytes", storage["min_free_bytes"]))
        add("storage_writable", "gauge", "1 when the home can be written (0: read-only or gone)",
            _line("storage_writable", int(storage["problem"] is None)))
        add("storage_prunings_total", "counter", "Times odtd pruned to stay above the floor",
            _line("storage_prunings_total", pruned["times"]))
        add("storage_pruned_bytes_total", "counter", "Bytes freed by pruning",
            _line("storage_pruned_bytes_total", pruned["freed_bytes"]))
        add("storage_pruned_samples_total", "counter", "Trained samples pruned",
            _line("storage_pruned_samples_total", pruned["samples"]))
    lines: list[str] = []
    for name, kind, help_text, values in metrics:
        if values:
            lines += [f"# HELP odtd_{name} {help_text}", f"# TYPE odtd_{name} {kind}", *values]
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Write atomically (node_exporter must never read a half-written file)."""
    atomic.write_text(path, text, durable=False)
