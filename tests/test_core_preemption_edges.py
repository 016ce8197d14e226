"""The preemption policies on their own: which candidate each picks, and whose cost model decides the mode.

Pins down that the default takes the newest candidate whatever it could give, that the sparing
policy never picks the requester or a candidate with nothing unshared while someone else can give
a block, that it prefers the newest candidate whose unique tail covers the whole shortfall (exactly
covering counts), and that a policy's own cost model outranks the one the engine measured.
"""
import pytest

from kvlib.config import SamplingParams
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionContext, SparingPolicy, VictimCandidate
from kvlib.core.sequence import Sequence


def candidate(arrival: float, unique: int, shared: int = 0, requester: bool = False) -> VictimCandidate:
    seq = Sequence(f"r{arrival}", [1, 2, 3], SamplingParams(), 4, arrival)
    return VictimCandidate(seq, requester, True, unique + shared, unique, shared)


def reference_sparing_choice(candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:
    """The sparing rule read aloud, newest first: a giver covering the shortfall, else any giver, else the requester."""
    newest_first = list(reversed(candidates))
    givers = [c for c in newest_first if not c.is_requester and c.num_unique_tail_blocks > 0]
    for c in givers:
        if c.num_unique_tail_blocks >= shortfall:
            return c
    return givers[0] if givers else next(c for c in candidates if c.is_requester)


def test_a_candidate_arrives_when_its_sequence_did():
    assert candidate(7.5, 1).arrival_time == 7.5


def test_the_default_takes_the_newest_candidate_whatever_it_could_give():
    old, requester, new = candidate(0, 3), candidate(1, 2, requester=True), candidate(2, 0, shared=4)
    assert LatestArrivalPolicy().select_victim([old, requester, new], shortfall=1) is new
    assert LatestArrivalPolicy().select_victim([old, requester], shortfall=9) is requester


def test_sparing_prefers_the_newest_giver_that_covers_the_shortfall():
    requester = candidate(0, 5, requester=True)
    big_old, small_new, big_mid = candidate(1, 3), candidate(3, 1), candidate(2, 3)
    assert SparingPolicy().select_victim([requester, big_old, big_mid, small_new], shortfall=3) is big_mid
    assert SparingPolicy().select_victim([requester, big_old, big_mid, small_new], shortfall=1) is small_new


def test_sparing_takes_the_newest_giver_when_nobody_covers_the_shortfall():
    requester = candidate(0, 5, requester=True)
    one, two = candidate(1, 2), candidate(2, 1)
    assert SparingPolicy().select_victim([requester, one, two], shortfall=3) is two


def test_sparing_never_picks_a_candidate_with_nothing_unshared_while_another_can_give():
    requester = candidate(0, 1, requester=True)
    giver, all_shared = candidate(1, 1), candidate(2, 0, shared=3)
    assert SparingPolicy().select_victim([requester, giver, all_shared], shortfall=1) is giver


def test_sparing_picks_the_requester_only_as_the_last_resort():
    requester = candidate(5, 4, requester=True)  # newest, and it would cover the shortfall
    assert SparingPolicy().select_victim([candidate(1, 0, shared=2), requester], shortfall=2) is requester
    assert SparingPolicy().select_victim([requester], shortfall=1) is requester
    older = candidate(1, 1)
    assert SparingPolicy().select_victim([older, requester], shortfall=4) is older


@pytest.mark.parametrize("tails, shortfall", [
    ((2, 0, 3, 1), 1), ((2, 0, 3, 1), 2), ((2, 0, 3, 1), 3), ((2, 0, 3, 1), 4),
    ((0, 0, 0), 1), ((1, 1, 1), 1), ((4, 2, 4), 4), ((3,), 2),
])
def test_sparing_matches_its_rule_read_aloud(tails, shortfall):
    for at in range(len(tails)):  # the requester anywhere in arrival order
        candidates = [candidate(i, tail, shared=1, requester=i == at) for i, tail in enumerate(tails)]
        assert SparingPolicy().select_victim(candidates, shortfall) is reference_sparing_choice(candidates, shortfall)


class FixedChoice:
    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def choose(self, num_blocks, block_bytes, num_tokens, batch_tokens=1):
        self.asked.append((num_blocks, block_bytes, num_tokens, batch_tokens))
        return self.answer


def test_a_policys_own_cost_model_outranks_the_engines():
    own, measured = FixedChoice("swap"), FixedChoice("recompute")
    context = PreemptionContext(num_blocks=2, num_tokens=8, num_host_blocks=3, block_bytes=64, host_free_blocks=5,
                                cost_model=measured, batch_tokens=4)
    assert LatestArrivalPolicy(own).choose_mode(None, context) == "swap"
    assert own.asked == [(3, 64, 8, 4)] and measured.asked == []  # host blocks a swap fills, not device blocks
    assert LatestArrivalPolicy().choose_mode(None, context) == "recompute"
    assert measured.asked == [(3, 64, 8, 4)]


def test_a_mode_given_for_a_cost_model_is_refused_with_where_the_mode_belongs():
    with pytest.raises(TypeError, match=r"^LatestArrivalPolicy takes a cost model, not a mode \('swap'\): "
                                        r"the mode is EngineConfig.preemption_mode$"):
        LatestArrivalPolicy("swap")
    with pytest.raises(TypeError, match=r"^SparingPolicy takes a cost model"):
        SparingPolicy("recompute")
    assert LatestArrivalPolicy().cost_model is None
