"""Should METP's travelling dK/dV accumulators be bf16 instead of fp32?

One process, CPU, no ranks: the gradient of one K/V block is the sum of the p per-rank partial
gradients (each rank's queries against that block). METP's ring adds them one hop at a time in
ring order. Compared here against the fp64 sum, for a bf16 model (inputs and kernels in bf16,
each partial an fp32 kernel result rounded to bf16 as a bf16 flash kernel returns it):

* fp32 travel: the accumulator stays fp32; rounded to bf16 once at its owner (what METP does);
* bf16 travel: each rank adds its partial in fp32 to the received bf16 accumulator and rounds
  to bf16 before sending (half the bytes on the wire);
* tp: one bf16 kernel over all queries (fp32 inside, one rounding): the baseline's error.

Causal partials as the balanced layout gives them (p - 1 half blocks + the owner's diagonal).
Prints relative errors (max |err| / max |ref|) and writes JSON with --json.
"""
import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for trial in range(a.trials):
        g = torch.Generator().manual_seed(trial)
        # fp64 "truth" of p partials: dK_r = dS_r^T Q_r with O(1) entries, the shape of an
        # attention key gradient (its values matter less than their summation).
        parts64 = [torch.randn(a.tokens, a.d, generator=g, dtype=torch.float64)
                   * torch.rand(1, generator=g, dtype=torch.float64) for _ in range(a.p)]
        ref = sum(parts64)
        scale = ref.abs().max().item()
        # Each partial as a bf16 kernel hands it over (fp32 compute, bf16 output).
        parts = [t.float().bfloat16() for t in parts64]
        acc32 = torch.zeros(a.tokens, a.d)
        for t in parts:
            acc32 += t.float()
        fp32_travel = acc32.bfloat16()
        acc16 = parts[0]
        for t in parts[1:]:
            acc16 = (acc16.float() + t.float()).bfloat16()
        tp = ref.float().bfloat16()   # one kernel, one rounding of the exact sum
        err = {name: ((x.double() - ref).abs().max().item() / scale)
               for name, x in (("fp32_travel", fp32_travel), ("bf16_travel", acc16),
                               ("tp_one_kernel", tp))}
        rows.append(err)
    worst = {k: max(r[k] for r in rows) for k in rows[0]}
    print(f"p = {a.p}, {a.tokens} tokens x d = {a.d}, {a.trials} trials, max |err| / max |ref|:")
    for k, v in worst.items():
        print(f"  {k:14s} {v:.2e}  ({v / worst['tp_one_kernel']:.1f}x tp)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "worst": worst, "trials": rows}, f, indent=1)


if __name__ == "__main__":
    main()
