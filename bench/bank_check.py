"""The bank model against the hardware, access by access.

Nsight Compute's source counters give, for every SASS instruction of a profiled kernel, how
often it executed and how many shared-memory wavefronts it took. nvdisasm's line table (the
build passes -lineinfo) gives each instruction's source line and the lines it was inlined at;
the first of them that carries a `// smem: <access>` tag names the access (codegen/passes/
banks.py). Summed per access, measured wavefronts per request stand beside the model's
prediction for the instance, for one representative instance per kernel kind and, where a
kind has a padding knob, for its unpadded twin (built on first use, reached by name).

Shared-memory instructions no tag claims are listed as untagged: the model is blind to them.
Before judging a kernel, the same join runs over bench/bankprobe/patterns.cu, whose accesses
have known costs (PROBE), so a misread counter shows up there first.

  python -m bench.bank_check --prepare --work DIR     cubins, unpadded twins, line tables (GPU machine)
  ncu --section SourceCounters --kernel-name-base mangled --kernel-name regex:attngen \\
      -o DIR/profile python -m bench.bank_check --launch --work DIR
  ncu -i DIR/profile.ncu-rep --page source --csv --print-source sass --print-kernel-base mangled > DIR/sass.csv
  python -m bench.bank_check --summarize --work DIR [--out bench/results/h100]
(`STEPS=bank_check make gpu-check` runs all of it, the probe included.)
"""
from __future__ import annotations

import argparse
import csv
import functools
import importlib
import io
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codegen.passes import banks  # noqa: E402

TOLERANCE = 0.10          # the bar: measured within 10% of the model
SHARED_OPCODES = frozenset({"LDS", "STS", "LDSM", "STSM", "LDGSTS", "ATOMS"})  # SASS opcodes touching shared memory
# cp.async (LDGSTS) writes shared memory as the global lines it reads arrive: ncu counts its
# wavefronts per global line (one 16-byte piece from each of 32 rows: 32), which the bank model,
# a description of the shared side, does not hold. A fill that costs more than its shared side
# is reported as bound by its global lines, never as agreement.
GLOBAL_SIDE_OPCODES = ("LDGSTS",)

# bench/bankprobe/patterns.cu: each tagged access and the model's description of it.
# Rows of 128 bytes; the swizzled read takes chunk (c ^ row) of row `lane` (c = 0 here), the
# unswizzled one chunk c of every row (ptxas narrows that float4 to 8 bytes: only two are used).
PROBE = [banks.contiguous("init_rows", 4, ()),
         banks.Access("column_stride32", 4, lambda lane, _: lane * 32 * 4),
         banks.Access("column_padded", 4, lambda lane, _: lane * 33 * 4),
         banks.Access("vector16", 16, lambda lane, _: lane * 16),
         banks.Access("xor_swizzled", 16, lambda lane, _: lane * 128 + (lane & 7) * 16),
         banks.Access("unswizzled_rows", 8, lambda lane, _: lane * 128),
         banks.Access("column_store_stride32", 4, lambda lane, _: lane * 32 * 4)]


# ---- choosing what to profile --------------------------------------------------------------

def _saved(row: dict) -> int:
    """Wavefronts per warp request the instance's layout saves over the unpadded one."""
    return sum(r["unpadded"] - r["wavefronts"] for r in row["derived"].get("bank", {}).values())


def representatives(manifest: list) -> list:
    """One instance per (family, kind): forward and keys contracted where those axes exist,
    16-bit where the kind has it; of a kind with a padding knob, the instance whose padding
    saves the most (its twin at pad 0 then shows what the padding is worth)."""
    chosen = {}
    for row in manifest:
        if row.get("direction", "fwd") != "fwd" or row.get("keys", "contracted") != "contracted":
            continue
        key = (row["family"], row["kind"])
        old = chosen.get(key)
        if old is None or (row["dtype"] != "fp32", _saved(row)) > (old["dtype"] != "fp32", _saved(old)):
            chosen[key] = row
    # A kind whose rows are padded where its swizzle is off (flash mma_sync at d96): that layout
    # too, beside the swizzled one.
    for row in manifest:
        if row["params"].get("swizzle") == 0 and row["dtype"] == "bf16":
            chosen.setdefault((row["family"], row["kind"] + " padded"), row)
    return list(chosen.values())


def needs_twin(row: dict) -> bool:
    """A kind with a padding knob whose chosen padding is not 0."""
    return isinstance(row["params"].get("pad"), int) and row["params"]["pad"] != 0


@functools.lru_cache(maxsize=1)
def _built() -> dict:
    """{instance name: (spec, lowered instance)} of the default build."""
    from codegen import pipeline
    return {inst.name: (spec, inst) for spec, insts in pipeline.lower(pipeline.expand(pipeline.load())) for inst in insts}


def twin_plan(row: dict):
    """The plan of `row`'s instance at pad 0, every pass checked (codegen/jit.py)."""
    from codegen import jit
    from attngen import _jit
    spec, inst = _built()[row["name"]]
    return jit.plan_instance(spec, inst.with_params(pad=0), cache_tag=_jit.toolchain_tag())


def as_row(inst, family: str) -> dict:
    return {"name": inst.name, "family": family, "kind": inst.kind, "dtype": inst.a["dtype"],
            "params": inst.p, "derived": inst.d, **{k: v for k, v in inst.a.items() if k != "dtype"}}


# ---- launching ----------------------------------------------------------------------------

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
    elif row["family"] == "rwkv_grad":
        from attngen import _ext
        from bench.workloads import rwkv_grad
        _ext.load()
        args = rwkv_grad.inputs(torch, torch.ops.attngen, {"B": 2, "H": 4, "T": 256, "N": p["n"]}, dtype, seed=0)
        torch.ops.attngen.wkv_grad_rkwu_with(*args, True, name)
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
        if p.get("kv_e"):   # an fp8 paged cache under a 16-bit q (paged_attention): pages of 16, shuffled
            pa = importlib.import_module("attngen.paged_attention")
            cache = torch.randn(2, 80, 16, 4, D, device="cuda").to(torch.float8_e5m2 if p["kv_e"] == 5 else
                                                                   torch.float8_e4m3fn)
            table = torch.randperm(80, device="cuda")[:64].to(torch.int32).view(1, 64)
            cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
            pa.paged_attention(q[0], cache[0], cache[1], table, cu, cu[1:], 1024, 1024, instance=name)
        elif row["params"].get("tma"):
            # TMA loads take no thread accesses; a packed batch takes the cp.async fills instead
            cu = torch.tensor([0, 300, 1024], dtype=torch.int32, device="cuda")
            fa.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 724, 724, instance=name)
        else:
            fa.flash_attention(q, k, v, instance=name)
    torch.cuda.synchronize()


# ---- reading ncu and nvdisasm -------------------------------------------------------------

def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_source_csv(text: str) -> dict:
    """ncu's source page (--page source --csv --print-source sass): {kernel: [instruction]}, each
    instruction {offset (bytes from the kernel's first), sass, executed, wavefronts, ideal,
    samples (warp stall samples, where SourceCounters sampled them), stalls ({reason: samples})}.
    A kernel without shared memory has no shared columns (zeros). ncu 2025.3 prints some results
    twice: a block equal to one already read is dropped; another launch of a kernel adds."""
    blocks, name, header = [], None, None
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        if rec[0] == "Kernel Name":
            name, header = rec[1], None
            blocks.append((name, []))
            continue
        if rec[0] == "Address":
            header = {h: i for i, h in enumerate(rec)}
            continue
        if name is None or header is None or not rec[0].startswith("0x"):
            continue

        def column(title):
            i = header.get(title)
            return _number(rec[i]) if i is not None and i < len(rec) else 0.0
        stalls = {title[len("stall_"):]: column(title) for title in header
                  if title.startswith("stall_") and not title.endswith("(Not Issued)")}
        blocks[-1][1].append({"address": int(rec[0], 16), "sass": rec[header["Source"]].strip(),
                              "executed": column("Instructions Executed"), "wavefronts": column("L1 Wavefronts Shared"),
                              "ideal": column("L1 Wavefronts Shared Ideal"),
                              "samples": column("Warp Stall Sampling (All Samples)"), "stalls": stalls})
    kernels, seen = {}, set()
    for name, rows in blocks:
        base = min((r["address"] for r in rows), default=0)
        rows = [{**{k: v for k, v in r.items() if k != "address"}, "offset": r["address"] - base} for r in rows]
        signature = (name, tuple((r["offset"], r["executed"], r["wavefronts"]) for r in rows))
        if signature in seen:
            continue
        seen.add(signature)
        if name not in kernels:
            kernels[name] = rows
        else:   # another launch of the same kernel: same code, counts add up
            for old, new in zip(kernels[name], rows):
                for key in ("executed", "wavefronts", "ideal", "samples"):
                    old[key] += new[key]
                for reason, count in new["stalls"].items():
                    old["stalls"][reason] = old["stalls"].get(reason, 0.0) + count
    return kernels


LINE_INFO = re.compile(r'"([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")


def parse_line_table(text: str) -> dict:
    """nvdisasm -c -gi: {function: {offset: [(file, line), ...]}}, innermost frame first, then
    the lines it was inlined at. nvdisasm writes a chain as consecutive `//##` lines, one frame
    each (`File "a", line 88 inlined at "b", line 92`, then `File "b", line 92 ...`), before the
    instructions it covers."""
    table, function, chain, fresh = {}, None, [], True
    for line in text.splitlines():
        m = SECTION.match(line)
        if m:
            function, chain, fresh = m.group(1), [], True
            table[function] = {}
            continue
        if "//##" in line:
            if fresh:
                chain, fresh = [], False
            for frame in LINE_INFO.findall(line):
                frame = (frame[0], int(frame[1]))
                if frame not in chain:
                    chain.append(frame)
            continue
        m = INSTRUCTION.search(line)
        if m and function is not None:
            table[function][int(m.group(1), 16)] = list(chain)
            fresh = True
    return table


class Sources:
    """Tags of the source files a line table names; a file built in a temporary directory (the
    JIT renames it into place) is found by its last two path parts under `roots`."""

    def __init__(self, roots: list):
        self.roots = [Path(r) for r in roots]
        self.cache = {}

    def tag(self, path: str, line: int):
        if path not in self.cache:
            found = Path(path) if Path(path).is_file() else None
            if found is None:
                tail = Path(*Path(path).parts[-2:])
                found = next((r / tail for r in self.roots if (r / tail).is_file()), None)
            self.cache[path] = banks.tags(found.read_text()) if found else {}
        return self.cache[path].get(line)


def opcode(sass: str) -> str:
    """The opcode of a SASS line, its predicate (`@P0`, `@!PT`) dropped: `LDS.128`."""
    words = sass.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def shared_op(sass: str) -> str | None:
    base = opcode(sass).split(".")[0]
    return base if base in SHARED_OPCODES else None


def access_bytes(op: str) -> int | None:
    """Bytes per lane of an LDS/STS opcode (`LDS.64`: 8, `STS.U16`: 2, `LDS`: 4); None for the
    others (ldmatrix, cp.async), whose width the opcode does not say the same way."""
    parts = op.split(".")
    if parts[0] not in ("LDS", "STS"):
        return None
    sizes = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
    return next((sizes[x] for x in parts[1:] if x in sizes), 4)


def attribute(instructions: list, lines: dict, sources: Sources) -> dict:
    """{access tag or None (untagged): {executed, wavefronts, ideal, opcodes, by_width}} over the
    shared instructions of one kernel that executed; by_width splits the sums by bytes per lane."""
    def sums():
        return {"executed": 0.0, "wavefronts": 0.0, "ideal": 0.0}
    out = defaultdict(lambda: {**sums(), "opcodes": set(), "by_width": defaultdict(sums)})
    for ins in instructions:
        op = shared_op(ins["sass"])
        if op is None or ins["executed"] == 0 or ins["sass"].startswith("@!PT"):   # @!PT: never runs
            continue
        tag = next((t for f, n in lines.get(ins["offset"], []) if (t := sources.tag(f, n))), None)
        acc = out[tag]
        for target in (acc, acc["by_width"][access_bytes(opcode(ins["sass"]))]):
            target["executed"] += ins["executed"]
            target["wavefronts"] += ins["wavefronts"]
            target["ideal"] += ins["ideal"]
        acc["opcodes"].add(opcode(ins["sass"]))
    return dict(out)


def judge(predicted: float, ideal: float, measured: dict, width: int | None = None) -> str:
    """`agrees`: wavefronts within TOLERANCE. `ways agree`: the conflict ratio (wavefronts over
    the conflict-free count, the model's and ncu's) agrees but the count does not, because
    ptxas made the access with other widths than its source (two LDS.64 merged into an LDS.128,
    ldmatrix .x1 beside .x4): the layout is judged right, the instruction mix differs."""
    per_request = measured["wavefronts"] / measured["executed"]
    if abs(per_request - predicted) <= TOLERANCE * predicted:
        return "agrees"
    if per_request > predicted and all(op.startswith(GLOBAL_SIDE_OPCODES) for op in measured["opcodes"]):
        return "global lines"
    ways, measured_ways = predicted / ideal, measured["wavefronts"] / max(measured["ideal"], 1e-9)
    if abs(measured_ways - ways) <= TOLERANCE * ways:
        return "ways agree"
    # The instructions of the declared width agree, and others of another width share the line:
    # ptxas hoisted a neighbouring access (the next step's q and decay reads, LDS.128) into the
    # line's span, and the line table gives them its line (rwkv wide_head's vo_read, nvdisasm).
    own = measured.get("by_width", {}).get(width)
    if own and own["executed"] and len(measured["by_width"]) > 1 and \
            abs(own["wavefronts"] / own["executed"] - predicted) <= TOLERANCE * predicted:
        return "agrees at its width"
    return "DIFFERS"


def compare(model: dict, measured: dict) -> list:
    """Rows of the table for one instance: every declared access, measured or not, and what no
    tag claims."""
    rows = []
    for name, rec in model.items():
        m = measured.get(name)
        row = {"access": name, "width": rec["width"], "predicted": rec["wavefronts"], "ideal": rec["ideal"]}
        if m is None or m["executed"] == 0:
            row.update(verdict="not executed")
        else:
            row.update(measured=m["wavefronts"] / m["executed"], ncu_ideal=m["ideal"] / m["executed"],
                       requests=m["executed"], opcodes=sorted(m["opcodes"]),
                       verdict=judge(rec["wavefronts"], rec["ideal"], m, rec["width"]))
        rows.append(row)
    for name, m in measured.items():
        if name in model:
            continue
        rows.append({"access": name or "(untagged)", "measured": m["wavefronts"] / m["executed"],
                     "ncu_ideal": m["ideal"] / m["executed"], "requests": m["executed"], "opcodes": sorted(m["opcodes"]),
                     "verdict": "undeclared" if name else "untagged"})
    return rows


def summarize(work: Path, plan: dict) -> dict:
    """The per-access table of every profiled instance and of the probe."""
    kernels = parse_source_csv((work / "sass.csv").read_text())
    sources = Sources([ROOT / "generated", *plan.get("source_roots", [])])
    models = current_models(plan)
    out = {"instances": [], "probe": None}
    for row in plan["rows"]:
        lines = parse_line_table((work / row["line_table"]).read_text())
        mine = {k: v for k, v in kernels.items() if row["name"] in k}
        measured = {}
        for kernel, instructions in mine.items():
            for tag, m in attribute(instructions, lines.get(kernel, {}), sources).items():
                acc = measured.setdefault(tag, {"executed": 0.0, "wavefronts": 0.0, "ideal": 0.0, "opcodes": set(),
                                                "by_width": {}})
                for key in ("executed", "wavefronts", "ideal"):
                    acc[key] += m[key]
                acc["opcodes"] |= m["opcodes"]
                for width, w in m["by_width"].items():
                    into = acc["by_width"].setdefault(width, {"executed": 0.0, "wavefronts": 0.0, "ideal": 0.0})
                    for key in into:
                        into[key] += w[key]
        out["instances"].append({"instance": row["name"], "family": row["family"], "kind": row["kind"],
                                 "twin_of": row.get("twin_of"), "twin_pad": row.get("twin_pad"), "kernels": len(mine),
                                 "accesses": compare(models.get(row["name"], row["derived"].get("bank", {})), measured)})
    if (work / "probe_sass.csv").is_file():
        out["probe"] = probe_summary((work / "probe_sass.csv").read_text(), (work / "probe_lines.txt").read_text())
    return out


def current_models(plan: dict) -> dict:
    """{instance: bank record} from this tree's model: the counts of a run can be judged again
    after the model changes (the kernels the run profiled must be unchanged)."""
    manifest = {r["name"]: r for r in json.loads((ROOT / "generated" / "manifest.json").read_text())}
    out = {}
    for row in plan["rows"]:
        if row["name"] in manifest:
            out[row["name"]] = manifest[row["name"]]["derived"].get("bank", {})
        elif row.get("twin_of") in manifest:
            out[row["name"]] = twin_plan(manifest[row["twin_of"]]).inst.d["bank"]
    return out


def probe_summary(sass_csv: str, line_table: str) -> list:
    """The join over bench/bankprobe/patterns.cu, against the costs PROBE knows."""
    kernels = parse_source_csv(sass_csv)
    lines = parse_line_table(line_table)
    sources = Sources([ROOT / "bench"])
    model = {a.name: {"width": a.width, "wavefronts": a.cost(0), "ideal": a.ideal(0)} for a in PROBE}
    rows = []
    for kernel, instructions in kernels.items():
        function = next((f for f in lines if f in kernel or kernel.startswith(f.split("(")[0])), None)
        if function is None:   # a demangled kernel name: the probe has one kernel
            function = next(iter(lines), None)
        rows += compare(model, attribute(instructions, lines.get(function, {}), sources))
    return rows


# ---- writing ------------------------------------------------------------------------------

def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def markdown(result: dict, meta: dict) -> str:
    lines = [f"# Shared-memory bank model vs Nsight Compute, access by access ({meta.get('device', '?')}, commit "
             f"{meta.get('commit', '?')})", "",
             f"Counts profiled at commit {meta.get('commit', '?')}; predictions of the model at "
             f"{meta.get('judged_at', meta.get('commit', '?'))} (`--summarize` judges a run's counts with the "
             "model of the tree it runs in).", "",
             "Each row is one access a template tags (`// smem: <access>`) and its family's lowering declares "
             "(`codegen/passes/banks.py`). `predicted`: the model's wavefronts per warp request at the instance's "
             "layout; `measured`: ncu's source counters, L1 shared wavefronts over executed instructions, summed "
             "over the SASS instructions whose line (or a line they were inlined at) carries the tag "
             "(nvdisasm's line table); `ncu ideal`: ncu's own conflict-free count. `agrees`: within "
             f"{TOLERANCE:.0%}. `global lines`: a cp.async fill (LDGSTS) that costs more than its shared side; "
             "ncu counts its wavefronts per global line it reads (a 16-byte piece from each of 32 rows: 32), "
             "which the bank model, a description of the shared side only, does not hold. `ways agree`: the "
             "conflict ratio agrees (model wavefronts over its ideal, ncu's over ncu's ideal), the count does "
             "not, because ptxas made the access with other widths than its source (LDS.128 beside LDS.64, "
             "ldmatrix .x1 beside .x4). `agrees at its width`: the instructions of the access's own width "
             "agree, and instructions of another width carry its line too (ptxas hoisted a neighbouring "
             "access into the line's span: rwkv wide_head's vo_read line holds the first step's q and decay "
             "LDS.128 beside its own LDS.64). wgmma operand reads "
             "and TMA writes are not thread instructions and have no row. "
             "`(untagged)`: shared instructions no tag claims. Twins: the same instance at pad 0, built on "
             "first use.", "",
             "Reproduce: `STEPS=bank_check make gpu-check` (tree as committed).", ""]
    if result.get("probe"):
        lines += ["## Probe: patterns with known costs (`bench/bankprobe/patterns.cu`)", "",
                  "| access | predicted | measured | ncu ideal | verdict |", "|---|---|---|---|---|"]
        for r in result["probe"]:
            lines.append(f"| {r['access']} | {_fmt(r.get('predicted'))} | {_fmt(r.get('measured'))} | "
                         f"{_fmt(r.get('ncu_ideal'))} | {r['verdict']} |")
        lines.append("")
    verdicts = defaultdict(int)
    for inst in result["instances"]:
        for r in inst["accesses"]:
            verdicts[r["verdict"]] += 1
    lines += ["## Kernels", "", "Verdicts over every row: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())), ""]
    for inst in result["instances"]:
        title = f"`{inst['instance']}`" + (f" (unpadded twin of pad {inst['twin_pad']})" if inst.get("twin_of") else "")
        lines += [f"### {inst['family']} / {inst['kind']}: {title}", "",
                  "| access | bytes/lane | predicted | measured | ncu ideal | requests | SASS | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in inst["accesses"]:
            lines.append(f"| {r['access']} | {r.get('width', '-')} | {_fmt(r.get('predicted'))} | "
                         f"{_fmt(r.get('measured'))} | {_fmt(r.get('ncu_ideal'))} | {_fmt(r.get('requests'))} | "
                         f"{' '.join(r.get('opcodes', [])) or '-'} | {r['verdict']} |")
        if inst["kernels"] == 0:
            lines.append("| (no kernel of this instance was profiled) | | | | | | | |")
        lines.append("")
    return "\n".join(lines)


# ---- the steps ----------------------------------------------------------------------------

def _nvdisasm(cubin: Path, out: Path) -> None:
    text = subprocess.run(["nvdisasm", "-c", "-gi", str(cubin)], capture_output=True, text=True, check=True).stdout
    out.write_text(text)


def prepare(work: Path, manifest: list) -> dict:
    """Cubins of the representatives (ninja), their unpadded twins (built on first use, with
    their cubins extracted by cuobjdump), and a line table per instance."""
    from attngen import _jit
    from codegen import jit
    work.mkdir(parents=True, exist_ok=True)
    reps = representatives(manifest)
    targets = [f"build/cubin/{r['file'][:-3]}.cubin" for r in reps]
    subprocess.run(["ninja", "-f", "generated/build.ninja", *targets], cwd=ROOT, check=True)
    rows, roots = [], []
    for rep in reps:
        rep = {**rep, "line_table": f"lines_{rep['name']}.txt"}
        _nvdisasm(ROOT / "build" / "cubin" / f"{rep['file'][:-3]}.cubin", work / rep["line_table"])
        rows.append(rep)
        if not needs_twin(rep):
            continue
        plan_ = twin_plan(rep)
        lib = jit.build(plan_, _jit.cache_dir(plan_.inst.arch))
        roots.append(str(lib.parent / "src"))
        _keep_sources(plan_, lib.parent / "src")
        cubins = work / f"cubins_{plan_.inst.name}"
        cubins.mkdir(exist_ok=True)
        subprocess.run(["cuobjdump", "-xelf", "all", str(lib)], cwd=cubins, check=True, capture_output=True)
        text = "\n".join(subprocess.run(["nvdisasm", "-c", "-gi", str(c)], capture_output=True, text=True,
                                        check=True).stdout for c in sorted(cubins.glob("*.cubin")))
        twin = {**as_row(plan_.inst, rep["family"]), "twin_of": rep["name"], "twin_pad": rep["params"]["pad"],
                "op": plan_.spec.op.name, "library": str(lib), "line_table": f"lines_{plan_.inst.name}.txt"}
        (work / twin["line_table"]).write_text(text)
        rows.append(twin)
    plan = {"rows": rows, "source_roots": roots}
    (work / "plan.json").write_text(json.dumps(plan, indent=1, default=str) + "\n")
    return plan


def _keep_sources(plan_, src: Path) -> None:
    """The JIT keeps the library, not always its sources: write them beside it for the tags."""
    for rel, text in plan_.sources.items():
        path = src / rel
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def launch_all(plan: dict) -> None:
    from attngen import _jit
    for row in plan["rows"]:
        if row.get("library"):
            _jit.register(row["op"], Path(row["library"]))
        print(f"launch {row['name']}", flush=True)
        launch(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "bank_check"), help="cubins, line tables, ncu output")
    ap.add_argument("--prepare", action="store_true", help="cubins, unpadded twins and line tables")
    ap.add_argument("--launch", action="store_true", help="launch every planned instance (run this under ncu)")
    ap.add_argument("--summarize", action="store_true", help="join ncu's source page with the line tables")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    work = Path(args.work)
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    if args.prepare:
        plan = prepare(work, manifest)
        print(f"bank_check: {len(plan['rows'])} instances planned ({sum(1 for r in plan['rows'] if r.get('twin_of'))} "
              f"unpadded twins)")
    if args.launch:
        launch_all(json.loads((work / "plan.json").read_text()))
    if args.summarize:
        result = summarize(work, json.loads((work / "plan.json").read_text()))
        meta = {"commit": os.environ.get("ATTNGEN_COMMIT", "?"),
                # the tree whose model judges: named by the caller where .git is stale (the GPU machine's copy)
                "judged_at": os.environ.get("ATTNGEN_MODEL_COMMIT") or subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "?"}
        try:
            import torch
            meta["device"] = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - the table is still useful without the device name
            pass
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bank_check.json").write_text(json.dumps({"meta": meta, **result}, indent=1, default=sorted) + "\n")
        (out / "bank_check.md").write_text(markdown(result, meta))
        print((out / "bank_check.md").read_text())


if __name__ == "__main__":
    main()
