"""Some families built ahead of their first use: the extension's bindings (the core) and every
instance of those families' tables, compiled in parallel into the first-use cache, each recorded
under its row's name. A GPU machine without `make build` then runs those families' ops, tests
and benchmarks (forced instances included) with no compile on first use, in a fraction of the
full build's time (the delta-rule families are 81 of the 852 instances).

  python -m attngen.prebuild delta_rule delta_rule_grad gated_delta_grad [-j 16]

The cache is the runtime's ($ATTNGEN_CACHE or its default); a prebuilt extension
(build/lib/attngen_ext.so) is loaded before the cache, so this is for a checkout without one.
"""
from __future__ import annotations

import argparse
import sys
import time

from . import _jit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attngen.prebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="+", help="spec families (the `family:` of specs/*.yaml)")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="compiles at a time (default: every core)")
    args = parser.parse_args(argv)
    reasons = _jit.cannot_build()
    if reasons:
        raise SystemExit(f"attngen.prebuild: nothing can be built here: {'; '.join(reasons)}")
    core = _jit._generator("core")
    started = time.monotonic()
    done = []

    def on_row(plan, library):
        done.append(library)
        print(f"attngen.prebuild: {len(done)} {plan.inst.name} ({library.parent.name})", file=sys.stderr, flush=True)

    try:
        libraries = core.prebuild(_jit.cache_root(), _jit.toolchain_tag(), args.families, _jit.cache_dir,
                                  jobs=args.jobs, on_row=on_row)
    except ValueError as exc:
        raise SystemExit(f"attngen.prebuild: {exc}") from None
    print(f"attngen.prebuild: {' '.join(args.families)}: {len(libraries)} instances and the bindings in "
          f"{_jit.cache_root()} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
