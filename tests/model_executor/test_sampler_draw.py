"""sampler.draw_rows: a draw from each row's distribution by its own generator (inverse CDF)."""

import torch

from roofline.model_executor.layers.sampler import draw_rows


def test_draws_follow_each_rows_distribution():
    """Frequencies over many draws match p (unnormalized rows, zeros included) within 5 sigma, and a
    token of zero probability is never drawn."""
    p = torch.tensor([[0.0, 1.0, 2.0, 0.0, 5.0, 2.0], [3.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    n = 20000
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    counts = torch.zeros_like(p)
    for _ in range(n):
        t = draw_rows(p, gens)
        counts[0, t[0]] += 1
        counts[1, t[1]] += 1
    want = p / p.sum(-1, keepdim=True)
    freq = counts / n
    assert torch.all(counts[p == 0] == 0)
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)


def test_a_row_depends_only_on_its_generator():
    """Seeded reproducibility: a row's draws are the same whatever rows share the batch."""
    torch.manual_seed(0)
    p = torch.rand(3, 1000) ** 4
    alone = draw_rows(p[1:2], [torch.Generator().manual_seed(7)]).item()
    g = [torch.Generator().manual_seed(s) for s in (5, 7, 9)]
    assert draw_rows(p, g)[1].item() == alone
    g2 = torch.Generator().manual_seed(7)
    seq_a = [draw_rows(p[1:2], [g2]).item() for _ in range(5)]
    g3 = torch.Generator().manual_seed(7)
    seq_b = [draw_rows(p, [torch.Generator().manual_seed(1), g3, torch.Generator().manual_seed(2)])[1].item()
             for _ in range(5)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_a_uniform_at_the_top_draws_the_last_likely_token():
    """The largest uniform below 1 still lands on a token of nonzero probability, never past the end."""
    p = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.1, 0.3, 0.0, 0.2]])
    top = torch.tensor(1.0 - 2.0 ** -53, dtype=torch.float64)
    orig = torch.rand
    try:
        torch.rand = lambda *a, **k: top
        assert draw_rows(p, [torch.Generator(), torch.Generator()]).tolist() == [1, 3]
    finally:
        torch.rand = orig
