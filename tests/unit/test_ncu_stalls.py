"""bench/ncu_stalls.py reads ncu's per-instruction warp stall samples: sums by reason, by run of
instructions, and the hottest instructions, from a small source page written here."""
from bench import ncu_stalls
from bench.bank_check import parse_source_csv

PAGE = '\n'.join([
    '"Kernel Name","k(Params)",',
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_barrier","stall_wait","stall_barrier (Not Issued)"',
    '"0x7f00","LDS R1, [R2]","10","100","0","10","0"',
    '"0x7f10","@P0 BAR.SYNC 0x0","30","100","30","0","29"',
    '"0x7f20","FFMA R1, R2, R3, R1","5","400","0","5","0"',
    '"0x7f30","EXIT","0","100","0","0","0"',
])


def test_reasons_leave_out_the_not_issued_columns():
    rows = parse_source_csv(PAGE)["k(Params)"]
    assert [r["samples"] for r in rows] == [10, 30, 5, 0]
    assert ncu_stalls.reasons(rows) == {"barrier": 30, "wait": 15}


def test_windows_and_hottest_instructions():
    rows = parse_source_csv(PAGE)["k(Params)"]
    (first, share0, executed0, ops0), (second, share1, _, _) = ncu_stalls.windows(rows, 2)
    assert (first, second) == (0, 2)
    assert abs(share0 - 40 / 45) < 1e-12 and abs(share1 - 5 / 45) < 1e-12 and executed0 == 200
    assert dict(ops0) == {"LDS": 1, "BAR": 1}  # the predicate dropped
    top = ncu_stalls.hottest(rows, 2)
    assert [t[0] for t in top] == [0, 1] and top[1][3][0] == ("barrier", 30)


def test_report_names_the_kernel_and_its_main_reason():
    text = ncu_stalls.report(parse_source_csv(PAGE), "k", 2, 2)
    assert "k(Params): 4 instructions, 45 samples" in text and "barrier 67%" in text
    assert ncu_stalls.report(parse_source_csv(PAGE), "other", 2, 2).strip() == ""


def test_phases_cut_at_barriers_and_count_a_warp_a_pass():
    """Two runs: up to the barrier (LDS, BAR: 100 + 100 executions over 100 passes of the
    barrier = 2 a warp a pass) and after it (FFMA 400, EXIT 100: 5 a pass)."""
    rows = parse_source_csv(PAGE)["k(Params)"]
    (a0, a1, share_a, per_a, ops_a), (b0, b1, share_b, per_b, _) = ncu_stalls.phases(rows)
    assert (a0, a1, b0, b1) == (0, 1, 2, 3)
    assert abs(share_a - 40 / 45) < 1e-12 and abs(share_b - 5 / 45) < 1e-12
    assert (per_a, per_b) == (2.0, 5.0) and dict(ops_a) == {"LDS": 1, "BAR": 1}
    assert "0-1      88.9%  a warp a pass     2.0" in ncu_stalls.report(parse_source_csv(PAGE), "k", 2, 2)
