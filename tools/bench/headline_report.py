"""The report of ``headline.py``: the table per A with the verdicts (PaRO within budget vs the
best baseline, GGG / III against their FSDP2 equivalents, the advisor's ranking against the
measured one) and the throughput-vs-memory PNG.
"""
from __future__ import annotations

import os

BASELINE_LABEL = {"fsdp2-zero3": "FSDP2 ZeRO-3", "fsdp2-hsdp": "FSDP2 HSDP", "fsdp2-hpz": "FSDP2 raf=m (hpZ)",
                  "ddp": "torch DDP"}


def _label(row: dict) -> str:
    if row["kind"] == "paro":
        return f"PaRO {row['name']}" + (" *advisor*" if row.get("advisor_pick") else "")
    return BASELINE_LABEL.get(row["name"], row["name"])


def _kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau between two score lists (1 = same order)."""
    num = den = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            s = (a[i] - a[j]) * (b[i] - b[j])
            num += (s > 0) - (s < 0)
            den += 1
    return num / den if den else float("nan")


def _trainable_note(meta: dict) -> str:
    t, p = meta.get("trainable_params", meta["params"]), meta["params"]
    return "" if t == p else f" ({t / 1e6:.3f}M = {t / p:.1%} trainable)"


#: step / limit targets of the strategies whose inter traffic should hide under compute
LIMIT_TARGETS = {"IIG": 1.10, "NIG": 1.10, "NII": 1.10, "GGG": 1.25}


def limit_of(row: dict) -> float | None:
    """A step's limit measured in the same run: the slower of the same step on unshaped links
    (compute and fast links) and the node's inter bytes over the link rate."""
    if "unshaped_s" not in row:
        return None
    return max(row["unshaped_s"], row.get("link_s", 0.0))


def hidden_of(row: dict) -> float | None:
    """The fraction of the link's busy time that compute hides: 1 when the step takes no longer
    than on unshaped links, 0 when every second of link time adds to it."""
    if "unshaped_s" not in row or not row.get("link_s"):
        return None
    return min(1.0, max(0.0, 1.0 - (row["step_s"] - row["unshaped_s"]) / row["link_s"]))


def format_report(rows: list[dict], meta: dict, budget_mib: float | None) -> str:
    mib = 2**20
    out = [f"\n== tools.bench: {meta['n']} ranks = {meta['n'] // meta['m']} nodes x {meta['m']}, topology "
           f"{meta['topology']}, {meta['rate']} per link, {'MLP' if meta.get('model_kind') == 'mlp' else 'Llama'} "
           f"{meta['params'] / 1e6:.2f}M params"
           f"{_trainable_note(meta)}, {meta.get('dtype', 'fp32')}"]
    head = (f"{'config':<24} {'A':>2} {'tok/s':>8} {'vs Z3':>6} {'state MiB':>9} {'intra MiB':>9} "
            f"{'inter MiB':>9} {'meas s':>7} {'unsh s':>7} {'link s':>7} {'/limit':>6} {'hidden':>6} {'pred s':>7}")
    for accum in sorted({r["accum"] for r in rows}):
        sub = [r for r in rows if r["accum"] == accum]
        z3 = next((r for r in sub if r["name"] == "fsdp2-zero3" and not r["error"]), None)
        out += ["", head, "-" * len(head)]
        for r in sorted(sub, key=lambda r: -(r.get("tokens_per_s") or 0)):
            if r["error"]:
                out.append(f"{_label(r):<24} {accum:>2} failed: {r['error'][:80]}")
                continue
            vs = f"{r['tokens_per_s'] / z3['tokens_per_s']:6.2f}" if z3 else "     -"
            intra = f"{r['intra_bytes'] / mib:9.2f}" if "intra_bytes" in r else "        -"
            inter = f"{r['inter_bytes'] / mib:9.2f}" if "inter_bytes" in r else "        -"
            pred = f"{r['pred_s']:7.3f}" if "pred_s" in r else "      -"
            unsh = f"{r['unshaped_s']:7.3f}" if "unshaped_s" in r else "      -"
            link = f"{r['link_s']:7.3f}" if "link_s" in r else "      -"
            lim = limit_of(r)
            over = f"{r['step_s'] / lim:6.2f}" if lim else "     -"
            hid = hidden_of(r)
            hidden = f"{hid:6.0%}" if hid is not None else "     -"
            out.append(f"{_label(r):<24} {accum:>2} {r['tokens_per_s']:8.0f} {vs} {r['state_bytes'] / mib:9.2f} "
                       f"{intra} {inter} {r['step_s']:7.3f} {unsh} {link} {over} {hidden} {pred}")
        # the verdicts: which strategy wins where
        ok = [r for r in sub if not r["error"]]
        hsdp = next((r for r in ok if r["name"] == "fsdp2-hsdp"), None)
        budget = budget_mib * mib if budget_mib else (hsdp["state_bytes"] if hsdp else None)
        if budget:
            fit_p = [r for r in ok if r["kind"] == "paro" and r["state_bytes"] <= budget * 1.0001]
            fit_b = [r for r in ok if r["kind"] == "baseline" and r["state_bytes"] <= budget * 1.0001]
            if fit_p and fit_b:
                bp = max(fit_p, key=lambda r: r["tokens_per_s"])
                bb = max(fit_b, key=lambda r: r["tokens_per_s"])
                verdict = "beats" if bp["tokens_per_s"] > bb["tokens_per_s"] else "does NOT beat"
                out.append(
                    f"budget {budget / mib:.2f} MiB/rank: best PaRO {bp['name']} ({bp['tokens_per_s']:.0f} tok/s) "
                    f"{verdict} best baseline {_label(bb)} ({bb['tokens_per_s']:.0f} tok/s): "
                    f"{bp['tokens_per_s'] / bb['tokens_per_s']:.2f}x"
                )
        for r in ok:
            target = LIMIT_TARGETS.get(r["name"]) if r["kind"] == "paro" else None
            if target and limit_of(r):
                ratio = r["step_s"] / limit_of(r)
                out.append(f"PaRO {r['name']} step / its limit: {ratio:.2f}x "
                           f"({'within' if ratio <= target else 'OUTSIDE'} the {target:.2f}x target)")
        best = max((r for r in ok if r["kind"] == "paro"), key=lambda r: r["tokens_per_s"], default=None)
        z3 = next((r for r in ok if r["name"] == "fsdp2-zero3"), None)
        if best and z3:
            ratio = best["tokens_per_s"] / z3["tokens_per_s"]
            out.append(f"best PaRO ({best['name']}) / FSDP2 ZeRO-3 throughput: {ratio:.2f}x "
                       f"({'meets' if ratio >= 3.0 else 'MISSES'} the 3.0x target)")
        iig = next((r for r in ok if r["name"] == "IIG" and r["kind"] == "paro"), None)
        if iig and hsdp:
            ratio = iig["tokens_per_s"] / hsdp["tokens_per_s"]
            out.append(f"PaRO IIG / FSDP2 HSDP throughput: {ratio:.2f}x ({'meets' if ratio >= 1.10 else 'MISSES'} "
                       f"the 1.10x target)")
        for pn, bn in (("GGG", "fsdp2-zero3"), ("III", "fsdp2-hsdp")):
            p = next((r for r in ok if r["kind"] == "paro" and r["name"] == pn), None)
            b = next((r for r in ok if r["name"] == bn), None)
            if p and b:
                ratio = p["step_s"] / b["step_s"]
                out.append(f"PaRO {pn} step time / {_label(b)}: {ratio:.2f}x "
                           f"({'within' if ratio <= 1.10 else 'OUTSIDE'} the 1.10x target)")
        out += budget_verdicts(ok) + wire_verdicts(ok)
        pr = [r for r in ok if r["kind"] == "paro" and "pred_s" in r]
        if len(pr) >= 2:
            tau = _kendall([r["pred_s"] for r in pr], [r["step_s"] for r in pr])
            best_pred = min(pr, key=lambda r: r["pred_s"])["name"]
            best_meas = min(pr, key=lambda r: r["step_s"])["name"]
            errs = {r["name"]: r["pred_s"] / r["step_s"] - 1 for r in pr}
            worst = max(errs, key=lambda k: abs(errs[k]))
            within = sum(abs(e) <= 0.15 for e in errs.values())
            out.append(f"advisor ranking vs measured (PaRO strategies): Kendall tau {tau:.2f} "
                       f"({'meets' if tau >= 0.8 else 'MISSES'} the 0.8 target); predicted best {best_pred}, measured "
                       f"best {best_meas}; predicted step within 15% of measured for {within} of {len(errs)} "
                       f"(worst {worst} {errs[worst]:+.0%})")
    return "\n".join(out)


def wire_verdicts(rows: list[dict]) -> list[str]:
    """A strategy with a quantized inter wire (``GGG+int8``) against the same strategy exact and DeepSpeed
    ZeRO++ in the same run: its step (GGG: >= 1.6x the exact one where the link bounds it, faster than
    ZeRO++), its inter bytes (>= 3.5x fewer on the quantized phases) and its step over its limit."""
    out = []
    zpp = next((r for r in rows if r["name"] == "ds-zeropp"), None)
    for r in rows:
        if r["kind"] != "paro" or "+" not in r["name"]:
            continue
        name = r["name"].split("+")[0]
        exact = next((x for x in rows if x["kind"] == "paro" and x["name"] == name), None)
        line = f"PaRO {r['name']}:"
        if exact:
            line += f" step {exact['step_s'] / r['step_s']:.2f}x faster than {name}'s"
            if exact.get("inter_bytes") and r.get("inter_bytes"):
                line += f", {exact['inter_bytes'] / r['inter_bytes']:.2f}x fewer inter bytes"
        if zpp:
            line += f"; {zpp['step_s'] / r['step_s']:.2f}x ZeRO++'s step ({zpp['step_s']:.3f} s)"
        if limit_of(r):
            line += f"; step / its limit {r['step_s'] / limit_of(r):.2f}x"
        out.append(line)
    return out


def budget_verdicts(rows: list[dict]) -> list[str]:
    """``--budgets``: each auto plan against the fastest single strategy measured here whose predicted
    peak fits its budget. Between two strategies' peaks a plan per block should win (>= 1.05x);
    elsewhere it should not lose (>= 0.97x)."""
    mib, out = 2**20, []
    for a in (r for r in rows if "budget_bytes" in r):
        between = "-" in a["name"]
        target = 1.05 if between else 0.97
        fits = [r for r in rows if r["kind"] == "paro" and r["name"] in a["fits"]]
        line = (f"{a['name']}: budget {a['budget_bytes'] / mib:.1f} MiB/rank, plan {' + '.join(a['plan'])}, predicted "
                f"peak {a['pred_peak'] / mib:.1f} MiB, {a['step_s']:.3f} s")
        if not fits:
            out.append(line + f"; no single strategy measured here fits (fitting: {', '.join(a['fits']) or 'none'})")
            continue
        best = min(fits, key=lambda r: r["step_s"])
        ratio = best["step_s"] / a["step_s"]
        out.append(line + f"; best single that fits: {best['name']} {best['step_s']:.3f} s -> {ratio:.2f}x "
                   f"({'meets' if ratio >= target else 'MISSES'} the {target:.2f}x target)")
    return out


def write_png(rows: list[dict], meta: dict, path: str) -> str | None:
    """Throughput vs per-rank model-state memory, one panel per A."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    accums = sorted({r["accum"] for r in rows})
    fig, axes = plt.subplots(1, len(accums), figsize=(6.5 * len(accums), 5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        for r in rows:
            if r["accum"] != accum or r["error"]:
                continue
            paro = r["kind"] == "paro"
            ax.scatter(r["state_bytes"] / 2**20, r["tokens_per_s"], marker="o" if paro else "s",
                       color="tab:blue" if paro else "tab:red", s=60 if r.get("advisor_pick") else 30)
            ax.annotate(_label(r).replace("PaRO ", ""), (r["state_bytes"] / 2**20, r["tokens_per_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("model states per rank (MiB)")
        ax.set_ylabel("tokens / s (all ranks)")
        ax.set_title(f"A = {accum}: PaRO (blue) vs baselines (red)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['n'] // meta['m']} nodes x {meta['m']} ranks, {meta['topology']}, {meta['rate']}, "
                 f"{meta.get('dtype', 'fp32')}{_trainable_note(meta)}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
