"""The static report's figure (`make report` writes report.png beside report.md): where every
built instance sits in registers against resident warps (spilling ones ringed), and per kernel
kind what the bank model predicts its shared-memory accesses cost at the layout chosen, without
padding or swizzle, and at the worst layout the knob allows.

matplotlib draws it (a plotting library does this better than hand-written PNG code); it is a
requirement of `make setup`.
"""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("make report: the figure needs matplotlib (pip install matplotlib, or make setup)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def kind_costs(table: list) -> list[tuple[str, dict]]:
    """Per (family, kind), summed over its instances' accesses: wavefronts per request at each
    layout over the conflict-free ideal (1.0: no access conflicts anywhere in the kind)."""
    sums: dict[str, dict] = {}
    for row in table:
        bank = row["bank"]
        if not bank:
            continue
        acc = sums.setdefault(f"{row['family']} {row['kind']}", {"ideal": 0, "wavefronts": 0, "unpadded": 0,
                                                                  "worst": 0})
        for record in bank.values():
            for field in acc:
                acc[field] += record[field]
    return [(kind, {f: acc[f] / acc["ideal"] for f in ("wavefronts", "unpadded", "worst")})
            for kind, acc in sorted(sums.items())]


def draw(table: list, path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, (occ, bank) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.3]})
    built = [r for r in table if r["built"]]
    for i, fam in enumerate(sorted({r["family"] for r in built})):
        rs = [r for r in built if r["family"] == fam]
        occ.scatter([r["registers"] for r in rs], [r["warps_per_sm"] for r in rs], s=14, alpha=0.6,
                    color=f"C{i}", label=f"{fam} ({len(rs)})")
        spilled = [r for r in rs if r["spill_bytes"]]
        occ.scatter([r["registers"] for r in spilled], [r["warps_per_sm"] for r in spilled], s=60,
                    facecolors="none", edgecolors="red")
    occ.set_xlabel("registers per thread (ptxas)")
    occ.set_ylabel("resident warps per SM (theoretical)")
    occ.set_title("every built instance (red ring: spills)")
    occ.legend(fontsize=8)
    occ.grid(alpha=0.3)

    costs = kind_costs(table)
    y = range(len(costs))
    for offset, field, label, color in ((-0.27, "wavefronts", "chosen layout", "C2"),
                                        (0.0, "unpadded", "no padding / swizzle", "C1"),
                                        (0.27, "worst", "worst layout the knob allows", "C3")):
        bank.barh([v + offset for v in y], [c[field] for _, c in costs], height=0.26, color=color, label=label)
    bank.set_yticks(list(y), [kind for kind, _ in costs], fontsize=7)
    bank.invert_yaxis()
    bank.axvline(1.0, color="black", lw=0.8)
    bank.set_xlabel("shared-memory wavefronts / conflict-free ideal (model, all accesses of all instances)")
    bank.set_title("bank model per kernel kind")
    bank.legend(fontsize=8, loc="lower right")
    bank.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

