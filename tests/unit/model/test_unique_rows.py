"""model/unique_rows.py: gathers and scatters of rows named once, forward and backward through
gathers, give index_select's and index_copy's values and gradients exactly."""

import torch

from ouro_cli.model import unique_rows


def _operands(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(12, 3, 5, generator=g).to(dtype)
    index = torch.tensor([7, 0, 3, 11, 5])  # unique, in no order
    src = torch.randn(len(index), 3, 5, generator=g).to(dtype)
    grad = torch.randn(12, 3, 5, generator=g).to(dtype)
    return base, index, src, grad


def test_inverse_maps_each_named_row_to_its_place():
    _, index, _, _ = _operands(torch.float32)
    inverse = unique_rows.inverse_of(index, 12)
    assert inverse.tolist() == [1, -1, -1, 2, -1, 4, -1, 0, -1, -1, -1, 3]


def test_put_is_index_copy_with_its_gradients():
    for dtype in (torch.float32, torch.bfloat16):
        base, index, src, grad = _operands(dtype)
        inverse = unique_rows.inverse_of(index, 12)
        mine = [x.clone().requires_grad_() for x in (base, src)]
        ref = [x.clone().requires_grad_() for x in (base, src)]
        out = unique_rows.put(mine[0], index, inverse, mine[1])
        want = ref[0].index_copy(0, index, ref[1])
        assert torch.equal(out, want)
        got = torch.autograd.grad(out, mine, grad)
        expected = torch.autograd.grad(want, ref, grad)
        assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))


def test_take_is_index_select_with_its_gradient_along_either_dim():
    for dtype in (torch.float32, torch.bfloat16):
        base, index, _, _ = _operands(dtype)
        inverse = unique_rows.inverse_of(index, 12)
        for dim, x in ((0, base), (1, base.transpose(0, 1).contiguous())):
            leaf, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
            out = unique_rows.take(leaf, index, inverse, dim=dim)
            want = ref.index_select(dim, index)
            assert torch.equal(out, want)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(dim)).to(dtype)
            assert torch.equal(torch.autograd.grad(out, leaf, grad)[0], torch.autograd.grad(want, ref, grad)[0])


def test_gradcheck_in_fp64():
    base, index, src, _ = _operands(torch.float64)
    inverse = unique_rows.inverse_of(index, 12)
    base, src = base.requires_grad_(), src.requires_grad_()
    assert torch.autograd.gradcheck(lambda b, s: unique_rows.put(b, index, inverse, s), (base, src))
    across = base.detach().transpose(0, 1).contiguous().requires_grad_()
    assert torch.autograd.gradcheck(lambda b: unique_rows.take(b, index, inverse, dim=1), (across,))


def test_a_compiled_region_runs_them_without_a_scatter():
    """Inside torch.compile, under deterministic algorithms (the trainer's CUDA step), forward
    and backward make no index_put: inductor runs the gathers itself. index_copy falls back to
    the eager scatter there, which CUDA runs through a sort. (tests/gpu/test_model_gpu.py runs
    this on CUDA.)"""
    check_no_scatter_when_compiled("cpu")


def check_no_scatter_when_compiled(device: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    base, index, src, grad = (t.to(device) for t in _operands(torch.float32))
    inverse = unique_rows.inverse_of(index, 12)

    def scatters(fn):
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        leaves = [x.clone().requires_grad_() for x in (base, src)]
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            compiled(*leaves).backward(grad)  # compiles
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                compiled(*leaves).backward(grad)
        finally:
            torch.use_deterministic_algorithms(before)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::index_put_")

    ours = scatters(lambda b, s: unique_rows.put(b, index, inverse, s) * 2)
    plain = scatters(lambda b, s: b.index_copy(0, index, s) * 2)
    assert ours == 0 and plain > 0, (ours, plain)
