"""``torch:compile``: the autograd network with each time step's cell compiled by torch.compile."""

from __future__ import annotations

from backends.torch_nets.autograd import Net


class CompiledNet(Net):
    """The autograd network with each time step's cell compiled by torch.compile (inductor).

    Compiling the cell, not the unrolled sequence, keeps the graph one step long: compile
    time does not grow with the steps and layers (a 4-layer, 100-step LSTM unrolled into one
    graph did not finish compiling in minutes on a GPU), while the step's element-wise gate
    maths still fuses into one kernel forward and one backward. The projections over all
    steps and the head stay single large products, as in the autograd variant.
    """

    def __init__(self, problem, params, device):
        super().__init__(problem, params, device)
        torch = self.torch
        # A fresh cache per problem, and a hard error instead of dynamo's silent eager
        # fallback once the recompile limit is hit (each distinct row count and grad mode
        # of a step is one graph: training, inference, truncated windows).
        torch._dynamo.reset()
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self._elman_cell = torch.compile(self._elman_cell, fullgraph=True, dynamic=False)
        self._lstm_cell = torch.compile(self._lstm_cell, fullgraph=True, dynamic=False)
        self._gru_cell = torch.compile(self._gru_cell, fullgraph=True, dynamic=False)
