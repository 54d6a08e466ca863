"""The fraction of memory bandwidth each kind of non-GEMM op reaches on this device.

The timeline (``megatron_metp/measure/timeline.py``) charges every op that is not a GEMM or
attention at one fraction of HBM bandwidth. The H200 profile (``docs/calibration/README.md``)
found that fraction too high for both families, and more so for METP's ops: transposing
copies into the ring's head-major layout, fp32 accumulators fed bf16 gradients, and the online
softmax merges. One fraction cannot carry both, so this measures each kind on its own, at the
sizes of LLaMA-7B's rank share at 128k tokens and p = 8 (16,384 tokens per rank, 32 heads of
128; 4,096 hidden; 11,008 / 8 FFN columns per rank for stock).

Each op is timed alone (CUDA events on a GPU, ``time.perf_counter`` on a CPU), the best of
``--iters`` after 3 warm-ups. Bytes are what the op must read and write at least: every input
once and the output once; a broadcast factor counts its own size. The fraction is
``bytes / time / reference``, the reference being a plain device-to-device copy of the largest
tensor measured in the same process (``copy`` below, which is 1.0 by construction), so the
numbers compare kinds on one device and do not depend on a data-sheet bandwidth.

    python scripts/elementwise_bandwidth.py --json elementwise.json            # a GPU
    python scripts/elementwise_bandwidth.py --tokens 256 --iters 2             # a quick CPU run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, iters):
            best = float("inf")
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) * 1e-3)
            return best
    else:
        def run(fn, iters):
            best = float("inf")
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            return best
    return run


def cases(tokens: int, heads: int, head_dim: int, hidden: int, ffn: int, device):
    """(name, kind, bytes moved, function) for each op measured."""
    bf16, fp32 = torch.bfloat16, torch.float32
    b = 1

    def t(*shape, dtype=bf16):
        return torch.randn(*shape, device=device).to(dtype)

    seq_major = t(tokens, b, heads, head_dim)             # Megatron's [s, b, n, d]
    head_major = t(b, heads, tokens, head_dim)            # the ring's [b, n, s, d]
    out_hm = torch.empty_like(head_major)
    out_sm = torch.empty_like(seq_major)
    half = head_major[:, :, : tokens // 2]
    cat_out = torch.empty_like(head_major)
    acc32 = t(b, heads, tokens, head_dim, dtype=fp32)
    grad16 = t(b, heads, tokens, head_dim)
    grad32 = t(b, heads, tokens, head_dim, dtype=fp32)
    o32 = t(b, heads, tokens, head_dim, dtype=fp32)
    o32b = t(b, heads, tokens, head_dim, dtype=fp32)
    w1 = t(b, heads, tokens, 1, dtype=fp32)
    w2 = t(b, heads, tokens, 1, dtype=fp32)
    lse1 = t(b, heads, tokens, dtype=fp32)
    lse2 = t(b, heads, tokens, dtype=fp32)
    res_a, res_b = t(tokens, hidden), t(tokens, hidden)
    res_out = torch.empty_like(res_a)
    fc1 = t(tokens, 2 * ffn)
    swi_out = t(tokens, ffn)
    cast_out = torch.empty(b, heads, tokens, head_dim, device=device, dtype=bf16)
    e16, e32 = 2, 4
    n = tokens * heads * head_dim

    return [
        ("copy", "copy, contiguous bf16", 2 * n * e16,
         lambda: out_hm.copy_(head_major)),
        ("transpose_to_head_major", "copy, transposing bf16 [s,b,n,d] -> [b,n,s,d]", 2 * n * e16,
         lambda: out_hm.copy_(seq_major.permute(1, 2, 0, 3))),
        ("transpose_to_seq_major", "copy, transposing bf16 [b,n,s,d] -> [s,b,n,d]", 2 * n * e16,
         lambda: out_sm.copy_(head_major.permute(2, 0, 1, 3))),
        ("cat_halves", "cat bf16, two halves along the sequence", 2 * n * e16,
         lambda: torch.cat([half, half], dim=2, out=cat_out)),
        ("acc_fp32_plus_bf16", "add_ fp32 += bf16 (the ring's dK/dV accumulator)",
         n * (2 * e32 + e16), lambda: acc32.add_(grad16)),
        ("acc_fp32_plus_fp32", "add_ fp32 += fp32", 3 * n * e32, lambda: acc32.add_(grad32)),
        ("merge_mul", "mul_ fp32 by a per-row factor (online-softmax rescale)",
         2 * n * e32 + tokens * heads * e32, lambda: o32.mul_(w1)),
        ("merge_addcmul", "addcmul_ fp32 with a per-row factor (online-softmax merge)",
         3 * n * e32 + tokens * heads * e32, lambda: o32.addcmul_(o32b, w2)),
        ("lse_merge", "logaddexp fp32 of two [b,n,s] statistics", 3 * tokens * heads * e32,
         lambda: torch.logaddexp(lse1, lse2)),
        ("cast_fp32_to_bf16", "copy fp32 -> bf16", n * (e32 + e16),
         lambda: cast_out.copy_(acc32)),
        ("residual_add", "add bf16 [s, h] (residual)", 3 * tokens * hidden * e16,
         lambda: torch.add(res_a, res_b, out=res_out)),
        ("swiglu", "silu(a) * b bf16 [s, 2f] -> [s, f] (unfused)", 4 * tokens * ffn * e16,
         lambda: torch.mul(torch.nn.functional.silu(fc1[:, :ffn]), fc1[:, ffn:], out=swi_out)),
    ]


def measure(tokens=16384, heads=32, head_dim=128, hidden=4096, ffn=11008 // 8, iters=10,
            device=None):
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = _timer(device)
    rows = []
    for name, kind, nbytes, fn in cases(tokens, heads, head_dim, hidden, ffn, device):
        run(fn, 3)
        sec = run(fn, iters)
        rows.append({"op": name, "kind": kind, "bytes": nbytes, "time_s": sec,
                     "bytes_per_s": nbytes / sec})
    ref = rows[0]["bytes_per_s"]
    for r in rows:
        r["fraction_of_copy"] = r["bytes_per_s"] / ref
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "tokens": tokens, "heads": heads,
            "head_dim": head_dim, "hidden": hidden, "ffn_per_rank": ffn, "iters": iters,
            "copy_bytes_per_s": ref, "ops": rows,
            "label": "measured: each op alone, best of iters after 3 warm-ups"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank (16384)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.tokens % 2 or args.iters < 1:
        print("elementwise_bandwidth.py: --tokens must be even and >= 2, --iters >= 1 "
              "(e.g. --tokens 16384 --iters 10)", file=sys.stderr)
        return 2
    res = measure(tokens=args.tokens, iters=args.iters)
    print(f"{res['device']}: a plain copy moved {res['copy_bytes_per_s'] / 1e12:.2f} TB/s "
          "(read + write)")
    for r in res["ops"]:
        print(f"  {r['fraction_of_copy']:5.2f} of copy  {r['time_s'] * 1e3:8.3f} ms  {r['kind']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
