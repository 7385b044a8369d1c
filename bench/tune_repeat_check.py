"""Does a second tuning run pick the same winners? For every bucket whose top two candidates
differ by more than their spread, the winner must repeat: python -m bench.tune_repeat_check A.json B.json"""
import json
import sys

from codegen.tune.select import NOISE_FLOOR


def winners(path):
    rows = json.load(open(path))["rows"]
    out = {}
    for r in rows:
        ms = sorted((m for m in r["measurements"] if m["median_ms"] != float("inf")), key=lambda m: m["median_ms"])
        noise = [max(m["spread_ms"], NOISE_FLOOR * m["median_ms"]) for m in ms[:2]]
        clear = len(ms) > 1 and ms[1]["median_ms"] - ms[0]["median_ms"] > max(noise)
        out[(r["bucket"], r["dtype"])] = (r["winner"], clear)
    return out


def main():
    a, b = winners(sys.argv[1]), winners(sys.argv[2])
    print("| bucket | dtype | first run | second run | clear margin | same |\n|---|---|---|---|---|---|")
    bad = 0
    for key in a:
        same = a[key][0] == b.get(key, (None,))[0]
        bad += a[key][1] and not same
        print(f"| {key[0]} | {key[1]} | `{a[key][0]}` | `{b.get(key, ('-',))[0]}` | {a[key][1]} | {same} |")
    print(f"\n{bad} bucket(s) with a clear margin changed winner")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
