"""Sampling a step's rows in one batch: greedy rows, seeded draws independent of the batch, temperature, top-p."""
import torch

from kvlib.config import SamplingParams
from kvlib.sampler import Sampler, draw
from kvlib.sequence import Sequence


def seq(seed=0, **params) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(**params), block_size=4, arrival_time=0.0, seed=seed)


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    assert Sampler(4, torch.device("cpu")).sample(logits, [seq(), seq()]) == [1, 0]


def test_a_seeded_draw_does_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    alone = Sampler(8, torch.device("cpu")).sample(logits[2:3], [seq(7, temperature=1.0)])
    others = [seq(1, temperature=0.7), seq(), seq(7, temperature=1.0), seq(3, temperature=1.3, top_p=0.5), seq()]
    batched = Sampler(8, torch.device("cpu")).sample(logits, others)
    assert batched[2] == alone[0]
    assert batched[1] == int(logits[1].argmax()) and batched[4] == int(logits[4].argmax())


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20_000, 1)
    temperature = torch.full((20_000,), 0.5)
    uniform = torch.rand(20_000, generator=torch.Generator().manual_seed(1))
    tokens = draw(logits, temperature, torch.ones(20_000), uniform, cut=False)
    frequencies = torch.bincount(tokens, minlength=4).float() / 20_000
    torch.testing.assert_close(frequencies, (logits[0] / 0.5).softmax(-1), atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]])).repeat(2000, 1)
    uniform = torch.rand(2000, generator=torch.Generator().manual_seed(2))
    tokens = draw(logits, torch.ones(2000), torch.full((2000,), 0.7), uniform, cut=True)
    assert set(tokens.tolist()) == {1, 2}  # 0.5 alone falls short of 0.7; 0.5 + 0.25 reaches it
    share = (tokens == 1).float().mean()
    assert abs(share - 0.5 / 0.75) < 0.04
