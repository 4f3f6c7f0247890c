"""--exit-signal-handler: remember SIGTERM, act on it at an iteration boundary."""

import signal


class ExitSignalHandler:
    """Records that SIGTERM arrived; the training loop agrees on it across
    ranks (any rank signalled means all stop) and saves before exiting."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = None

    def install(self) -> "ExitSignalHandler":
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(self.sig, self._previous)
            self._previous = None
