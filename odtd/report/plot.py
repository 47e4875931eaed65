"""``odtctl plot``: a home's sessions over the days, or a reproduction's arms (matplotlib).

``plot_sessions``: accuracy, energy and peak memory per session. ``plot_arms``: every arm of
``scripts/reproduce_tx2_daily.py`` per day, shifted and clean, with their cumulative energy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from odtd import atomic
from odtd.errors import OdtdError
from odtd.store.records import kept

_COLOURS = {"promoted": "#2a9d8f", "rolled_back": "#e9c46a", "failed": "#e76f51",
            "interrupted": "#8d99ae", "skipped": "#d9d9d9"}


def pyplot() -> Any:
    """Matplotlib's pyplot, drawing to files (no display on a board or in CI)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OdtdError("odtctl plot needs matplotlib: pip install 'odtd[plot]'") from None
    return plt


def save_figure(plt: Any, fig: Any, out: Path) -> Path:
    """Lay ``fig`` out, write it to ``out`` (its suffix names the format) and close it."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.staged(out, durable=False) as staged:  # the suffix stays: it names the format
        fig.savefig(staged, dpi=110)
    plt.close(fig)
    return out


def plot_sessions(sessions: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Draw sessions (oldest first) into a PNG with three stacked panels.

    Raises:
        OdtdError: matplotlib is missing (``pip install 'odtd[plot]'``) or nothing to plot.
    """
    plt = pyplot()
    trained = [s for s in sessions if s["outcome"] != "skipped"]
    if not trained:
        raise OdtdError("no sessions to plot yet; run `odtctl train-now` or `odtctl simulate`")
    x = list(range(1, len(trained) + 1))
    labels = [s["day"] for s in trained]
    fig, (ax_acc, ax_energy, ax_mem) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    fig.suptitle(title)

    validation = [_percent(kept(s["outcome"], s.get("accuracy_before"), s.get("accuracy_after")))
                  for s in trained]
    holdout = [_percent(kept(s["outcome"], s.get("details", {}).get("holdout_accuracy_before"),
                             s.get("details", {}).get("holdout_accuracy_after"))) for s in trained]
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
    return save_figure(plt, fig, out)


def _percent(value: Any) -> Any:
    return None if value is None else value * 100.0


def mean_over_runs(summary: dict[str, Any], arm: str, key: str) -> list[Optional[float]]:
    """An arm's figure per day, averaged over the runs (None where a run has none)."""
    import numpy as np

    values = [[row["arms"][arm].get(key) for row in run["rows"]] for run in summary["runs"]]
    return [None if None in day else float(np.mean(day)) for day in zip(*values)]


def read_summary(path: Path) -> dict[str, Any]:
    """Read a reproduction's summary (``scripts/reproduce_tx2_daily.py --json``).

    Raises:
        OdtdError: unreadable, not JSON, or no ``arms`` in it.
    """
    import json

    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise OdtdError(f"cannot read a reproduction summary from {path}: {error}") from None
    if not isinstance(summary, dict) or "arms" not in summary or "runs" not in summary:
        raise OdtdError(f"{path} is not a reproduction summary (scripts/reproduce_tx2_daily.py "
                        "--json prints one)")
    return summary


def plot_arms(summary: dict[str, Any], out: Path) -> Path:
    """Draw a reproduction's arms (``scripts/reproduce_tx2_daily.py --json``) into a PNG.

    One panel per test domain (the shifted camera's images, clean ones): every arm's accuracy
    per day, averaged over the seeds; below, each arm's cumulative energy.

    Raises:
        OdtdError: matplotlib is missing, or ``summary`` is not a reproduction's summary.
    """
    plt = pyplot()
    import matplotlib
    import numpy as np

    try:
        domains = summary["test_images"]["domains"]
        arms, days = summary["arms"], list(range(summary["days"] + 1))
    except (KeyError, TypeError) as error:
        raise OdtdError(f"not a reproduction summary (scripts/reproduce_tx2_daily.py --json): "
                        f"no {error}") from None
    described = summary.get("arm_descriptions") or {}
    fig, axes = plt.subplots(len(domains) + 1, 1, figsize=(9, 3.6 * len(domains) + 2.4), sharex=True,
                             gridspec_kw={"height_ratios": [3] * len(domains) + [1.4]})
    seeds = summary.get("seeds") or [0]
    runs = f" (mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""
    for ax, domain in zip(axes, domains):
        for n, arm in enumerate(arms):
            label = f"{arm}: {described[arm]}" if arm in described else arm
            ax.plot(days, [np.nan if v is None else 100 * v for v in mean_over_runs(summary, arm, domain)],
                    "os^vDx"[n % 6] + "-", color=f"C{n}", label=label, ms=4)
        published = summary.get("published")
        if domain == "clean" and not summary["shift"] and published:
            ax.plot([0, 17], [published["day0"], published["day17"]], ":", color="grey",
                    label=f"published TX2 ({published['day0']} -> {published['day17']})")
        what = {"shifted": f"the {summary['shift']} camera",
                "device": "the device's mix" + (f", {summary['shift']} camera" if summary["shift"] else ""),
                "clean": "clean images" if domain == "clean" and "device" not in domains
                else "clean, evenly mixed"}.get(domain, domain)
        ax.set_ylabel(f"test accuracy (%)\n{what}")
        ax.grid(alpha=0.3)
    camera = f", camera shift {summary['shift']}" if summary["shift"] else ""
    world = f"\n{summary['scenario']}" if summary.get("scenario", "even") != "even" else ""
    axes[0].set_title(f"{summary['model']}, {summary['per_day']} new images a day{camera}{world}, "
                      f"{summary['test_images']['daily']:,} test images{runs}")
    axes[0].legend(fontsize=7)
    for n, arm in enumerate(arms):
        energy = mean_over_runs(summary, arm, "energy_j_total")
        if any(energy):
            axes[-1].plot(days, [e / 1000 if e is not None else np.nan for e in energy], "-", color=f"C{n}")
    sources = {v.get("energy_source") for run in summary["runs"] for row in run["rows"]
               for v in row["arms"].values()} - {None}
    axes[-1].set_ylabel("energy, cumulative (kJ)\n" + ", ".join(sorted(sources)))
    axes[-1].set_xlabel("day")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    return save_figure(plt, fig, out)
