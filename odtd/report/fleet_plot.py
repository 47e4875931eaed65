"""``odtctl fleet plot`` and ``fleet simulate``'s plot: a fleet's rounds, and its arms per device.

``plot_rounds``: one run's rounds from the server's record (``odtctl fleet status --json``'s
report): the devices that trained, declined or stayed silent; the trained devices' accuracy on
their own held-out samples before and after; each round's time split into the longest session,
the devices' own set-up around it and Flower's part (messaging, aggregation); the joules.
``plot_arms_per_device``: ``fleet simulate``'s result, every arm's accuracy on each device's
own test images and on clean ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from odtd.errors import OdtdError
from odtd.report.plot import pyplot, save_figure

_OUTCOMES = (("trained", "trained", "#2a9d8f"), ("declined", "declined", "#e9c46a"),
             ("no_reply", "no reply", "#e76f51"))


def _value(value: Any) -> float:
    """A figure for matplotlib: NaN where there is none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return float("nan")
    return float(value)


def round_mean(r: Dict[str, Any], key: str) -> Any:
    """A round's aggregate of ``key`` (Flower's, weighted by examples), as status and plot show it.

    Where one device's NaN (a figure it did not measure) made Flower's NaN: the same mean over
    the devices that measured it.
    """
    value = r["metrics"].get(key)
    if value is None or not (isinstance(value, float) and math.isnan(value)):
        return value
    pairs = [(d["metrics"].get("num-examples") or 0, d["metrics"].get(key)) for d in r["devices"]
             if d["outcome"] == "trained"]
    pairs = [(n, v) for n, v in pairs if v is not None and not math.isnan(v) and n > 0]
    return sum(n * v for n, v in pairs) / sum(n for n, _ in pairs) if pairs else None


def plot_rounds(report: Dict[str, Any], out: Path) -> Path:
    """Draw a report's rounds (``odtctl fleet status --json``'s: ``rounds``, ``label``) into a PNG.

    Raises:
        OdtdError: matplotlib is missing, or the run has no round yet.
    """
    rounds: List[Dict[str, Any]] = report["rounds"]
    if not rounds:
        raise OdtdError(f"{report['label']}: no round recorded yet")
    plt = pyplot()
    x = [r["round"] for r in rounds]
    fig, (ax_devices, ax_acc, ax_time, ax_energy) = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    fig.suptitle(f"fleet: {report['label']}")
    bottom = [0] * len(rounds)
    for key, label, colour in _OUTCOMES:
        counts = [r[key] for r in rounds]
        ax_devices.bar(x, counts, bottom=bottom, color=colour, label=label)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax_devices.set_ylabel("devices asked")
    ax_devices.legend(loc="best", fontsize=8)

    for key, label, style in (("accuracy-before", "before: the model the device served", "o--"),
                              ("accuracy-after", "after the device's session", "s-")):
        ax_acc.plot(x, [100 * _value(round_mean(r, key)) for r in rounds], style, label=label)
    ax_acc.set_ylabel("accuracy on the devices'\nheld-out samples (%)")
    ax_acc.legend(loc="best", fontsize=8)
    ax_acc.grid(alpha=0.3)

    # A record from before devices reported device-seconds: their set-up counts as Flower's.
    session = [0.0 if math.isnan(_value(r.get("session_s_max"))) else _value(r["session_s_max"])
               for r in rounds]
    device = [s if math.isnan(_value(r.get("device_s_max"))) else _value(r["device_s_max"])
              for r, s in zip(rounds, session)]
    setup = [d - s for d, s in zip(device, session)]
    flower = [r["seconds"] - d for r, d in zip(rounds, device)]
    parts = ((session, "the longest session", "#264653"),
             (setup, "the device's set-up around it", "#8d99ae"),
             (flower, "Flower: messaging, aggregation", "#f4a261"))
    bottom = [0.0] * len(rounds)
    for values, label, colour in parts:
        ax_time.bar(x, values, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.set_ylabel("round time (s)")
    ax_time.legend(loc="best", fontsize=8)

    ax_energy.bar(x, [_value(r.get("joules")) for r in rounds], color="#6d597a")
    ax_energy.set_ylabel("energy of the round's\nsessions, summed (J)")
    ax_energy.set_xlabel("round")
    ax_energy.set_xticks(x)
    return save_figure(plt, fig, out)


def plot_arms_per_device(result: Dict[str, Any], out: Path,
                         arms: Optional[List[str]] = None) -> Path:
    """Draw ``fleet simulate``'s arms on each device's own test images and clean ones.

    Raises:
        OdtdError: matplotlib is missing.
    """
    plt = pyplot()
    rows = result["devices"]
    arms = arms or list(rows[0]["accuracy"])
    domains = [result["domain"]] + (["clean"] if result["domain"] != "clean" else [])
    fig, axes = plt.subplots(len(domains), 1, figsize=(10, 3.6 * len(domains)), squeeze=False)
    width = 0.8 / len(arms)
    for ax, domain in zip(axes[:, 0], domains):
        for n, arm in enumerate(arms):
            ax.bar([i + n * width for i in range(len(rows))],
                   [100 * row["accuracy"][arm][domain] for row in rows], width, label=arm,
                   color=f"C{n}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([f"device {row['device']}" for row in rows], fontsize=8)
        what = "its own test images" if domain != "clean" else "clean images of its mix"
        ax.set_ylabel(f"accuracy (%)\n{what}")
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].set_title("every arm's model on each device at the end (base: day 0)")
    axes[0, 0].legend(fontsize=8, ncol=len(arms))
    return save_figure(plt, fig, out)
