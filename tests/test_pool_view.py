"""The block-pool view records what the engine holds after every step, and draws it."""
from collections import Counter

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.course.pool_view import CACHED, FREE, SHARED, PoolRecorder, save, show


def test_snapshots_match_the_pools_and_the_moves(checkpoint, tmp_path):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=14, num_cpu_blocks=16, watermark=0.0,
                                                    preemption_mode="swap", enable_prefix_caching=True), verbose=False)
    recorder = PoolRecorder(llm)
    system = list(range(10, 26))
    llm.generate([system + [i] for i in range(3)], SamplingParams(max_tokens=12, n=2))
    snapshots = recorder.snapshots
    assert len(snapshots) == llm.metrics.num_steps + 1 and snapshots[0].device == [(FREE, 0)] * 14
    for snap, record in zip(snapshots[1:], llm.metrics.timeline):
        assert sum(1 for owner, refs in snap.device if owner != FREE) == record.gpu_blocks_used
        assert all((refs == 0) == (owner == FREE) for owner, refs in snap.device + snap.host)
    owners = Counter(owner for snap in snapshots for owner, _ in snap.device)
    assert owners[CACHED]  # a finished prefix stays cached
    assert any(snap.moves.get("out") for snap in snapshots) and any(snap.moves.get("copy") for snap in snapshots)
    assert snapshots[-1].device.count((FREE, 0)) + sum(1 for o, _ in snapshots[-1].device if o == CACHED) == 14
    recorder.snapshots = snapshots[::4]  # a shorter animation draws faster
    strip, gif = save(recorder, str(tmp_path / "strip.png")), save(recorder, str(tmp_path / "pool.gif"))
    assert (tmp_path / "strip.png").stat().st_size > 10_000 and (tmp_path / "pool.gif").stat().st_size > 10_000
    assert "<script" in show(recorder).data and strip and gif
