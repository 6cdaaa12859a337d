"""The rollout worker's transport: one end of a pipe that carries wire-encoded bytes only (worker.py's docstring: why
bytes, why a feeder and a reader thread), and reading a received message without running anything it holds.
"""
import queue
import threading

import torch

from opd.io import wire
from opd.io.errors import require


def read(data: bytes, device: str | torch.device, what: str, kinds: tuple[str, ...]) -> dict:
    """A received message: a wire tree with a known kind; anything else is refused with one line, never run."""
    message = wire.decode(data, device, what)
    require(isinstance(message, dict) and message.get("kind") in kinds,
            f"{what} is not a message of kind {', '.join(kinds)}", "it was not sent by this version of opd")
    return message


class Channel:
    """One end of a pipe that carries bytes only (`send_bytes` / `recv_bytes`; `send` / `recv` would unpickle).
    A feeder thread writes what `send` queues, so sending never blocks the caller; a reader thread reads whole
    messages, so `receive` waits no longer than its timeout, even while the other end is stopped mid-message."""

    def __init__(self, conn):
        self.conn, self.outgoing, self.incoming = conn, queue.SimpleQueue(), queue.SimpleQueue()
        self.feeder = threading.Thread(target=self._feed, daemon=True)
        self.feeder.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _feed(self) -> None:
        try:
            while (data := self.outgoing.get()) is not None:
                self.conn.send_bytes(data)
        except OSError:  # the other end is gone
            pass

    def _read(self) -> None:
        try:
            while True:
                self.incoming.put(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.incoming.put(None)  # the other end is closed: that process is gone or exiting

    def send(self, data: bytes) -> None:
        self.outgoing.put(data)

    def receive(self, timeout: float | None = None) -> bytes | None:
        """The next message; None once the other end has closed. Raises queue.Empty after `timeout` seconds."""
        data = self.incoming.get(timeout=timeout)
        if data is None:
            self.incoming.put(None)  # closed stays closed for the next call
        return data

    def close(self, flush: float = 0.0) -> None:
        """Stop the feeder after what is queued, waiting up to `flush` seconds for it to be written. The pipe itself
        closes when both threads are done (the reader: once the other process is gone)."""
        self.outgoing.put(None)
        self.feeder.join(flush)
