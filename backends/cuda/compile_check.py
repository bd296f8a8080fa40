"""Compile every kernel for a GPU target without a GPU (Triton's ahead-of-time path, ptxas included).

The interpreter checks the kernels' numerics on CPU tensors; this checks that the same source
lowers to a GPU binary: ``python -m backends.cuda.compile_check --arch 90 --dtype fp32``. It must
run in a process where ``TRITON_INTERPRET`` is unset (kernels decorated for compilation).
"""

from __future__ import annotations

import argparse
import sys

INTS = ("T", "B", "H", "n", "ncols", "sx", "so", "sa", "sb")


def _compile(kernel, dtype: str, constexprs: dict, target, types: dict | None = None, **options):
    import triton
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif types and n in types:
            signature[n] = types[n]
        else:
            signature[n] = "i32" if n in INTS else f"*{dtype}"
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=target, options=options)


def compile_all(arch: int = 90, dtype: str = "fp32") -> list[str]:
    """Compile each kernel family's main specialisations for ``sm_<arch>``; returns what compiled."""
    from triton.backends.compiler import GPUTarget

    from backends.cuda import elementwise as E
    from backends.cuda import elman as M
    from backends.cuda import gru as R
    from backends.cuda import interpreting
    from backends.cuda import lstm as L
    from backends.cuda import persistent as P

    if interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: the kernels were decorated for the interpreter")
    target = GPUTarget("cuda", arch, 32)
    done = []
    jobs = [
        (P._persistent_kernel, dict(LSTM=True, ACT=0, PEEP=True, STORE=True, BLOCK_B=8, BLOCK_H=4, H_PAD=512,
                                    MAX_SPIN=P.MAX_SPIN, LOW=0), {"bar_ptr": "*i32", "err_ptr": "*i32"},
         dict(num_warps=8, launch_cooperative_grid=True)),
        (P._persistent_kernel, dict(LSTM=False, ACT=1, PEEP=False, STORE=False, BLOCK_B=1, BLOCK_H=1, H_PAD=4,
                                    MAX_SPIN=P.MAX_SPIN, LOW=0), {"bar_ptr": "*i32", "err_ptr": "*i32"}, {}),
        (P._persistent_gru_kernel, dict(RESET_AFTER=True, HAS_BHN=True, STORE=True, BLOCK_B=8, BLOCK_H=4, H_PAD=512,
                                        MAX_SPIN=P.MAX_SPIN, LOW=0), {"bar_ptr": "*i32", "err_ptr": "*i32"},
         dict(num_warps=8, launch_cooperative_grid=True)),
        (P._persistent_gru_kernel, dict(RESET_AFTER=False, HAS_BHN=False, STORE=True, BLOCK_B=8, BLOCK_H=4,
                                        H_PAD=512, MAX_SPIN=P.MAX_SPIN, LOW=0), {"bar_ptr": "*i32", "err_ptr": "*i32"},
         dict(num_warps=8, launch_cooperative_grid=True)),
        # mixed precision: the recurrent product's operands rounded to bfloat16 (on the bits) or float16 (a cast)
        (P._persistent_kernel, dict(LSTM=True, ACT=0, PEEP=False, STORE=True, BLOCK_B=8, BLOCK_H=4, H_PAD=512,
                                    MAX_SPIN=P.MAX_SPIN, LOW=1), {"bar_ptr": "*i32", "err_ptr": "*i32"},
         dict(num_warps=8, launch_cooperative_grid=True)),
        (P._persistent_gru_kernel, dict(RESET_AFTER=False, HAS_BHN=False, STORE=True, BLOCK_B=8, BLOCK_H=4,
                                        H_PAD=512, MAX_SPIN=P.MAX_SPIN, LOW=2), {"bar_ptr": "*i32", "err_ptr": "*i32"},
         dict(num_warps=8, launch_cooperative_grid=True)),
        (R._gru_fwd_kernel, dict(HAS_REC=True, HAS_BHN=True, STORE=True, BLOCK=1024), None, {}),
        (R._gru_reset_kernel, dict(HAS_REC=True, BLOCK=1024), None, {}),
        (R._gru_new_kernel, dict(HAS_REC=True, BLOCK=1024), None, {}),
        (R._gru_bwd_kernel, dict(HAS_DHO=True, HAS_DHR=True, HAS_DC=True, BLOCK=1024), None, {}),
        (R._gru_bwd_new_kernel, dict(HAS_DHO=True, HAS_DHR=True, HAS_DC=True, BLOCK=1024), None, {}),
        (R._gru_bwd_reset_kernel, dict(BLOCK=1024), None, {}),
        (L._lstm_fwd_kernel, dict(HAS_REC=True, PEEP=True, STORE=True, BLOCK=1024), None, {}),
        (L._lstm_bwd_kernel, dict(HAS_DHO=True, HAS_DHR=True, HAS_DC=True, PEEP=True, BLOCK=1024), None, {}),
        (M._elman_fwd_kernel, dict(HAS_REC=True, ACT=0, BLOCK=1024), None, {}),
        (M._elman_bwd_kernel, dict(HAS_DHO=True, HAS_DHR=True, ACT=1, BLOCK=1024), None, {}),
        (E._unary_kernel, dict(OP=1, BLOCK=1024), None, {}),
        (E._binary_kernel, dict(OP=2, ROW=True, BLOCK=1024), None, {}),
        (E._sgd_kernel, dict(CLIP=True, BLOCK=1024), None, {}),
    ]
    for kernel, constexprs, types, options in jobs:
        _compile(kernel, dtype, constexprs, target, types, **options)
        done.append(kernel.fn.__name__)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.cuda.compile_check")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp64"])
    args = ap.parse_args(argv)
    for name in compile_all(args.arch, args.dtype):
        print(f"compiled {name} for sm_{args.arch} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
