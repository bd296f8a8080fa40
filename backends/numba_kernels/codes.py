"""The integer codes the kernels branch on: module-level ints are compile-time constants for Numba, so
every model shares one compiled step per dtype and still folds its branches."""

_ELMAN, _LSTM, _GRU = 0, 1, 2
_TANH, _RELU, _SIGMOID = 0, 1, 2
_SOFTMAX, _MSE, _MSE_TANH = 0, 1, 2
_OUTPUTS, _GRADS, _STEP = 0, 1, 2
# slots of the int64 ``cfg`` vector
_KIND, _ACT, _HEAD, _TOKENS, _LAYERS, _BIAS, _PEEP, _CLIP, _LO, _LANES, _RESET, _DIRS, _RAFTER = range(13)
_N_CFG = 13
