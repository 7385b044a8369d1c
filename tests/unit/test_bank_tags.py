"""The bank model and the templates cannot drift apart: every shared-memory access a template
makes carries a `// smem: <access>` tag and every buffer a `// smem buffer: <name>` tag, and
each instance's model (its lowering's `bank` record) declares exactly the accesses and buffers
its source tags. The hardware check (bench/bank_check.py) then holds each tagged access to the
model's wavefronts."""
import re
from pathlib import Path

import pytest

from codegen import pipeline
from codegen.passes import banks

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "generated"
INCLUDE = re.compile(r'#include "([^"]+)"')


@pytest.fixture(scope="module")
def manifest():
    import json
    return json.loads((GENERATED / "manifest.json").read_text())


def sources(path: Path, seen=None) -> dict:
    """The TU and the generated headers it includes (transitively): {path: text}."""
    seen = {} if seen is None else seen
    if path in seen or not path.is_file():
        return seen
    seen[path] = path.read_text()
    for rel in INCLUDE.findall(seen[path]):
        sources((path.parent / rel).resolve(), seen)
    return seen


def test_every_instance_tags_what_its_model_declares(manifest):
    checked = 0
    for row in manifest:
        bank = row["derived"].get("bank", {})
        tu = (GENERATED / row["file"]).resolve()
        texts = sources(tu)
        own = set(banks.tags(texts[tu]).values())
        anywhere = {tag for text in texts.values() for tag in banks.tags(text).values()}
        buffers = set(banks.tags(texts[tu], banks.BUFFER_TAG).values())
        declared_buffers = {b for r in bank.values() for b in r["buffers"]}
        assert own <= set(bank), f"{row['name']}: tagged in the template but not in the model: {own - set(bank)}"
        assert set(bank) <= anywhere, f"{row['name']}: declared but tagged nowhere: {set(bank) - anywhere}"
        assert buffers == declared_buffers, (f"{row['name']}: buffers tagged {sorted(buffers)}, "
                                             f"declared {sorted(declared_buffers)}")
        checked += 1
    assert checked == len(manifest) > 600


def test_header_tags_are_declared_by_the_instances_that_include_them(manifest):
    """A tag in a shared header (flash attention's load_rows, say) names the access in every
    instance that includes it and calls it; at least one instance must declare it."""
    declared = {}
    for row in manifest:
        tu = (GENERATED / row["file"]).resolve()
        for path in sources(tu):
            if path != tu:
                declared.setdefault(path, set()).update(row["derived"].get("bank", {}))
    assert declared
    for path, names in declared.items():
        undeclared = set(banks.tags(path.read_text()).values()) - names
        assert not undeclared, f"{path.relative_to(ROOT)}: tags {undeclared} no including instance declares"


def test_the_record_holds_what_the_report_and_the_check_read():
    (spec, insts), *_ = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "causal_linear"]
    inst = next(i for i in insts if i.kind == "lmha" and i.p["e"] == 64 and i.a["dtype"] == "fp32")
    bank = inst.d["bank"]
    assert set(bank["o_write"]) == {"buffers", "width", "wavefronts", "ideal", "unpadded", "worst"}
    # the padding the pass chose removes the 2-way conflict of the unpadded output tile...
    assert bank["o_write"]["wavefronts"] == 1 and bank["o_write"]["unpadded"] == 2
    # ...and the worst padding it could have chosen is no better than none
    assert bank["o_write"]["worst"] >= bank["o_write"]["unpadded"]
    assert banks.ways(bank)["qk_read"] <= 1
