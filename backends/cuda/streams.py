"""The wavefront's CUDA streams and events (cuda:streams, cuda:graph): one stream per layer.

Off the GPU (the interpreter) or without a wavefront every call is a no-op: the same work is issued
in the same order on the one queue there is.
"""

from __future__ import annotations

import contextlib


class Streams:
    """One stream per layer, created on first use, and a reusable event per (pass, layer, stage)."""

    def __init__(self, torch, device, n_layers: int, active: bool):
        self.torch, self.device, self.n_layers, self.active = torch, device, n_layers, active
        self._streams = None
        self._events: dict[tuple, object] = {}

    def stream(self, layer: int):
        """Layer ``layer``'s stream context (a no-op off the GPU: the same order, one queue)."""
        if not self.active:
            return contextlib.nullcontext()
        if self._streams is None:
            self._streams = [self.torch.cuda.Stream(self.device) for _ in range(self.n_layers)]
        return self.torch.cuda.stream(self._streams[layer])

    def _event(self, key):
        """A reusable CUDA event per key, or None off the GPU."""
        if not self.active:
            return None
        if key not in self._events:
            self._events[key] = self.torch.cuda.Event()
        return self._events[key]

    def wait(self, key) -> None:
        """The current stream waits for the work recorded under ``key``."""
        ev = self._event(key)
        if ev is not None:
            self.torch.cuda.current_stream(self.device).wait_event(ev)

    def record(self, key) -> None:
        """Record the current stream's work so far under ``key``."""
        ev = self._event(key)
        if ev is not None:
            ev.record()

    def fork(self) -> None:
        """Every layer's stream waits for the main stream's work so far."""
        if self.active:
            self.stream(0)  # create the streams
            main = self.torch.cuda.current_stream(self.device)
            for s in self._streams:
                s.wait_stream(main)

    def join(self) -> None:
        """The main stream waits for every layer's stream."""
        if self.active:
            main = self.torch.cuda.current_stream(self.device)
            for s in self._streams:
                main.wait_stream(s)
