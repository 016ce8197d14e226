"""Sampling a step's rows in one batch: greedy rows, seeded draws independent of the batch, temperature, top-p."""
import torch

from kvlib.config import SamplingParams
from kvlib.core.sequence import Sequence
from kvlib.runner.sampler import Sampler, draw, tempered, top_p_filter


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


def test_top_p_of_one_keeps_a_tail_that_starts_where_the_head_sums_to_one():
    """float32 sums the two heads of this row to exactly 1.0 before its tail: ``top_p = 1`` must still keep the
    tail, so a limit of 1.0 (instead of none) would change the row."""
    probs = torch.tensor([[0.5, 0.5, 1e-9, 1e-9]])
    assert torch.equal(top_p_filter(probs, torch.tensor([1.0])), probs)


def test_a_cut_row_beside_greedy_rows_draws_only_from_its_nucleus():
    """Whether any row needs the top-p cut is decided from the drawn rows; greedy rows beside them change nothing."""
    logits = torch.linspace(1.0, 0.0, 10).repeat(2, 1)  # nearly flat: without the cut every token turns up
    nucleus = top_p_filter(logits[1:].softmax(-1), torch.tensor([0.3]))[0].nonzero().flatten().tolist()
    sampler, drawn = Sampler(2, torch.device("cpu")), set()
    for seed in range(60):
        greedy_token, token = sampler.sample(logits, [seq(), seq(seed, temperature=1.0, top_p=0.3)])
        assert greedy_token == 0
        drawn.add(token)
    assert drawn == set(nucleus) and len(nucleus) < 10


def test_a_row_below_the_batchs_maximum_keeps_its_top_token_at_the_smallest_temperature():
    """The overflowing row is shifted by its own maximum: the batch's maximum (another row's) would send all of
    it to -inf and its softmax to NaN."""
    logits = torch.tensor([[0.0, 50.0, 49.0], [0.0, 100.0, 0.0]])  # by its column's maximum, token 1 would lose
    seqs = [seq(1, temperature=1e-37), seq(2, temperature=1.0)]
    assert Sampler(2, torch.device("cpu")).sample(logits, seqs)[0] == 1


def test_top_p_stops_at_the_token_that_reaches_it_exactly_and_always_keeps_the_top_token():
    probs = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25]])
    cut = top_p_filter(probs, torch.tensor([0.5, 0.0]))
    assert cut[0].tolist() == [0.0, 0.5, 0.0]  # 0.5 reaches 0.5: the next token is not needed
    assert cut[1].tolist() == [0.0, 0.5, 0.0]  # a top_p of 0 still leaves one token to draw


def test_only_a_row_that_overflows_is_shifted():
    """A row whose quotient stays finite is divided as it is, bit for bit, whatever its neighbours do."""
    logits = torch.tensor([[0.0, 50.0, 49.0], [0.3, 1.7, -2.1]])
    temperature = torch.tensor([1e-37, 0.7])
    assert torch.equal(tempered(logits, temperature)[1], logits[1] / temperature[1])
