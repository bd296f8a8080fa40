"""The persistent recurrent kernel: every time step of one layer in a single launch.

Each program owns ``BLOCK_H`` hidden units. It loads its columns of the recurrent weights once
(for the LSTM the four gates' ``(H, BLOCK_H)`` slices of ``W_hh``) and keeps them in registers
for all ``T`` steps: the weights are read from memory once per sequence instead of once per
step (Diamos et al., "Persistent RNNs", 2016). Per step a program reads the whole previous
``h`` (written by every program), computes its units for every batch row (``BLOCK_B`` rows at a
time) and writes its slice of the new ``h``; a grid-wide barrier (an atomic counter) separates
the steps. The barrier needs every program resident at once, so the grid is at most one
program per multiprocessor and the launch is cooperative; a barrier that waits longer than
``MAX_SPIN`` polls in all sets an error flag instead of hanging (``raise_on_barrier_timeout``).

Under Triton's interpreter programs run one after another, so the wrapper launches a single
program owning every unit: the same code, the barrier trivially passed.

The GRU has a kernel of its own (``run_gru_layer``): its reset-before form needs every unit's
``r * h_prev`` before any unit's ``n``, a second grid barrier inside each step.

Mixed precision (``LOW``): the recurrent product's operands, the weights once and ``h`` (the reset-before
GRU's ``r * h_prev``) each step, are rounded to bfloat16 or float16 and back to float32 as they enter
``_matvec``, whose float32 products of two 8- or 11-bit numbers are then exact and its sums float32: the
spec's product, with the state and the gates float32.

Layouts: ``pre (T, B, G)`` the hoisted input projection with the bias (``G = 4H`` LSTM, ``H``
Elman), ``w_t (G, H)`` the pre-transposed ``W_hh``, ``hs``/``cs (T+1, B, H)`` with the starting
state at index 0, ``gates (T, B, 4H)`` written when ``STORE`` (training).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.cuda import interpreting, next_pow2
from backends.cuda.activations import ACT_CODES, act, sigmoid, tanh

#: polls of the barrier counter allowed over the whole launch (a healthy run needs a few per step)
MAX_SPIN = 1 << 24


@triton.jit
def _matvec(hprev, w):
    """(BLOCK_B, H_PAD) x (H_PAD, BLOCK_H) -> (BLOCK_B, BLOCK_H) as broadcast-multiply-reduce
    (batch rows below tl.dot's 16 are the case this kernel is for)."""
    return tl.sum(hprev[:, :, None] * w[None, :, :], axis=1)


#: the ``LOW`` constexpr: no rounding, or the products' operands rounded to bfloat16 / float16 (mixed precision)
LOW_CODES = {None: 0, "bfloat16": 1, "float16": 2}


@triton.jit
def _rounded(x, LOW: tl.constexpr):
    """``x`` as a product's operand: rounded to the low type (nearest, ties to even) and back to float32 under
    mixed precision, so that ``_matvec``'s float32 products are exact and its sums float32 (the spec's product).

    bfloat16 is rounded on the bits (add ``0x7FFF`` plus the kept part's last bit, clear the low 16): Triton's
    interpreter casts float32 to bfloat16 by truncation, so a cast would check other roundings than the GPU's."""
    if LOW == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif LOW == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _grid_barrier(bar_ptr, err_ptr, target, spins, MAX_SPIN: tl.constexpr):
    """Wait until ``target`` arrivals; ``spins`` counts polls over the whole launch, so programs that
    are not co-resident cost one budget in all, not one per step. Returns the updated count."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    cnt = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while (cnt < target) & (spins < MAX_SPIN):
        cnt = tl.atomic_add(bar_ptr, 0, sem="acq_rel", scope="gpu")
        spins += 1
    if cnt < target:
        tl.store(err_ptr, 1)
    tl.debug_barrier()
    return spins


@triton.jit
def _persistent_kernel(pre_ptr, w_ptr, hs_ptr, cs_ptr, gates_ptr, pi_ptr, pf_ptr, po_ptr, bar_ptr, err_ptr,
                       T, B, H, LSTM: tl.constexpr, ACT: tl.constexpr, PEEP: tl.constexpr, STORE: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, H_PAD: tl.constexpr, MAX_SPIN: tl.constexpr,
                       LOW: tl.constexpr = 0):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = pid * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's hidden units
    jm = j < H
    k = tl.arange(0, H_PAD)  # the reduction over the previous h
    km = k < H
    wmask = km[:, None] & jm[None, :]
    G = 4 * H if LSTM else H
    # W_hh[k, q*H + j] = w_t[q*H + j, k]: loaded once, resident for all T steps
    w0 = _rounded(tl.load(w_ptr + (0 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
    if LSTM:
        w1 = _rounded(tl.load(w_ptr + (1 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
        w2 = _rounded(tl.load(w_ptr + (2 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
        w3 = _rounded(tl.load(w_ptr + (3 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
        if PEEP:
            pi = tl.load(pi_ptr + j, mask=jm, other=0.0)[None, :]
            pf = tl.load(pf_ptr + j, mask=jm, other=0.0)[None, :]
            po = tl.load(po_ptr + j, mask=jm, other=0.0)[None, :]
    spins = 0
    for t in range(T):
        for b0 in range(0, B, BLOCK_B):
            rb = b0 + tl.arange(0, BLOCK_B)
            bm = rb < B
            hprev = tl.load(hs_ptr + t * B * H + rb[:, None] * H + k[None, :], mask=bm[:, None] & km[None, :],
                            other=0.0, volatile=True)
            hprev = _rounded(hprev, LOW)  # only the product reads it
            om = bm[:, None] & jm[None, :]
            out = (t + 1) * B * H + rb[:, None] * H + j[None, :]
            pre = pre_ptr + t * B * G + rb[:, None] * G + j[None, :]
            if LSTM:
                c_prev = tl.load(cs_ptr + t * B * H + rb[:, None] * H + j[None, :], mask=om, other=0.0)
                ai = tl.load(pre, mask=om, other=0.0) + _matvec(hprev, w0)
                af = tl.load(pre + H, mask=om, other=0.0) + _matvec(hprev, w1)
                ag = tl.load(pre + 2 * H, mask=om, other=0.0) + _matvec(hprev, w2)
                ao = tl.load(pre + 3 * H, mask=om, other=0.0) + _matvec(hprev, w3)
                if PEEP:
                    ai += pi * c_prev
                    af += pf * c_prev
                i = sigmoid(ai)
                f = sigmoid(af)
                g = tanh(ag)
                c = f * c_prev + i * g
                if PEEP:
                    ao += po * c
                o = sigmoid(ao)
                h = o * tanh(c)
                tl.store(cs_ptr + out, c, mask=om)
                if STORE:
                    gout = gates_ptr + t * B * G + rb[:, None] * G + j[None, :]
                    tl.store(gout, i, mask=om)
                    tl.store(gout + H, f, mask=om)
                    tl.store(gout + 2 * H, g, mask=om)
                    tl.store(gout + 3 * H, o, mask=om)
            else:
                h = act(tl.load(pre, mask=om, other=0.0) + _matvec(hprev, w0), ACT)
            tl.store(hs_ptr + out, h, mask=om)
        if t + 1 < T:  # no step reads the last one's h: no barrier after it
            spins = _grid_barrier(bar_ptr, err_ptr, (t + 1) * nprog, spins, MAX_SPIN)


@triton.jit
def _persistent_gru_kernel(pre_ptr, w_ptr, bhn_ptr, hs_ptr, gates_ptr, bar_ptr, err_ptr, T, B, H,
                           RESET_AFTER: tl.constexpr, HAS_BHN: tl.constexpr, STORE: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, H_PAD: tl.constexpr, MAX_SPIN: tl.constexpr,
                           LOW: tl.constexpr = 0):
    """The GRU's recurrence (gates r, z, n; ``gates`` (T, B, 4H) as backends.cuda.gru lays it out).

    Reset after: one pass per step, as the LSTM. Reset before: ``n`` needs ``(r * h_prev) W_hn`` over
    every unit's ``r``, so a step is two passes with a grid barrier between them: r, z and
    ``rh = r * h_prev`` into ``gates``, then ``n`` and ``h`` from the whole ``rh``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = pid * BLOCK_H + tl.arange(0, BLOCK_H)
    jm = j < H
    k = tl.arange(0, H_PAD)
    km = k < H
    wmask = km[:, None] & jm[None, :]
    wr = _rounded(tl.load(w_ptr + (0 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
    wz = _rounded(tl.load(w_ptr + (1 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
    wn = _rounded(tl.load(w_ptr + (2 * H + j)[None, :] * H + k[:, None], mask=wmask, other=0.0), LOW)
    if HAS_BHN:
        bhn = tl.load(bhn_ptr + j, mask=jm, other=0.0)[None, :]
    spins = 0
    for t in range(T):
        for b0 in range(0, B, BLOCK_B):
            rb = b0 + tl.arange(0, BLOCK_B)
            bm = rb < B
            om = bm[:, None] & jm[None, :]
            hprev = tl.load(hs_ptr + t * B * H + rb[:, None] * H + k[None, :], mask=bm[:, None] & km[None, :],
                            other=0.0, volatile=True)
            hprev = _rounded(hprev, LOW)  # the products' operand; hp below is the float32 state
            hp = tl.load(hs_ptr + t * B * H + rb[:, None] * H + j[None, :], mask=om, other=0.0)
            pre = pre_ptr + t * B * 3 * H + rb[:, None] * 3 * H + j[None, :]
            gout = gates_ptr + t * B * 4 * H + rb[:, None] * 4 * H + j[None, :]
            r = sigmoid(tl.load(pre, mask=om, other=0.0) + _matvec(hprev, wr))
            z = sigmoid(tl.load(pre + H, mask=om, other=0.0) + _matvec(hprev, wz))
            if RESET_AFTER:
                un = _matvec(hprev, wn)
                if HAS_BHN:
                    un += bhn
                n = tanh(tl.load(pre + 2 * H, mask=om, other=0.0) + r * un)
                tl.store(hs_ptr + (t + 1) * B * H + rb[:, None] * H + j[None, :], (1.0 - z) * n + z * hp, mask=om)
                if STORE:
                    tl.store(gout, r, mask=om)
                    tl.store(gout + H, z, mask=om)
                    tl.store(gout + 2 * H, n, mask=om)
                    tl.store(gout + 3 * H, un, mask=om)
            else:
                tl.store(gout, r, mask=om)
                tl.store(gout + H, z, mask=om)
                tl.store(gout + 3 * H, r * hp, mask=om)
        if not RESET_AFTER:
            spins = _grid_barrier(bar_ptr, err_ptr, (2 * t + 1) * nprog, spins, MAX_SPIN)  # two per step
            for b0 in range(0, B, BLOCK_B):
                rb = b0 + tl.arange(0, BLOCK_B)
                bm = rb < B
                om = bm[:, None] & jm[None, :]
                gin = gates_ptr + t * B * 4 * H + rb[:, None] * 4 * H
                rh = tl.load(gin + 3 * H + k[None, :], mask=bm[:, None] & km[None, :], other=0.0, volatile=True)
                rh = _rounded(rh, LOW)
                z = tl.load(gin + H + j[None, :], mask=om, other=0.0)
                hp = tl.load(hs_ptr + t * B * H + rb[:, None] * H + j[None, :], mask=om, other=0.0)
                pre = pre_ptr + t * B * 3 * H + rb[:, None] * 3 * H + j[None, :]
                n = tanh(tl.load(pre + 2 * H, mask=om, other=0.0) + _matvec(rh, wn))
                tl.store(gin + 2 * H + j[None, :], n, mask=om)
                tl.store(hs_ptr + (t + 1) * B * H + rb[:, None] * H + j[None, :], (1.0 - z) * n + z * hp, mask=om)
        if t + 1 < T:
            if RESET_AFTER:
                spins = _grid_barrier(bar_ptr, err_ptr, (t + 1) * nprog, spins, MAX_SPIN)
            else:
                spins = _grid_barrier(bar_ptr, err_ptr, (2 * t + 2) * nprog, spins, MAX_SPIN)


def plan(H: int, B: int, device) -> dict:
    """Block sizes and grid: one program per multiprocessor at most (co-residency for the barrier)."""
    h_pad = next_pow2(H)
    if interpreting() or device.type != "cuda":
        return {"BLOCK_H": h_pad, "BLOCK_B": next_pow2(B), "H_PAD": h_pad, "programs": 1, "cooperative": False}
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_h = next_pow2(triton.cdiv(H, sms))
    return {"BLOCK_H": block_h, "BLOCK_B": min(next_pow2(B), 8), "H_PAD": h_pad,
            "programs": triton.cdiv(H, block_h), "cooperative": True}


def run_layer(pre, w_t, hs, cs, gates, peep, lstm: bool, activation: str = "tanh", num_warps: int = 8,
              block_b: int | None = None, block_h: int | None = None, low: str | None = None):
    """Every step of one layer: fills ``hs[1:]`` (and ``cs[1:]``, ``gates`` when given) from ``hs[0]``/``cs[0]``.

    Returns the ``[counter, error flag]`` pair for :func:`raise_on_barrier_timeout`; ``block_b``
    overrides the batch rows per pass, ``block_h`` the hidden units per program (powers of two); ``low``
    (bfloat16, float16) rounds the recurrent product's operands, ``h`` and ``W_hh``, to that type. Under
    the interpreter, several programs only for a single step (their barrier would wait forever)."""
    import torch

    T, B, H = hs.shape[0] - 1, hs.shape[1], hs.shape[2]
    for t in (pre, w_t, hs, cs, gates):
        assert t is None or t.is_contiguous()
    p = plan(H, B, hs.device)
    if block_b is not None:
        p["BLOCK_B"] = block_b
    if block_h is not None:
        p["BLOCK_H"], p["programs"] = block_h, triton.cdiv(H, block_h)
        if interpreting() and p["programs"] > 1 and T > 1:
            raise ValueError("under the interpreter programs run one after another: several need T == 1")
    bar = torch.zeros(2, dtype=torch.int32, device=hs.device)  # [counter, error flag]
    pi, pf, po = peep if peep is not None else (hs, hs, hs)
    extra = {"num_warps": num_warps, "launch_cooperative_grid": True} if p["cooperative"] else {}
    _persistent_kernel[(p["programs"],)](
        pre, w_t, hs, cs if cs is not None else hs, gates if gates is not None else pre, pi, pf, po, bar, bar[1:],
        T, B, H, LSTM=lstm, ACT=ACT_CODES[activation], PEEP=peep is not None, STORE=gates is not None,
        BLOCK_B=p["BLOCK_B"], BLOCK_H=p["BLOCK_H"], H_PAD=p["H_PAD"], MAX_SPIN=MAX_SPIN, LOW=LOW_CODES[low], **extra)
    return bar


def run_gru_layer(pre, w_t, b_hn, hs, gates, reset_after: bool, num_warps: int = 8, block_b: int | None = None,
                  block_h: int | None = None, low: str | None = None):
    """Every step of one GRU layer: fills ``hs[1:]`` from ``hs[0]``; ``pre (T, B, 3H)``, ``w_t (3H, H)``,
    ``b_hn`` None without bias. ``gates (T, B, 4H)`` is written for training; reset before needs it
    always (its ``z`` and ``rh`` cross the mid-step barrier through it), reset after takes None for
    inference; ``low`` as :func:`run_layer` (``r * h_prev`` is rounded as well). Returns the barrier pair, as
    :func:`run_layer`."""
    import torch

    T, B, H = hs.shape[0] - 1, hs.shape[1], hs.shape[2]
    if gates is None and not reset_after:
        raise ValueError("a reset-before GRU layer passes r * h_prev between its programs through gates")
    for t in (pre, w_t, b_hn, hs, gates):
        assert t is None or t.is_contiguous()
    p = plan(H, B, hs.device)
    if block_b is not None:
        p["BLOCK_B"] = block_b
    if block_h is not None:
        p["BLOCK_H"], p["programs"] = block_h, triton.cdiv(H, block_h)
        if interpreting() and p["programs"] > 1 and (T > 1 or not reset_after):
            raise ValueError("under the interpreter programs run one after another: several need T == 1 "
                             "and no barrier inside a step (reset after)")
    bar = torch.zeros(2, dtype=torch.int32, device=hs.device)
    extra = {"num_warps": num_warps, "launch_cooperative_grid": True} if p["cooperative"] else {}
    _persistent_gru_kernel[(p["programs"],)](
        pre, w_t, b_hn if b_hn is not None else hs, hs, gates if gates is not None else pre, bar, bar[1:], T, B, H,
        RESET_AFTER=reset_after, HAS_BHN=b_hn is not None, STORE=gates is not None,
        BLOCK_B=p["BLOCK_B"], BLOCK_H=p["BLOCK_H"], H_PAD=p["H_PAD"], MAX_SPIN=MAX_SPIN, LOW=LOW_CODES[low], **extra)
    return bar


def raise_on_barrier_timeout(bar) -> None:
    """After the launch (a host sync): a barrier that timed out means the programs were not co-resident."""
    from harness.spec.errors import HarnessError

    if int(bar[1]) != 0:
        raise HarnessError("cuda:persistent: the grid barrier timed out (programs not co-resident)")
