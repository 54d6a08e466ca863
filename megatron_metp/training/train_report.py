"""What ``metp train`` prints and writes: per-iteration lines or a progress bar, JSON lines, the
final summary table and, under ``--compare``, the loss curves side by side.

Every rank records (so each can return its results); only rank 0 prints and writes.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Dict, List, Optional


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(header: List[str], rows: List[List[str]]) -> str:
    """A Markdown table with right-aligned columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).rjust(w) for x, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


class Reporter:
    def __init__(self, rank: int, log_json: Optional[str] = None, interactive: bool = False,
                 out=None):
        self.rank = rank
        self.out = out or sys.stdout
        self.interactive = interactive
        # Appended to, as Megatron-LM's logs: a resumed or requeued run continues the record.
        self._json = open(log_json, "a") if (log_json and rank == 0) else None
        self._records: List[Dict] = []
        self._mode = ""
        self._total = 0
        self._start = 0
        self._layout: Dict = {}

    def _print(self, msg: str, end: str = "\n") -> None:
        if self.rank == 0:
            self.out.write(msg + end)
            self.out.flush()

    def start_mode(self, mode: str, ns, total: int, start: int, layout: Dict) -> None:
        self._mode, self._total, self._start, self._layout = mode, total, start, layout
        self._records = []
        self._print(
            f"[metp] mode {mode}: DP {layout['dp']} x TP {layout['tp']} x CP {layout['cp']} x "
            f"PP {layout['pp']} | {ns.num_layers} layers, hidden {ns.hidden_size}, heads "
            f"{ns.num_attention_heads} | seq {ns.seq_length}, micro batch {ns.micro_batch_size}, "
            f"global batch {ns.global_batch_size} | iterations {start + 1}..{total}")

    def iteration(self, rec: Dict) -> None:
        self._records.append(rec)
        if self.rank != 0:
            return
        if self._json is not None:
            self._json.write(json.dumps(rec) + "\n")
            self._json.flush()
        mfu = f" | MFU {100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else ""
        line = (f"[{rec['mode']}] iter {rec['iteration']:>5}/{self._total} | loss "
                f"{rec['loss']:.4f} | lr {rec['lr']:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
                f"{rec['tflops_per_device']:.4f} TFLOP/s/dev{mfu} | "
                f"{'peak RSS' if rec.get('peak_mem_kind') == 'rss' else 'peak mem'} "
                f"{_fmt_bytes(rec['peak_mem_bytes'])} | {1000 * rec['iter_time_s']:.0f} ms")
        if not self.interactive:
            self._print(line)
            return
        done = rec["iteration"] - self._start
        todo = max(self._total - self._start, 1)
        width = max(10, min(40, shutil.get_terminal_size((80, 20)).columns - 40))
        filled = int(width * done / todo)
        bar = f"[{self._mode}] [{'#' * filled}{'.' * (width - filled)}] {done}/{todo}"
        self._print("\r\033[K" + line + "\n" + bar, end="" if done < todo else "\n")

    def end_mode(self) -> Dict:
        recs = self._records
        losses = [r["loss"] for r in recs]
        timed = recs[1:] or recs  # the first iteration includes one-off set-up costs
        summary = dict(
            mode=self._mode, iterations=len(recs), first_loss=losses[0] if losses else None,
            last10_mean=(sum(losses[-10:]) / len(losses[-10:])) if losses else None,
            tokens_per_s=sum(r["tokens_per_s"] for r in timed) / max(len(timed), 1),
            tflops_per_device=sum(r["tflops_per_device"] for r in timed) / max(len(timed), 1),
            mfu=(sum(r["mfu"] for r in timed) / len(timed)) if timed and timed[0]["mfu"] is not None
            else None,
            peak_mem_bytes=max((r["peak_mem_bytes"] for r in recs), default=0),
            seconds=sum(r["iter_time_s"] for r in recs), layout=self._layout)
        return dict(losses=losses, summary=summary)

    def final(self, results: Dict[str, Dict], compare: bool = False) -> None:
        rows = []
        for mode, res in results.items():
            s = res["summary"]
            lay = s["layout"]
            if not s["iterations"]:  # e.g. --train-iters 0 --save: initial weights only
                rows.append([mode, f"{lay['dp']}x{lay['tp']}x{lay['cp']}x{lay['pp']}", 0]
                            + ["-"] * 8)
                continue
            ratio = s["last10_mean"] / s["first_loss"]
            rows.append([mode, f"{lay['dp']}x{lay['tp']}x{lay['cp']}x{lay['pp']}",
                         s["iterations"], f"{s['first_loss']:.4f}", f"{s['last10_mean']:.4f}",
                         f"{ratio:.3f}", f"{s['tokens_per_s']:,.0f}",
                         f"{s['tflops_per_device']:.4f}",
                         "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
                         _fmt_bytes(s["peak_mem_bytes"]), f"{s['seconds']:.1f}"])
        self._print("\nSummary")
        self._print(table(["mode", "DPxTPxCPxPP", "iters", "first loss", "last-10 mean",
                           "ratio", "tokens/s", "TFLOP/s/dev", "MFU", "peak mem", "time s"], rows))
        if compare and len(results) > 1:
            modes = list(results)
            n = min(len(results[m]["losses"]) for m in modes)
            curve = []
            worst = (0.0, 0, "")
            for i in range(n):
                vals = [results[m]["losses"][i] for m in modes]
                diff = max(vals) - min(vals)
                if diff > worst[0] or i == 0:
                    worst = (diff, i + 1, "")
                curve.append([i + 1] + [f"{v:.6f}" for v in vals] + [f"{diff:.2e}"])
            self._print("\nLoss curves (same seed and data, dropout 0)")
            self._print(table(["iter"] + modes + ["max diff"], curve))
            self._print(f"\nlargest difference between modes: {worst[0]:.3e} "
                        f"(iteration {worst[1]})")
        if self._json is not None:
            self._json.close()
            self._json = None
