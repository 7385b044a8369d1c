"""The static resource report (`make report`, no GPU): for every instance of the build, what ptxas
reported when its cubin was compiled (registers, spills, stack), the threads and shared memory
the lowering chose, the theoretical occupancy those allow on the arch, and the bank model's
ways (wavefronts per request over the conflict-free ideal) for each shared-memory access the
family declares; report.png draws the same (codegen/report_figure.py).

  python -m codegen report [--out DIR]     after `make build` (the cubin logs are its input)
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import report_figure
from .arch import ARCHES, Arch
from .passes import banks
from .passes.resources import carveout_bytes

REG_UNIT = 8            # registers per thread are allocated in steps of 8...
WARP_REG_UNIT = 256     # ...and per warp in steps of 256 (CUDA occupancy calculator, CC 9.0)


@dataclass(frozen=True)
class Resources:
    """ptxas' report for one translation unit: the worst over its kernels."""
    kernels: int
    registers: int
    spill_bytes: int       # stores + loads
    stack_bytes: int
    wgmma_serialized: int = 0   # kernels whose wgmma ptxas serialized (each waits for the one before)
    wgmma_waits_injected: int = 0   # warpgroup.wait ptxas inserted where code touched in-flight accumulators


# ptxas' notes on Hopper's asynchronous MMA (C7510-C7515 "Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to ..."; C7517 "warpgroup.wait is injected ..."): invisible in
# the registers and spills, they cost a warpgroup its MMA overlap (the flash backward's DK_LAST
# comment, backward_wgmma.cu.j2, records ptxas serializing six of eight d64 variants once).
WGMMA_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized")
WGMMA_WAIT_INJECTED = re.compile(r"warpgroup\.wait is injected")


def parse_ptxas_log(text: str) -> Resources:
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    stacks = [int(x) for x in re.findall(r"(\d+) bytes stack frame", text)]
    return Resources(len(regs), max(regs, default=0), max(spills, default=0), max(stacks, default=0),
                     len(WGMMA_SERIALIZED.findall(text)), len(WGMMA_WAIT_INJECTED.findall(text)))


def wgmma_note(row: dict) -> str:
    """The report's wgmma column: serialized kernels and injected waits, or '-'."""
    notes = []
    if row.get("wgmma_serialized"):
        notes.append(f"serialized in {row['wgmma_serialized']}")
    if row.get("wgmma_waits_injected"):
        notes.append(f"{row['wgmma_waits_injected']} waits injected")
    return ", ".join(notes) or "-"


def occupancy(registers: int, threads: int, smem_bytes: int, arch: Arch, carveout: int | None = None) -> dict:
    """Resident CTAs and warps per SM that registers, shared memory (the SM's, or what the
    kernel's preferred `carveout` percentage carves it to) and threads allow, and which binds."""
    warps = -(-threads // 32)
    regs_per_warp = -(-(-(-registers // REG_UNIT) * REG_UNIT * 32) // WARP_REG_UNIT) * WARP_REG_UNIT
    smem_per_sm = arch.smem_per_sm if carveout is None else carveout_bytes(carveout, arch)
    limits = {
        "registers": arch.regs_per_sm // (regs_per_warp * warps) if registers else arch.max_ctas_per_sm,
        "shared memory": smem_per_sm // (smem_bytes + arch.smem_reserved_per_cta),
        "threads": arch.max_threads_per_sm // threads,
        "CTA slots": arch.max_ctas_per_sm,
    }
    limiter = min(limits, key=limits.get)
    ctas = limits[limiter]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps,
            "occupancy": ctas * warps * 32 / arch.max_threads_per_sm, "limiter": limiter}


def rows(manifest: list, cubin_dir: Path) -> list:
    out = []
    for inst in manifest:
        log = cubin_dir / f"{inst['file'][:-3]}.cubin.log"
        res = parse_ptxas_log(log.read_text()) if log.is_file() else None
        d = inst["derived"]
        arch = next(a for a in ARCHES.values() if inst["name"].endswith("_" + a.short))
        row = {"name": inst["name"], "family": inst["family"], "kind": inst["kind"], "threads": d["threads"],
               "smem_bytes": d["smem_bytes"], "bank": d.get("bank", {}), "built": res is not None}
        if res is not None:
            row.update({"kernels": res.kernels, "registers": res.registers, "spill_bytes": res.spill_bytes,
                        "stack_bytes": res.stack_bytes, "wgmma_serialized": res.wgmma_serialized,
                        "wgmma_waits_injected": res.wgmma_waits_injected,
                        **occupancy(res.registers, d["threads"], d["smem_bytes"], arch, d.get("smem_carveout"))})
        out.append(row)
    return out


def _ways(ways: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in ways.items()) or "-"


def _other_layout(row: dict, field: str) -> str:
    """The ways of the accesses whose cost differs at another layout: `unpadded` (no padding
    or swizzle) or `worst` (the worst layout the knob could have chosen)."""
    bank = row["bank"]
    changed = {k: v for k, v in banks.ways(bank, field).items() if bank[k][field] != bank[k]["wavefronts"]}
    return _ways(changed) if changed else ("same" if bank else "-")


def markdown(table: list, meta: dict | None = None) -> str:
    families = sorted({r["family"] for r in table})
    built = [r for r in table if r["built"]]
    meta = meta or {}
    source = ", ".join(f"{k} {v}" for k, v in meta.items())
    lines = [f"# Static resource report{f' ({source})' if source else ''}", "",
             "Written by `make report` (`python -m codegen report`) from `generated/manifest.json` and the ptxas "
             "logs of `make build` (`build/cubin/**/*.cubin.log`); no GPU involved. Registers and spills are "
             "the worst over the kernels of a TU (causal/window and score-transform variants count as kernels); "
             "occupancy is theoretical (registers, shared memory as the kernel's carveout leaves it, threads and "
             "CTA slots of the arch); bank ways "
             "are the model's wavefronts per request over the conflict-free ideal for each shared-memory access "
             "the family declares (`codegen/passes/banks.py`; each is a `// smem:` tag on the template lines "
             "that make it), at the layout the instance uses; `unpadded` gives the accesses whose ways differ "
             "without the padding or swizzle, `worst` those that differ at the worst layout the knob could "
             "have chosen (what the layout choice saves). `bank_check.md` puts the model beside Nsight "
             "Compute's per-instruction counts. `wgmma` gives ptxas' notes on Hopper's asynchronous MMA: "
             "the kernels of a TU whose wgmma it serialized, and the warpgroup.wait it injected where code "
             "touches accumulators still in flight (harmless after a loop, costly inside one).", "",
             f"{len(table)} instances, {len(built)} with a ptxas log, "
             f"{sum(1 for r in built if r['spill_bytes'])} with spills, "
             f"{sum(1 for r in built if r.get('wgmma_serialized'))} with serialized wgmma.", "",
             "| family | instances | registers | occupancy (warps/SM) | bound by |", "|---|---|---|---|---|"]
    for fam in families:
        rs = [r for r in built if r["family"] == fam]
        if not rs:
            continue
        limiters = sorted({r["limiter"] for r in rs})
        lines.append(f"| {fam} | {len(rs)} | {min(r['registers'] for r in rs)}-{max(r['registers'] for r in rs)} | "
                     f"{min(r['warps_per_sm'] for r in rs)}-{max(r['warps_per_sm'] for r in rs)} | {', '.join(limiters)} |")
    for fam in families:
        lines += ["", f"## {fam}", "",
                  "| instance | threads | regs | spills | wgmma | smem KB | CTAs/SM | warps/SM | bound by | bank ways | "
                  "unpadded | worst |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in table if r["family"] == fam):
            if not r["built"]:
                lines.append(f"| `{r['name']}` | {r['threads']} | (no ptxas log: run make build) | | | "
                             f"{r['smem_bytes'] / 1024:.1f} | | | | {_ways(banks.ways(r['bank']))} | {_other_layout(r, 'unpadded')} | "
                             f"{_other_layout(r, 'worst')} |")
                continue
            lines.append(f"| `{r['name']}` | {r['threads']} | {r['registers']} | {r['spill_bytes']} | {wgmma_note(r)} | "
                         f"{r['smem_bytes'] / 1024:.1f} | {r['ctas_per_sm']} | {r['warps_per_sm']} | {r['limiter']} | "
                         f"{_ways(banks.ways(r['bank']))} | {_other_layout(r, 'unpadded')} | {_other_layout(r, 'worst')} |")
    return "\n".join(lines) + "\n"


def toolchain(root: Path) -> dict:
    """The tree and compiler the cubins come from (the report's header)."""
    from .build import cuda_home
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    try:
        nvcc = subprocess.run([f"{cuda_home()}/bin/nvcc", "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+)", nvcc)
    except OSError:
        release = None
    return {"tree": commit or "unknown", "nvcc": release.group(1) if release else "unknown"}


def write(root: Path, out_dir: Path) -> Path:
    manifest = json.loads((root / "generated" / "manifest.json").read_text())
    table = rows(manifest, root / "build" / "cubin")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(table, indent=1) + "\n")
    meta = toolchain(root)
    path = out_dir / "report.md"
    path.write_text(markdown(table, meta))
    report_figure.draw(table, out_dir / "report.png",
                       f"Static resource report ({', '.join(f'{k} {v}' for k, v in meta.items())})")
    return path
