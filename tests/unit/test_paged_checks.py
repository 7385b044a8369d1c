"""paged_decode's Python wrapper (attngen/paged.py) without a GPU: eagerly the op's own checks run
first and the Python ones, whose messages name the caller's layout, only when the op raises; the
op receives the NHD views of an HND cache either way. Meta tensors pass the device checks; the op
itself is replaced here by a recorder."""
import pytest
import torch

from attngen import paged


def case(layout="NHD", bt_dtype=torch.int32):
    meta = {"device": "meta"}
    q = torch.empty(2, 4, 64, dtype=torch.bfloat16, **meta)
    shape = (10, 16, 2, 64) if layout == "NHD" else (10, 2, 16, 64)
    k, v = (torch.empty(shape, dtype=torch.bfloat16, **meta) for _ in range(2))
    return q, k, v, torch.empty(2, 5, dtype=bt_dtype, **meta), torch.empty(2, dtype=torch.int32, **meta)


class Recorder:
    def __init__(self, error=None):
        self.calls, self.error = [], error

    def __call__(self, *args):
        self.calls.append(args)
        if self.error is not None:
            raise self.error
        return "out"


def test_good_input_goes_straight_to_the_op_with_nhd_views(monkeypatch):
    op = Recorder()
    monkeypatch.setattr(paged, "OP", op)
    q, k, v, bt, lens = case("HND")
    assert paged.paged_decode(q, k, v, bt, lens, kv_layout="HND") == "out"
    (args,) = op.calls
    assert args[1].shape == (10, 16, 2, 64) and args[2].shape == (10, 16, 2, 64)   # [blocks, block_size, Hkv, D]
    assert args[5] == pytest.approx(64 ** -0.5) and args[7] == 0.0


def test_when_the_op_raises_the_python_checks_name_the_problem(monkeypatch):
    monkeypatch.setattr(paged, "OP", Recorder(ValueError("paged_decode: block_table must be int32 (as viewed)")))
    with pytest.raises(ValueError, match=r"block_table must be int32 \[S=2, max_blocks\], got torch.int64"):
        paged.paged_decode(*case(bt_dtype=torch.int64))


def test_an_error_the_python_checks_do_not_see_is_the_ops(monkeypatch):
    monkeypatch.setattr(paged, "OP", Recorder(ValueError("paged_decode: unsupported head size or layout: D=64")))
    with pytest.raises(ValueError, match="unsupported head size or layout"):
        paged.paged_decode(*case())


def test_a_bad_layout_name_is_refused_before_the_op(monkeypatch):
    op = Recorder()
    monkeypatch.setattr(paged, "OP", op)
    with pytest.raises(ValueError, match=r"kv_layout must be one of \('NHD', 'HND'\), got 'NDH'"):
        paged.paged_decode(*case(), kv_layout="NDH")
    assert op.calls == []
