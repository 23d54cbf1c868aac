"""The DDP consistency metric's moments (``_delta_moments``), vectorised over clients, against the
per-client float64 loop they replace."""

import torch

from fl_lightning.executors.distributed import _delta_moments


def test_delta_moments_equal_the_per_client_float64_sums():
    gen = torch.Generator().manual_seed(0)
    like = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    deltas = [{k: torch.randn(v.shape, generator=gen) for k, v in like.items()} for _ in range(9)]
    total, squares = _delta_moments(deltas, like)
    for k in like:
        reference = sum(d[k].double() for d in deltas)
        assert total[k].dtype == torch.float64
        torch.testing.assert_close(total[k], reference, rtol=1e-12, atol=1e-12)
    reference_sq = sum(float(torch.dot(v.double().reshape(-1), v.double().reshape(-1))) for d in deltas for v in d.values())
    assert abs(squares - reference_sq) <= 1e-12 * reference_sq
    empty_total, empty_sq = _delta_moments([], like)
    assert empty_sq == 0.0 and all(torch.equal(empty_total[k], torch.zeros(like[k].shape, dtype=torch.float64)) for k in like)
