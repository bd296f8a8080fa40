"""The PyTorch backend's networks (:mod:`backends.torch_backend` holds the class, the variants and the
mixed-precision rules), one module per variant: ``autograd`` the SPEC.md cell written step by step in torch
ops (``Net``: parameters, the objective under each bptt mode, gradients and the update), ``compiled`` the
same with each step's cell compiled by torch.compile, ``fused`` nn.RNN / nn.LSTM / nn.GRU over the whole
sequence; ``cells`` one time step of each cell kind, which the first two share. Torch is imported when a
network is built, never by ``import backends.torch_nets``.
"""
