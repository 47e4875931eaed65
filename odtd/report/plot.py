"""``odtctl plot``: accuracy, energy and peak memory over the days, in one figure (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from odtd.errors import OdtdError

_COLOURS = {"promoted": "#2a9d8f", "rolled_back": "#e9c46a", "failed": "#e76f51",
            "interrupted": "#8d99ae", "skipped": "#d9d9d9"}


def kept_accuracy(session: dict[str, Any], key_before: str, key_after: str) -> Any:
    """Accuracy of the model kept after a session (a rolled-back candidate's is not kept)."""
    if session["outcome"] == "promoted":
        return session.get(key_after)
    return session.get(key_before)


def plot_sessions(sessions: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Draw sessions (oldest first) into a PNG with three stacked panels.

    Raises:
        OdtdError: matplotlib is missing (``pip install 'odtd[plot]'``) or nothing to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a board or in CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise OdtdError("odtctl plot needs matplotlib: pip install 'odtd[plot]'") from None
    trained = [s for s in sessions if s["outcome"] != "skipped"]
    if not trained:
        raise OdtdError("no sessions to plot yet; run `odtctl train-now` or `odtctl simulate`")
    x = list(range(1, len(trained) + 1))
    labels = [s["day"] for s in trained]
    fig, (ax_acc, ax_energy, ax_mem) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    fig.suptitle(title)

    validation = [_percent(kept_accuracy(s, "accuracy_before", "accuracy_after")) for s in trained]
    holdout = [_percent(kept_accuracy({**s.get("details", {}), "outcome": s["outcome"]},
                                  "holdout_accuracy_before", "holdout_accuracy_after")) for s in trained]
    candidate = [_percent(s.get("accuracy_after")) for s in trained]
    ax_acc.plot(x, validation, "o-", color="#264653", label="kept model, validation set")
    if any(v is not None for v in holdout):
        ax_acc.plot(x, holdout, "s--", color="#2a9d8f", label="kept model, device hold-out")
    ax_acc.scatter(x, candidate, marker="x", color="#e76f51", label="candidate (before acceptance)",
                   zorder=3)
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.legend(loc="best", fontsize=8)
    ax_acc.grid(alpha=0.3)

    energy = [s.get("energy_j") or 0.0 for s in trained]
    colours = [_COLOURS.get(s["outcome"], "#999999") for s in trained]
    ax_energy.bar(x, energy, color=colours)
    source = next((s.get("energy_source") for s in trained if s.get("energy_source")), None)
    ax_energy.set_ylabel(f"energy per session (J)\nsource: {source or 'none'}")
    ax_energy.grid(alpha=0.3, axis="y")
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=outcome) for outcome, colour in _COLOURS.items()
               if any(s["outcome"] == outcome for s in trained)]
    ax_energy.legend(handles=handles, loc="best", fontsize=8)

    peaks = [s.get("peak_memory_mb") for s in trained]
    ax_mem.plot(x, peaks, "o-", color="#6d597a")
    ax_mem.set_ylabel("worker peak memory (MB)")
    # From zero: differences of a few MB must not look like growth.
    ax_mem.set_ylim(0, 1.15 * max([p for p in peaks if p is not None] or [1.0]))
    ax_mem.grid(alpha=0.3)
    ax_mem.set_xticks(x)
    ax_mem.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax_mem.set_xlabel("session day")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _percent(value: Any) -> Any:
    return None if value is None else value * 100.0
