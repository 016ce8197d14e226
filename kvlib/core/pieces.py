"""The pieces a learner may replace, and the one place the engine's core is built from them.

``LLM(...)``, ``LLMEngine(...)`` and the model-free driver take the same keyword arguments, one
per piece; :meth:`Pieces.from_keywords` turns them into a :class:`Pieces`, and
:func:`build_core` builds the block manager and the scheduler from the config and those pieces,
refusing, before anything runs, a piece that lacks part of its protocol (``kvlib/interfaces.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvlib import interfaces
from kvlib.config import EngineConfig
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.block_manager import BlockManager
from kvlib.core.oversubscription import OversubscriptionDetector
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionCostModel
from kvlib.core.prefix_cache import HostPrefixTier
from kvlib.core.scheduler import Scheduler
from kvlib.core.sharing import BlockSharing


BUILT_BY_THE_CORE = {"allocator": "a class or factory, called with a pool's block count",
                     "scheduler": "a Scheduler subclass", "block_manager": "a BlockManager subclass",
                     "host_prefix_tier": "a class or factory, called with the host pool's allocator"}
PASSED_BUILT = ("preemption_policy", "attention_backend", "block_sharing", "oversubscription_detector")


@dataclass(frozen=True)
class Pieces:
    """Your own pieces in place of kvlib's; None keeps kvlib's own. Each one's contract is a protocol
    in ``kvlib/interfaces.py``."""

    allocator: Optional[Callable] = None  # a class or factory, called with a pool's block count
    preemption_policy: Any = None
    attention_backend: Any = None  # chosen for the device when None (the engine's, not the core's)
    block_sharing: Any = None
    oversubscription_detector: Any = None
    scheduler: Optional[type] = None  # a Scheduler subclass, built with the engine's own arguments
    block_manager: Optional[type] = None  # a BlockManager subclass, built with the engine's own arguments
    host_prefix_tier: Optional[Callable] = None  # called with the host pool's allocator

    def __post_init__(self) -> None:
        """The pieces the core builds for itself come as what builds them; the others come built."""
        for name, what in BUILT_BY_THE_CORE.items():
            piece = getattr(self, name)
            if piece is not None and not callable(piece):
                kind = type(piece).__name__
                raise TypeError(f"{name} must be {what}, got an instance of {kind}; the engine builds its own, so "
                                f"pass the class itself ({name}={kind})")
        for name in PASSED_BUILT:
            piece = getattr(self, name)
            if isinstance(piece, type):
                raise TypeError(f"{name} must be an object, got the class {piece.__name__}; pass an instance "
                                f"({name}={piece.__name__}())")

    @classmethod
    def from_keywords(cls, **pieces) -> "Pieces":
        """The pieces passed as keyword arguments; a misspelt one is named, with the names there are."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(pieces) - set(names))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}: the pieces you can pass are "
                            f"{', '.join(names)} (kvlib.core.pieces.Pieces)")
        return cls(**pieces)

    def with_defaults(self, config: EngineConfig) -> "Pieces":
        """Every piece left out replaced by kvlib's own (but the attention backend, chosen for the device);
        a preemption policy that conflicts with ``config.preemption_mode`` is refused now."""
        policy = self.preemption_policy or LatestArrivalPolicy()
        interfaces.check_preemption_policy(policy, config.preemption_mode)
        return dataclasses.replace(
            self, allocator=self.allocator or BlockAllocator, preemption_policy=policy,
            block_sharing=self.block_sharing or BlockSharing(),
            oversubscription_detector=self.oversubscription_detector or OversubscriptionDetector(),
            scheduler=self.scheduler or Scheduler, block_manager=self.block_manager or BlockManager,
            host_prefix_tier=self.host_prefix_tier or HostPrefixTier)


def build_core(config: EngineConfig, pieces: Pieces, *, num_device_blocks: int, block_bytes: int,
               eos_token_ids: frozenset[int] = frozenset(), max_model_len: Optional[int] = None,
               cost_model: Optional[PreemptionCostModel] = None) -> tuple[BlockManager, Scheduler]:
    """The block manager over pools of ``num_device_blocks`` and ``config.num_cpu_blocks`` blocks, and the
    scheduler that asks it, from ``pieces`` (with their defaults filled in)."""
    block_manager = pieces.block_manager(
        config.block_size, pieces.allocator(num_device_blocks), pieces.allocator(config.num_cpu_blocks),
        watermark_blocks=int(config.watermark * num_device_blocks), enable_prefix_caching=config.enable_prefix_caching,
        host_prefix_cache=config.host_prefix_cache, sharing=pieces.block_sharing,
        host_tier_factory=pieces.host_prefix_tier)
    scheduler = pieces.scheduler(config, block_manager, pieces.preemption_policy, block_bytes=block_bytes,
                                 eos_token_ids=eos_token_ids, max_model_len=max_model_len, cost_model=cost_model)
    _check_core(block_manager, scheduler, pieces)
    return block_manager, scheduler


def _check_core(bm: BlockManager, scheduler: Scheduler, pieces: Pieces) -> None:
    """Every piece has the whole of its protocol: said now, not mid-step."""
    checks = [(bm.device_pool, interfaces.BlockAllocator, "allocator"), (bm.host_pool, interfaces.BlockAllocator, "allocator"),
              (bm.sharing, interfaces.BlockSharing, "block_sharing"),
              (pieces.oversubscription_detector, interfaces.OversubscriptionDetector, "oversubscription_detector"),
              (scheduler, interfaces.SchedulingStep, "scheduler"),
              (bm, interfaces.PreemptionMechanism, "block_manager")]
    if bm.host_tier is not None:
        checks.append((bm.host_tier, interfaces.HostPrefixTier, "host_prefix_tier"))
    for piece, protocol, argument in checks:
        interfaces.check_implements(piece, protocol, argument)
