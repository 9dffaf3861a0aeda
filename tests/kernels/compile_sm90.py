"""Compile every Triton kernel for sm_90a (H100/H200) on a machine WITHOUT a GPU.

Run as a script with ``TRITON_INTERPRET`` unset: ``python tests/kernels/compile_sm90.py [bf16]
[fp32]`` (default bf16; fp32, the CPU-test dtype, takes ~2 min and spills on the GPU). It
lowers each kernel with the launchers' tile constants through Triton's compiler and the ptxas it
bundles, and prints registers / stack bytes per kernel, so compile errors (e.g. a non-constexpr
global read in a kernel) and register spills show up in CPU CI before a GPU run.
Exit status 1 on any failure.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tangram_sglang.kernels import decode_attention, extend_attention, kv_write

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def signature(fn, pointer_types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton signature: constexprs, typed pointers (``*i32`` by default), i32/fp32 scalars."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types.get(name, "*i32")
        else:
            sig[name] = "fp32" if name.startswith("sm_scale") else "i32"
    return sig


def compile_kernel(
    label: str,
    fn,
    pointer_types: dict[str, str],
    constexprs: dict,
    num_warps: int,
    num_stages: int = 2,
) -> str:
    src = ASTSource(
        fn=fn,
        signature=signature(fn, pointer_types, constexprs),
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    kernel = triton.compile(
        src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    info = subprocess.run(
        [PTXAS, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(f.name)
    regs = [
        line.split("info    :")[1].strip()
        for line in info.stderr.splitlines()
        if "registers" in line
    ]
    return f"{label}: {regs[0] if regs else info.stderr.strip()}"


def main(dtypes: list[str]) -> int:
    lines = []
    for dtype in dtypes:
        t = f"*{dtype}"
        precision = "ieee" if dtype == "fp32" else "tf32"
        for head_dim in (64, 128):
            common = {"HEAD_DIM": head_dim, "DOT_PRECISION": precision, "UPCAST_DOT": False}
            for plan in decode_attention.PLANS:
                plan_consts = {
                    "NUM_KV_HEADS": 8,
                    "FIT_LENGTHS": plan != "table",
                    "BATCH_FLOOR": plan == "batch",
                    "BLOCK_N": decode_attention.BLOCK_N,
                }
                lines.append(
                    compile_kernel(
                        f"decode stage1 {plan} {dtype} D{head_dim}",
                        decode_attention._decode_stage1,
                        {
                            "q_ptr": t,
                            "k_pool_ptr": t,
                            "v_pool_ptr": t,
                            "mid_o_ptr": "*fp32",
                            "mid_lse_ptr": "*fp32",
                        },
                        {
                            **common,
                            **plan_consts,
                            "GQA_SIZE": 4,
                            "GQA_PAD": decode_attention.MIN_GQA_PAD,
                            "PAGE_SIZE": 16,
                        },
                        decode_attention.NUM_WARPS,
                        decode_attention.NUM_STAGES,
                    )
                )
                lines.append(
                    compile_kernel(
                        f"decode stage2 {plan} {dtype} D{head_dim}",
                        decode_attention._decode_stage2,
                        {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": t},
                        {**plan_consts, "GQA_SIZE": 4, "HEAD_DIM": head_dim},
                        decode_attention.NUM_WARPS,
                    )
                )
            block_m, block_n, warps = extend_attention.TILES_BY_HEAD_DIM[head_dim]
            lines.append(
                compile_kernel(
                    f"extend {dtype} D{head_dim}",
                    extend_attention._extend_kernel,
                    {
                        "q_ptr": t,
                        "k_new_ptr": t,
                        "v_new_ptr": t,
                        "k_pool_ptr": t,
                        "v_pool_ptr": t,
                        "out_ptr": t,
                        "lse_ptr": "*fp32",
                    },
                    {
                        **common,
                        "GQA_SIZE": 4,
                        "PAGE_SIZE": 16,
                        "BLOCK_M": block_m,
                        "BLOCK_N": block_n,
                    },
                    warps,
                    extend_attention.NUM_STAGES,
                )
            )
            lines.append(
                compile_kernel(
                    f"kv_write {dtype} D{head_dim}",
                    kv_write._kv_write_kernel,
                    {
                        "k_new_ptr": t,
                        "v_new_ptr": t,
                        "k_pool_ptr": t,
                        "v_pool_ptr": t,
                        "kept_idx_ptr": "*i64",
                    },
                    {"HEAD_DIM": head_dim, "PAGE_SIZE": 16, "BLOCK_K": kv_write.BLOCK_K},
                    kv_write.NUM_WARPS,
                )
            )
            print(*lines[-2 - 2 * len(decode_attention.PLANS) :], sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this script compiles, it does not interpret")
    sys.exit(main(sys.argv[1:] or ["bf16"]))
