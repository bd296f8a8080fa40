"""cuda:graph: the cuda backend's engine with its forward pass and training step replayed from CUDA graphs."""

from __future__ import annotations

import numpy as np

from backends.cuda.net import Net


class GraphedNet(Net):
    """The forward pass and the training step each replayed from one CUDA graph over static buffers.

    The graph is captured once per input shape, after one eager warm-up (which compiles every
    Triton specialisation; for training it runs with a learning rate of 0 and so leaves the
    parameters as they were). Off the GPU the same static-buffer function runs eagerly each call."""

    def __init__(self, problem, params, device, variant):
        super().__init__(problem, params, device, variant)
        self._graphs: dict[tuple, tuple] = {}

    def _static(self, key, fn, *inputs):
        """``(run, outputs)``: ``run(*new_inputs)`` copies into the static inputs and replays the graph."""
        torch = self.torch
        if key not in self._graphs:
            static_in = [t.clone() for t in inputs]
            if not self.on_gpu:
                self._graphs[key] = (static_in, None, fn)
            else:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    fn(*static_in)  # compiles every kernel specialisation before capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = fn(*static_in)
                self._graphs[key] = (static_in, (graph, static_out), fn)
        static_in, captured, fn = self._graphs[key]
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        if captured is None:
            return fn(*static_in)
        graph, static_out = captured
        graph.replay()
        return static_out

    def _train_fn(self, xt, yt):
        loss, grads = self._grads_dev(xt, yt)
        self._sgd(grads)
        return loss

    def outputs(self, x) -> np.ndarray:
        """The forward pass's outputs, replayed from its graph."""
        with self.torch.inference_mode():
            xt = self._x(x)
            out = self._static(("fwd", tuple(xt.shape)), self._outputs_dev, xt)
            return out.cpu().numpy()

    def sgd_step(self, x, y, lr: float):
        """One SGD step replayed from the training graph (captured at lr 0 on first use)."""
        with self.torch.no_grad():
            xt, yt = self._x(x), self._y(y)
            key = ("train", tuple(xt.shape), tuple(yt.shape))
            if key not in self._graphs and self.on_gpu:
                self.lr.fill_(0.0)  # the eager warm-up before capture must not move the parameters
                self._static(key, self._train_fn, xt, yt)
            self.lr.fill_(lr)
            return self._static(key, self._train_fn, xt, yt).clone()

    def warm_up_training(self, x, y) -> None:
        """Capture the training graph (at lr 0: no update) so that compile time is not step time."""
        if not self.on_gpu:
            return super().warm_up_training(x, y)
        with self.torch.no_grad():
            xt, yt = self._x(x), self._y(y)
            key = ("train", tuple(xt.shape), tuple(yt.shape))
            if key not in self._graphs:
                self.lr.fill_(0.0)
                self._static(key, self._train_fn, xt, yt)
