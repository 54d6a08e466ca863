"""Render a ``metp bench`` result: Markdown tables and a PNG of memory and time against s."""

from __future__ import annotations

from typing import Dict, List

MIB = 2**20


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def markdown(result: Dict) -> str:
    """The summary table, the per-op communication table and the Eq. 5 overlap check."""
    p = result["world_size"]
    st = result["settings"]
    lines: List[str] = [
        f"metp bench: scope {st['scope']}, style {st['style']}, p = {p} ranks "
        f"({result['backend']}, {result['device']}), h = {st['hidden_size']}, "
        f"heads = {st['num_attention_heads']}, b = {st['micro_batch_size']}, "
        f"{'bf16' if st['bf16'] else 'fp32'}; times: best of {st['iters']} steps, each on the "
        "slowest rank",
        "",
        "| mode | s | peak MiB (max rank) | step adds MiB | sent MiB/rank | calls | overlapped ms "
        "| serialised ms | compute ms | comm ms | comp | comm | async | ovl/max | tokens/s "
        "| TFLOP/s/rank | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pt in result["points"]:
        m, c, t, sh, th = pt["memory"], pt["comm"]["step"], pt["time_s"], pt["shares"], \
            pt["throughput"]
        mfu = f"{100 * th['mfu']:.1f}%" if th["mfu"] is not None else "-"
        lines.append(
            f"| {pt['label']} | {pt['seq_length']} | {max(m['peak_bytes_per_rank']) / MIB:.2f} "
            f"| {max(m['peak_increase_per_rank']) / MIB:.2f} "
            f"| {max(c['sent_bytes_per_rank']) / MIB:.2f} | {c['calls']} "
            f"| {_ms(t['overlapped'])} | {_ms(t['serialised'])} | {_ms(t['compute'])} "
            f"| {_ms(t['comm'])} | {sh['comp']:.2f} | {sh['comm']:.2f} | {sh['async']:.2f} "
            f"| {pt['overlap_vs_max']:.2f} | {th['tokens_per_s']:.0f} "
            f"| {th['tflops_per_rank']:.4f} | {mfu} |")
    if result.get("vs_tp"):
        lines += ["", "Against tp, same run (busy: each rank's compute-only time, CPU time on "
                  "CPU; max/mean over ranks):", "",
                  "| mode | s | tokens/s over tp | busy ms per rank | busy max/mean |",
                  "|---|---:|---:|---|---:|"]
        busy = {(pt["mode"], pt["seq_length"]): pt.get("busy_s_per_rank", [])
                for pt in result["points"]}
        for row in result["vs_tp"]:
            per = ", ".join(_ms(b) for b in busy.get((row["mode"], row["seq_length"]), []))
            lines.append(f"| {row['mode']} | {row['seq_length']} | "
                         f"{row['tokens_per_s_over_tp']:.2f} | {per} | "
                         f"{row['busy_max_over_mean']:.3f} |")
    lines += ["", "Communication per op (rank 0, one step; payload convention of CommCounter):",
              "", "| mode | s | part | op | calls | payload MiB |", "|---|---:|---|---|---:|---:|"]
    for pt in result["points"]:
        for part, stats in pt["comm"].items():
            for op, o in stats["ops"].items():
                lines.append(f"| {pt['label']} | {pt['seq_length']} | {part} | {op} "
                             f"| {o['calls']} | {o['payload_bytes'] / MIB:.3f} |")
    ov = result.get("overlap")
    if ov:
        lines += [
            "",
            f"Eq. 5 (METP Sec. 3.3) on this machine, {ov['ranks']} ranks: matmul "
            f"{ov['flops_per_s'] / 1e9:.1f} GFLOP/s per rank, ring step bandwidth "
            f"{ov['ring']['bandwidth'] / 1e9:.3f} GB/s per rank (latency "
            f"{1e6 * ov['ring']['latency']:.0f} us): F/W = "
            f"{ov['intensity_needed_flops_per_byte']:.1f} FLOPs/byte, so METP's weight ring "
            f"overlaps above s = p e F / (2 W b) = {ov['eq5_threshold_seq_length']:.0f} "
            f"(e = {ov['bytes_per_element']} bytes).",
        ]
        metp = [pt for pt in result["points"] if pt["mode"] == "metp"]
        if metp:
            lines += ["", "| s | above threshold | overlapped ms | max(compute, comm) ms "
                      "| overlapped / max |", "|---:|---|---:|---:|---:|"]
            for pt in metp:
                t = pt["time_s"]
                lines.append(f"| {pt['seq_length']} | {pt['above_eq5_threshold']} "
                             f"| {_ms(t['overlapped'])} | {_ms(max(t['compute'], t['comm']))} "
                             f"| {pt['overlap_vs_max']:.2f} |")
    for note in result.get("skipped", []):
        lines.append(f"\nskipped: {note}")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> str:
    """Write a PNG (peak memory and step times against s, one line per mode); returns a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return ("[metp bench] matplotlib is not installed: no plot written "
                "(pip install 'megatron-metp[plot]')")
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(dict.fromkeys(pt["label"] for pt in result["points"]))
    for label in labels:
        pts = [pt for pt in result["points"] if pt["label"] == label]
        s = [pt["seq_length"] for pt in pts]
        ax_m.plot(s, [max(pt["memory"]["peak_bytes_per_rank"]) / MIB for pt in pts], "o-",
                  label=label)
        line, = ax_t.plot(s, [1e3 * pt["time_s"]["overlapped"] for pt in pts], "o-",
                          label=f"{label} overlapped")
        ax_t.plot(s, [1e3 * pt["time_s"]["compute"] for pt in pts], "x--",
                  color=line.get_color(), label=f"{label} compute only")
    ov = result.get("overlap")
    if ov:
        ax_t.axvline(ov["eq5_threshold_seq_length"], color="grey", ls=":",
                     label="Eq. 5 threshold")
    for ax, ylabel in ((ax_m, "peak tensor MiB per rank (max)"), (ax_t, "step ms (slowest rank)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({pt["seq_length"] for pt in result["points"]}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.minorticks_off()
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_m.set_ylim(bottom=0)  # memory from zero: a narrow band must not look like a big gap
    times = [1e3 * pt["time_s"][k] for pt in result["points"] for k in ("overlapped", "compute")]
    if times and min(times) > 0 and max(times) / min(times) > 20:
        ax_t.set_yscale("log")  # step times spanning orders of magnitude across s
    else:
        ax_t.set_ylim(bottom=0)
    ax_m.legend(fontsize=7)
    ax_t.legend(fontsize=6)
    st = result["settings"]
    fig.suptitle(f"metp bench, {st['scope']}, p = {result['world_size']} "
                 f"({result['backend']}), h = {st['hidden_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"[metp bench] wrote {path}"
