"""Sampling a step's rows in one batch: greedy rows, seeded draws independent of the batch, temperature, top-p."""
import torch

from kvlib.config import SamplingParams
from kvlib.core.sequence import Sequence
from kvlib.runner.sampler import Sampler, draw, top_p_filter


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


def test_a_seeded_draw_is_what_multinomial_draws_from_the_same_stream():
    """The batched sampler replaced a torch.multinomial per row: seeded requests keep their tokens."""
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1))
    seqs = [seq(11, temperature=0.8), seq(12, temperature=1.0, top_p=0.9), seq(13, temperature=1.5)]
    streams = [torch.Generator().manual_seed(s.generator.initial_seed()) for s in seqs]
    expected = []
    for row, (s, stream) in enumerate(zip(seqs, streams)):
        probs = (logits[row] / s.params.temperature).softmax(-1)
        probs = top_p_filter(probs[None], torch.tensor([s.params.top_p]))[0]
        expected.append(int(torch.multinomial(probs, 1, generator=stream)))
    assert Sampler(4, torch.device("cpu")).sample(logits, seqs) == expected


def test_draws_follow_the_tempered_distribution():
    rows = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(rows, 1)
    noise = torch.empty(rows, 4).exponential_(1, generator=torch.Generator().manual_seed(1))
    tokens = draw(logits, torch.full((rows,), 0.5), torch.ones(rows), noise, cut=False)
    frequencies = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(frequencies, (logits[0] / 0.5).softmax(-1), atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.1, 0.5, 0.25, 0.15]])
    cut = top_p_filter(probs, torch.tensor([0.7, 1.0]))
    assert cut[0].tolist() == [0.0, 0.5, 0.25, 0.0]  # 0.5 alone falls short of 0.7; 0.5 + 0.25 reaches it
    assert torch.equal(cut[1], probs[1])  # top_p = 1 leaves the row exactly as it was
