"""bench.ab_table: an A/B call's per-kernel listings side by side, in the order the sides ran,
short kernel names, the last side over the first, tiny kernels left out, and nothing printed
where no side holds a listing."""
from bench import ab_table

LISTING = """attngen: built something in 4 s
B8 T4096 H64 K=V=64, bf16, forward + backward, per call:
     {grad} ms  1 x  attngen::delta_rule_grad::(anonymous namespace)::grad_kernel(attngen::delta_rule_grad::Par
     {fwd} ms  1 x  attngen::delta_rule::(anonymous namespace)::chunk_kernel(attngen::delta_rule::Params)
     0.001 ms  1 x  Memset (Device)
"""


def write(root, side, grad, fwd):
    folder = root / f"ab_{side}"
    folder.mkdir()
    (folder / "profile.txt").write_text(LISTING.format(grad=grad, fwd=fwd))


def test_sides_in_run_order_with_the_ratio(tmp_path):
    write(tmp_path, "after", "5.000", "2.500")
    write(tmp_path, "before", "6.000", "3.000")
    write(tmp_path, "after_1", "5.500", "2.750")
    lines = ab_table.table(tmp_path).splitlines()
    assert lines[0] == "| shape | kernel | before | after_1 | after | after / before |"
    assert lines[2] == ("| B8 T4096 H64 K=V=64, bf16, forward + backward | `attngen::delta_rule_grad::grad_kernel` "
                        "| 6.000 ms | 5.500 ms | 5.000 ms | 0.833 |")
    assert "`attngen::delta_rule::chunk_kernel` | 3.000 ms | 2.750 ms | 2.500 ms | 0.833 |" in lines[3]
    assert len(lines) == 4  # the memset (0.001 ms) is left out


def test_nothing_without_listings(tmp_path):
    (tmp_path / "ab_before").mkdir()
    (tmp_path / "ab_before" / "bench.txt").write_text("some other benchmark's output\n")
    assert ab_table.table(tmp_path) == ""


def test_a_trailing_rate_is_not_part_of_the_kernel(tmp_path):
    """bench.flash_grad_profile prints each backward kernel's TFLOP/s after its name: the sides'
    rows still join on the kernel."""
    for side, ms, rate in (("before", "3.931", 524), ("after", "3.704", 557)):
        (tmp_path / f"ab_{side}").mkdir()
        (tmp_path / f"ab_{side}" / "profile.txt").write_text(
            "B4 H24 N4096 D128 full, bf16, backward per call:\n"
            f"     {ms} ms  1 x  void attngen::flash_attention_grad::(anonymous namespace)::backward_kernel<false     {rate} TFLOP/s\n")
    lines = ab_table.table(tmp_path).splitlines()
    assert len(lines) == 3
    assert lines[2].endswith("| 3.931 ms | 3.704 ms | 0.942 |") and "TFLOP" not in lines[2]


def test_a_listing_in_the_sides_step_log_counts(tmp_path):
    """AB_CMD's stdout lands in r/ab_<side>.log beside the side's folder: a profile that prints
    its listing (bench.flash_grad_profile) is read from there."""
    for side, grad in (("before", "6.000"), ("after", "5.000")):
        (tmp_path / f"ab_{side}").mkdir()
        (tmp_path / f"ab_{side}.log").write_text(LISTING.format(grad=grad, fwd="2.000"))
    lines = ab_table.table(tmp_path).splitlines()
    assert lines[2].endswith("| 6.000 ms | 5.000 ms | 0.833 |")
