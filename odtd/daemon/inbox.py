"""The inbox watcher: files dropped under ``inbox/<label>/`` become samples.

Files under ``inbox/_unlabelled/`` (``home.paths.UNLABELLED_FOLDER``, any depth) carry that
folder's name as their label, as every folder's files do: ingest stores them as unlabelled
samples. ``init`` refuses the name as a class, so it is never taken for one.

A file is ingested only once its size and modification time have not changed between two
scans, so a file still being copied in is left for the next scan. Ingested files leave the
inbox: accepted ones are stored under ``samples/``, rejected ones move to ``quarantine/``. The
scan is the standard library alone; the daemon ingests what it finds in a child process
(``tasks ingest``: the same ``Ingestor`` as ``odtctl ingest``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

Files = List[Tuple[Path, Optional[str]]]  # (file, label)


class InboxWatcher:
    """Scans an inbox directory on demand (the daemon calls ``stable_files`` every interval).

    Args:
        inbox: ``ODTD_HOME/inbox``.
    """

    def __init__(self, inbox: Path) -> None:
        self.inbox = inbox
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

    def stable_files(self) -> Files:
        """(file, label) of every file unchanged since the previous scan, to ingest now."""
        current = self._candidates()
        stable = [p for p, sig in current.items() if self._seen.get(p) == sig]
        self._seen = {p: sig for p, sig in current.items() if p not in stable}
        files: Files = []
        for path in sorted(stable):
            relative = path.relative_to(self.inbox)
            # inbox/<label>/<file> at any depth (inbox/_unlabelled/: stored unlabelled); a file
            # directly in inbox/ has no label and is quarantined.
            files.append((path, relative.parts[0] if len(relative.parts) > 1 else None))
        return files
