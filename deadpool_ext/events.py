"""Structured event log: one JSON object per line, appended by every rank.

Each event is written with a single ``write`` on a file opened with
``O_APPEND``, so lines from different ranks never interleave.
"""

import json
import os
import threading
import time
from typing import Optional


class EventLog:
    def __init__(self, path: Optional[str], rank: int):
        self.rank = rank
        self._fd = None
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields) -> None:
        if self._fd is None:
            return
        record = {"time": round(time.time(), 6), "rank": self.rank, "event": event, **fields}
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
