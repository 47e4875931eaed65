"""The inbox watcher: files dropped under ``inbox/<label>/`` become samples.

A file is ingested only once its size and modification time have not changed between two
scans, so a file still being copied in is left for the next scan. Ingested files leave the
inbox: accepted ones are stored under ``samples/``, rejected ones move to ``quarantine/``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from odtd.home.ingest import Ingestor, IngestReport

logger = logging.getLogger(__name__)


class InboxWatcher:
    """Scans an inbox directory on demand (the daemon calls ``scan`` every interval).

    Args:
        inbox: ``ODTD_HOME/inbox``.
        ingestor: the same ingest code as ``odtctl ingest``, with ``move=True``.
    """

    def __init__(self, inbox: Path, ingestor: Ingestor) -> None:
        self.inbox = inbox
        self.ingestor = ingestor
        self._seen: dict[Path, tuple[int, int]] = {}

    def _candidates(self) -> dict[Path, tuple[int, int]]:
        found: dict[Path, tuple[int, int]] = {}
        if not self.inbox.is_dir():
            return found
        for path in self.inbox.rglob("*"):
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found[path] = (stat.st_size, stat.st_mtime_ns)
        return found

    def scan(self, day: Optional[str] = None) -> IngestReport:
        """Ingest every file that was stable since the previous scan; return what happened."""
        current = self._candidates()
        stable = [p for p, sig in current.items() if self._seen.get(p) == sig]
        self._seen = {p: sig for p, sig in current.items() if p not in stable}
        files = []
        for path in sorted(stable):
            relative = path.relative_to(self.inbox)
            # inbox/<label>/<file>; a file directly in inbox/ has no label and is quarantined.
            label = relative.parts[0] if len(relative.parts) > 1 else None
            files.append((path, label))
        report = self.ingestor.ingest(files, day=day, move=True) if files else IngestReport()
        if files:
            logger.info("inbox: accepted %d, duplicates %d, rejected %d",
                        report.accepted, report.duplicates, report.rejected)
        return report
