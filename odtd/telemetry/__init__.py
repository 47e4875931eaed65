"""Telemetry: power rails, memory and temperature from whatever this machine offers.

``BACKENDS`` is the registry in auto-detection order; ``odtctl telemetry backends`` prints it
through :func:`describe_backends`. ``playback`` can be chosen by name but is never auto-detected.
Nothing here touches hardware at import time, and ``jtop`` is imported only by its backend.
"""

import inspect
import logging
from pathlib import Path
from typing import Any, Dict, List, Type

from odtd.errors import OdtdError, TelemetryUnavailable
from odtd.telemetry.base import INPUT_RAIL_NAMES, Backend, PowerSample
from odtd.telemetry.estimate import EstimateBackend
from odtd.telemetry.ina3221 import Ina3221Backend
from odtd.telemetry.integration import EnergyReport, StreamingIntegrator, integrate, step_energies
from odtd.telemetry.jtop_backend import JtopBackend
from odtd.telemetry.null import NullBackend
from odtd.telemetry.playback import PlaybackBackend
from odtd.telemetry.rapl import RaplBackend
from odtd.telemetry.recording import integrate_recording, record
from odtd.telemetry.sampler import Sampler, SamplerStats
from odtd.telemetry.tegrastats import TegrastatsBackend, parse_line

logger = logging.getLogger(__name__)

#: Auto-detection order: measured sources first, the model next to last, nothing last.
BACKENDS: Dict[str, Type[Backend]] = {
    "jtop": JtopBackend,
    "ina3221": Ina3221Backend,
    "tegrastats": TegrastatsBackend,
    "rapl": RaplBackend,
    "estimate": EstimateBackend,
    "none": NullBackend,
}

#: Every backend that can be named in ``telemetry.backend`` (``auto`` picks from BACKENDS).
SELECTABLE: Dict[str, Type[Backend]] = dict(BACKENDS, playback=PlaybackBackend)

#: Backend names of earlier releases, still opened (with a deprecation line): old -> new.
RENAMED_BACKENDS = {"replay": "playback"}

__all__ = [
    "BACKENDS", "INPUT_RAIL_NAMES", "SELECTABLE", "Backend", "EnergyReport", "PowerSample",
    "Sampler", "SamplerStats", "StreamingIntegrator", "describe_backends", "integrate",
    "integrate_recording", "open_backend", "parse_line", "record", "step_energies",
]


def describe_backends(root: Path = Path("/")) -> List[Dict[str, Any]]:
    """Describe every selectable backend for ``odtctl telemetry backends``.

    Returns:
        ``[{"name", "available", "reason", "source"}, ...]`` in detection order, playback last;
        ``reason`` is None when available.
    """
    rows = []
    for name, backend_class in SELECTABLE.items():
        reason = backend_class.probe(Path(root))
        rows.append({"name": name, "available": reason is None, "reason": reason,
                     "source": backend_class.source})
    return rows


def _accepted_options(backend_class: Type[Backend]) -> List[str]:
    parameters = inspect.signature(backend_class.__init__).parameters
    return [p for p in parameters if p not in ("self", "root")]


def _construct(backend_class: Type[Backend], root: Path, options: Dict[str, Any],
               strict: bool) -> Backend:
    accepted = _accepted_options(backend_class)
    unknown = sorted(set(options) - set(accepted))
    if unknown and strict:
        raise OdtdError(f"telemetry backend {backend_class.name} has no option "
                        f"{', '.join(unknown)}; its options are: {', '.join(accepted) or 'none'}")
    kept = {k: v for k, v in options.items() if k in accepted}
    try:
        return backend_class(root=root, **kept)
    except ValueError as error:
        raise OdtdError(f"telemetry backend {backend_class.name}: {error}") from error


def open_backend(name: str, root: Path = Path("/"), **options: Any) -> Backend:
    """Construct and open a backend by name; ``auto`` opens the first one that works here.

    Args:
        name: A key of ``SELECTABLE``, or ``auto``.
        root: Filesystem root for hardware paths.
        **options: Backend options (e.g. ``interval_ms`` for tegrastats, ``path`` for playback).
            With ``auto``, options the chosen backend does not take are ignored.

    Returns:
        The opened backend; the caller closes it.

    Raises:
        OdtdError: Unknown name or option.
        TelemetryUnavailable: The named backend cannot run here; the message says the fix.
    """
    root = Path(root)
    if name in RENAMED_BACKENDS:
        logger.warning("telemetry backend %s is deprecated: it is called %s now", name,
                       RENAMED_BACKENDS[name])
        name = RENAMED_BACKENDS[name]
    if name == "auto":
        for backend_class in BACKENDS.values():
            reason = backend_class.probe(root)
            if reason is not None:
                logger.debug("telemetry %s unavailable: %s", backend_class.name, reason)
                continue
            backend = _construct(backend_class, root, options, strict=False)
            try:
                backend.open()
            except TelemetryUnavailable as error:
                logger.debug("telemetry %s failed to open: %s", backend_class.name, error)
                continue
            logger.debug("telemetry backend: %s", backend_class.name)
            return backend
        raise TelemetryUnavailable("no telemetry backend could be opened")  # none always can
    if name not in SELECTABLE:
        raise OdtdError(f"telemetry backend {name!r} is unknown; choose auto, "
                        f"{', '.join(SELECTABLE)}")
    backend_class = SELECTABLE[name]
    backend = _construct(backend_class, root, options, strict=True)
    reason = backend_class.probe(root)
    if reason is not None:
        raise TelemetryUnavailable(f"telemetry backend {name} is unavailable: {reason}")
    backend.open()
    return backend
