"""Prometheus exposition of odtd's state, for node_exporter's textfile collector.

The page is built by ``prometheus_client`` from a collector of odtd's own, registered in a
registry of its own (not the library's global one: the process's own CPU and memory are not
odtd's state, and ``odtctl metrics`` is a short-lived process anyway). Names follow
Prometheus's conventions: a counter's samples end in ``_total``; a gauge's name says its unit
(``_bytes``, ``_joules``, ``_seconds``, ``_ratio`` for a share in 0..1).

Imported only by ``odtctl metrics`` and by the daemon's session child (``daemon.tasks``),
never by the daemon itself: its idle footprint does not carry the library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from prometheus_client import CollectorRegistry, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from odtd.home.paths import Home
from odtd.report.status import daemon_status, storage_section
from odtd.store.database import OUTCOMES, Store
from odtd.store.records import kept

_MB = 1024 * 1024


def _family(kind: type, name: str, help_text: str, value: Optional[float],
            labels: Optional[dict[str, str]] = None) -> Metric:
    """One metric of one sample, or of none when ``value`` is None (then left off the page)."""
    family = kind(name, help_text, labels=list(labels or {}))
    if value is not None:
        family.add_metric(list((labels or {}).values()), float(value))
    return family


def _labelled(kind: type, name: str, help_text: str, label: str,
              values: Sequence[tuple[str, float]]) -> Metric:
    family = kind(name, help_text, labels=[label])
    for label_value, value in values:
        family.add_metric([label_value], float(value))
    return family


def metric_families(home: Home, store: Store) -> list[Metric]:
    """The last finished session's figures, counts, daemon liveness and the home's disk.

    A metric without a value (no session yet, no energy meter) has no sample and is left off.
    """
    done = store.sessions(limit=1, done_only=True)
    last: dict[str, Any] = done[0].to_dict() if done else {}
    counts = store.sample_counts()
    outcomes = store.outcome_counts()
    model = {"model": str(store.meta("model"))}
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    peak_mb = last.get("peak_memory_mb")
    families = [
        _family(gauge, "odtd_up", "1 when the daemon's heartbeat is fresh",
                int(daemon_status(store)["running"])),
        _labelled(counter, "odtd_sessions_total", "Finished sessions by outcome", "outcome",
                  [(outcome, outcomes[outcome]) for outcome in OUTCOMES]),
        _family(gauge, "odtd_samples_pending", "Samples waiting for a session", counts["pending"]),
        _family(gauge, "odtd_samples_stored", "Samples in the home (pending, trained, holdout)",
                counts["total"]),
        _family(gauge, "odtd_samples_unlabelled", "Images without a label in the home",
                counts["unlabelled"]),
        _family(counter, "odtd_samples_quarantined_total", "Inputs rejected at ingest",
                counts["quarantined"]),
        _family(gauge, "odtd_model_accuracy_ratio",
                "Validation accuracy of the model kept after the last session (0..1)",
                kept(last.get("outcome"), last.get("accuracy_before"), last.get("accuracy_after")),
                model),
        _family(gauge, "odtd_last_session_accuracy_before_ratio",
                "Validation accuracy before the last session (0..1)", last.get("accuracy_before"),
                model),
        _family(gauge, "odtd_last_session_accuracy_after_ratio",
                "Validation accuracy of the last session's candidate (0..1)",
                last.get("accuracy_after"), model),
        _family(gauge, "odtd_last_session_energy_joules", "Board energy of the last session",
                last.get("energy_j"), model),
        _labelled(gauge, "odtd_last_session_rail_energy_joules",
                  "Energy of the last session per power rail", "rail",
                  sorted((last.get("energy_by_rail_j") or {}).items())),
        _family(gauge, "odtd_last_session_peak_memory_bytes", "Peak RSS of the last session's worker",
                None if peak_mb is None else peak_mb * _MB, model),
        _family(gauge, "odtd_last_session_duration_seconds", "Duration of the last session",
                last.get("duration_s"), model),
    ]
    storage = storage_section(home, store)
    if not storage.get("error"):
        pruned = storage["pruned"]
        families += [
            _family(gauge, "odtd_storage_free_bytes", "Free bytes on the home's filesystem",
                    storage["free_bytes"]),
            _family(gauge, "odtd_storage_min_free_bytes",
                    "The floor odtd keeps free (storage.min_free_mb)", storage["min_free_bytes"]),
            _family(gauge, "odtd_storage_writable",
                    "1 when the home can be written (0: read-only or gone)",
                    int(storage["problem"] is None)),
            _family(counter, "odtd_storage_prunings_total", "Times odtd pruned to stay above the floor",
                    pruned["times"]),
            _family(counter, "odtd_storage_pruned_bytes_total", "Bytes freed by pruning",
                    pruned["freed_bytes"]),
            _family(counter, "odtd_storage_pruned_samples_total",
                    "Samples pruned (trained, or unlabelled and no longer read)",
                    pruned["samples"]),
        ]
    return [family for family in families if family.samples]


class _Snapshot:
    """A collector of families read once: a scrape of the file sees one moment of the store."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """Yield the families (``prometheus_client``'s collector interface)."""
        return iter(self.families)


def registry(home: Home, store: Store) -> CollectorRegistry:
    """A registry of its own holding odtd's metrics, read from ``store`` now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metric_families(home, store)))
    return registry


def prometheus_text(home: Home, store: Store) -> str:
    """Return the metrics page in Prometheus's text format."""
    return generate_latest(registry(home, store)).decode("utf-8")


def write_textfile(path: Path, home: Home, store: Store) -> None:
    """Write the page to ``path`` atomically (node_exporter never reads a half-written file).

    ``prometheus_client`` writes a temporary file beside ``path`` and renames it over.
    """
    write_to_textfile(str(path), registry(home, store))
