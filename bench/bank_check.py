"""The bank model against the hardware: one representative instance per kernel kind is launched
under Nsight Compute, which counts the shared-memory wavefronts and bank conflicts of its loads
and stores; the table puts them beside the ways the model predicts for the instance's declared
accesses (codegen/passes/banks.py, the manifest's bank_ways).

  ncu --csv --log-file ncu.csv --metrics <METRICS> python -m bench.bank_check --launch
  python -m bench.bank_check --summarize ncu.csv [--out DIR]
(`STEPS=bank_check make gpu-check` runs both.)
"""
from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METRICS = ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
           "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"]


def representatives(manifest: list) -> list:
    """The first instance of each (family, kind) in the manifest, 16-bit where the kind has one
    (fp32 for the fp32-first families), forward and contracted where those axes exist."""
    chosen = {}
    for row in manifest:
        if row.get("direction", "fwd") != "fwd" or row.get("keys", "contracted") != "contracted":
            continue
        key = (row["family"], row["kind"])
        if key not in chosen or (row["dtype"] == "bf16" and chosen[key]["dtype"] != "bf16"):
            chosen[key] = row
    # The padded layout of the flash mma_sync kernel too (d96), beside its swizzled one.
    for row in manifest:
        if row["family"] == "flash_attention" and row["kind"] == "mma_sync" and row["params"]["swizzle"] == 0 \
                and row["dtype"] == "bf16":
            chosen[("flash_attention", "mma_sync padded")] = row
            break
    return list(chosen.values())


def launch(row: dict) -> None:
    """One small launch of the instance through its family's forcing entry point."""
    import torch
    import attngen
    name, p = row["name"], row["params"]
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[row["dtype"]]
    if row["family"] == "causal_linear":
        E, M = (p["e"], p["m"]) if "e" in p else (40, 36)
        q, k, v = (torch.randn(2, 4, 600, D, device="cuda").to(dtype) for D in (E, E, M))
        attngen.causal_dot_product_with(name, q, k, v, False)
    elif row["family"] == "rwkv":
        from attngen import rwkv
        N = p["n"]
        q, kc, vo = (torch.randn(2, 256, 4, N, device="cuda").to(dtype) for _ in range(3))
        w = -torch.rand(2, 256, 4, N, device="cuda").to(dtype)
        u, s0 = torch.randn(4, N, device="cuda").to(dtype), torch.randn(2, 4, N, N, device="cuda")
        rwkv.wkv_scan_with(name, q, kc, vo, w, u, s0, False, False, True, False)
    elif row["family"] == "paged":
        from attngen import paged
        D, heads = p["d"], paged.instance_heads(name)
        bt = torch.randperm(8 * 80, device="cuda")[: 8 * 64].to(torch.int32).view(8, 64)
        kc, vc = (torch.randn(8 * 80, 16, 2, D, device="cuda").to(dtype) for _ in range(2))
        q = torch.randn(8, 2 * heads, D, device="cuda").to(dtype)
        paged.paged_decode_with(name, q, kc, vc, bt, torch.full((8,), 1000, dtype=torch.int32, device="cuda"))
    elif row["family"] == "flash_attention":
        fa = importlib.import_module("attngen.flash_attention")
        D = p["d"]
        q, k, v = (torch.randn(1, 1024, 4, D, device="cuda").to(dtype) for _ in range(3))
        fa.flash_attention(q, k, v, instance=name)
    torch.cuda.synchronize()


def summarize(ncu_csv: str, manifest: list) -> list:
    """Per representative instance: ncu's counts summed over the kernels whose name carries the
    instance's name, beside the model's ways."""
    text = ncu_csv[ncu_csv.index('"ID"'):] if '"ID"' in ncu_csv else ncu_csv
    counts = {}
    for rec in csv.DictReader(io.StringIO(text)):
        kernel, metric = rec.get("Kernel Name", ""), rec.get("Metric Name", "")
        value = float(str(rec.get("Metric Value", "0")).replace(",", "") or 0)
        counts.setdefault(kernel, {}).setdefault(metric, 0.0)
        counts[kernel][metric] += value
    out = []
    for row in representatives(manifest):
        mine = {k: v for k, v in counts.items() if row["name"] in k}
        total = {m: sum(v.get(m, 0.0) for v in mine.values()) for m in METRICS}
        ld_w, ld_c, st_w, st_c = (total[m] for m in METRICS)
        ways = row["derived"].get("bank_ways", {})
        out.append({"instance": row["name"], "family": row["family"], "kind": row["kind"], "kernels": len(mine),
                    "ld_wavefronts": ld_w, "ld_conflicts": ld_c, "st_wavefronts": st_w, "st_conflicts": st_c,
                    "model_ways": ways, "model_conflict_free": all(w <= 1.0 for w in ways.values())})
    return out


def markdown(rows: list, meta: dict) -> str:
    pct = lambda c, w: f"{100 * c / w:.1f}%" if w else "-"  # noqa: E731
    lines = [f"# Shared-memory bank conflicts: model vs Nsight Compute ({meta.get('device', '?')}, commit "
             f"{meta.get('commit', '?')})", "",
             "One small launch per kernel kind (the first instance of the kind in the manifest, 16-bit where it has one); "
             "ncu counts summed over the instance's kernels. `conflicts` are extra wavefronts ncu attributes to bank "
             "conflicts, as a share of all wavefronts of the op. ldmatrix reads count as ld; wgmma reads its "
             "operands without the LSU and cp.async fills are not ld/st ops, so neither appears. The model's ways "
             "cover only the accesses a family declares.", "",
             "| instance | kernels | ld wavefronts | ld conflicts | st wavefronts | st conflicts | model ways |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ways = ", ".join(f"{k} {v:g}" for k, v in r["model_ways"].items()) or "-"
        lines.append(f"| `{r['instance']}` | {r['kernels']} | {r['ld_wavefronts']:.0f} | {r['ld_conflicts']:.0f} "
                     f"({pct(r['ld_conflicts'], r['ld_wavefronts'])}) | {r['st_wavefronts']:.0f} | {r['st_conflicts']:.0f} "
                     f"({pct(r['st_conflicts'], r['st_wavefronts'])}) | {ways} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", action="store_true", help="launch the representatives (run this under ncu)")
    ap.add_argument("--summarize", help="ncu's CSV log to tabulate")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    ap.add_argument("--metrics", action="store_true", help="print the ncu metrics list")
    args = ap.parse_args()
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    if args.metrics:
        print(",".join(METRICS))
    if args.launch:
        for row in representatives(manifest):
            print(f"launch {row['name']}", flush=True)
            launch(row)
    if args.summarize:
        import os
        rows = summarize(Path(args.summarize).read_text(), manifest)
        meta = {"commit": os.environ.get("ATTNGEN_COMMIT", "?")}
        try:
            import torch
            meta["device"] = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - the table is still useful without the device name
            pass
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bank_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (out / "bank_check.md").write_text(markdown(rows, meta))
        print((out / "bank_check.md").read_text())


if __name__ == "__main__":
    main()
