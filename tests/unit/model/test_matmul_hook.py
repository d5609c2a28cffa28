"""model/matmul.py: the small-batch kernel hook takes over exactly the products it should."""

from __future__ import annotations

import threading

import torch

from ouro_cli.model import matmul


def test_small_batch_hook_routes_only_small_inputs_of_its_own_thread():
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    calls = []

    def kernel(a, b):
        calls.append(tuple(a.shape))
        return 2 * (a @ b.T)  # visibly not F.linear

    plain = torch.nn.functional.linear(x, w)
    with matmul.use_small_batch(kernel, max_rows=6):
        assert torch.equal(matmul.linear(x, w), 2 * plain)  # 6 rows, flattened to [6, 4] and back
        assert torch.equal(matmul.linear(torch.ones(7, 4), w), torch.ones(7, 4) @ w.T)  # too many rows
        other = []
        thread = threading.Thread(target=lambda: other.append(matmul.linear(x, w)))
        thread.start()
        thread.join()
        assert torch.equal(other[0], plain)  # another thread keeps F.linear
        with matmul.use_small_batch(None, max_rows=6):  # None leaves the installed kernel in place
            matmul.linear(x, w)
    assert calls == [(6, 4), (6, 4)]
    assert torch.equal(matmul.linear(x, w), plain)  # uninstalled on exit
