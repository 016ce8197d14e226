"""The contracts of every piece you can replace: pass your own object to ``LLM(...)``.

Each protocol says what an implementation may do, what must stay true, and what the engine
guarantees in return. The engine checks what it can when it is built (a missing method, a policy
that conflicts with the configuration) and after every step in tests
(:func:`kvlib.core.invariants.check_invariants`); whatever a plugged-in piece decides, the block
bookkeeping it is handed is consistent, and outputs stay token-for-token correct as long as the
piece keeps its contract.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from kvlib.attention.capabilities import BackendCapabilities
from kvlib.attention.metadata import AttentionMetadata
from kvlib.core.block_allocator import AllocStatus
from kvlib.core.preemption import PreemptionContext, PreemptionCostModel, VictimCandidate
from kvlib.metrics import EngineMetrics


@runtime_checkable
class BlockAllocator(Protocol):
    """One pool's block ids ``0 .. num_blocks-1``: a free list and reference counts (``LLM(allocator=cls)``,
    called once per pool with its block count).

    May: hand out free blocks in any order. Must keep true: ``num_free + num_used == num_blocks``;
    a block is free exactly when its reference count is 0; ``allocate`` returns a free block with
    count 1; ``fork`` adds one owner to an owned block; ``free`` removes one and returns the block
    to the free list at 0; misuse (double free, an id out of range, an empty pool) raises
    :class:`kvlib.core.block_allocator.BlockAllocatorError`. The engine guarantees: it asks
    ``can_allocate`` before allocating, counts every owner (sequences and the prefix cache), and
    never frees what it did not allocate or fork.
    """

    num_blocks: int

    @property
    def num_free(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    def ref_count(self, block_id: int) -> int: ...

    def can_allocate(self, num_blocks: int, watermark_blocks: int = 0) -> AllocStatus:
        """OK: ``num_blocks`` are free with ``watermark_blocks`` to spare; NEVER: more than the pool
        minus the watermark; LATER: otherwise."""

    def allocate(self) -> int: ...

    def fork(self, block_id: int) -> int: ...

    def free(self, block_id: int) -> None: ...


@runtime_checkable
class PreemptionPolicy(Protocol):
    """Who gives up device blocks when a running sequence cannot grow, and how (``LLM(preemption_policy=...)``).

    ``select_victim`` gets the candidates, oldest arrival first: the requester (``is_requester``,
    the running sequence that needs ``shortfall`` more blocks), running sequences not yet scheduled
    this step, and paused sequences still holding blocks of their own. It must return one of them;
    the engine takes the victim's blocks (only its unique tail, no more than the shortfall, with
    partial preemption) and asks again until the requester fits or was itself the victim.

    ``choose_mode`` is asked for each victim only with ``preemption_mode="auto"`` and returns
    ``"swap"`` or ``"recompute"``; ``EngineConfig.preemption_mode`` alone decides otherwise. In auto
    mode the engine prices both with ``cost_model``, or, where it is None, with one it measures at
    start-up (``PreemptionContext.cost_model`` hands it to ``choose_mode``). The
    engine guarantees that a swap without room on the host recomputes instead (counted in
    ``metrics.num_swap_fallbacks``) and that no choice changes a single output token.
    """

    cost_model: Optional[PreemptionCostModel]

    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate: ...

    def choose_mode(self, victim: VictimCandidate, context: PreemptionContext) -> str: ...


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the paged KV cache (``LLM(attention_backend=...)``).

    For each layer of a step, ``store_kv`` writes the step's new keys and values into their slots
    (``meta.slot_mapping``), then ``forward`` returns attention of the packed queries over each
    sequence's cached context, causally (see :class:`AttentionMetadata`). ``copy_blocks`` copies
    block ``src_ids[i]`` onto ``dst_ids[i]`` of one pool tensor, all layers, K and V. Must keep
    true: ``forward`` reads only through the block tables, never writes the cache. The engine
    guarantees that no copy destination is also a source or appears twice.

    ``capabilities`` (a :class:`~kvlib.attention.capabilities.BackendCapabilities`) says what start-up
    may do with the backend: whether decode steps may be replayed from CUDA graphs, which dtypes it
    computes, which decode shapes warm-up must launch. A backend without one is refused when the
    engine is built, and so is a model dtype it does not list. A subclass of a kvlib backend inherits
    its parent's declaration: declare your own if your ``forward`` reads back to the host (not
    graph-safe) or supports fewer dtypes.
    """

    name: str
    capabilities: BackendCapabilities

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...

    def copy_blocks(self, pool_data: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None: ...


@runtime_checkable
class BlockSharing(Protocol):
    """How sequences share blocks (``LLM(block_sharing=...)``).

    ``fork(allocator, blocks)`` returns the block table of a child that reads, position for position,
    what ``blocks`` reads, and grows independently of it from then on; it copies no K/V and allocates
    nothing. ``make_writable(allocator, blocks, index, take_block)`` runs before a step writes into
    ``blocks[index]``; when it returns, that entry is a block no other table holds, and it returns the
    ``(source, destination)`` copy that makes the entry hold what it held before, or None where
    nothing needs copying.

    Must keep true: every block's reference count equals the tables that hold it (plus the prefix
    cache's own while it keeps the block); no other entry of ``blocks``, and no other table, changes;
    a new block comes from ``take_block()`` (one owner; it may evict a cached block nobody uses to
    make room), never from ``allocator.allocate()``. The engine guarantees each copy runs before the
    step's forward pass, reading what the source held when the step began.
    """

    def fork(self, allocator: BlockAllocator, blocks: list[int]) -> list[int]: ...

    def make_writable(self, allocator: BlockAllocator, blocks: list[int], index: int,
                      take_block: Callable[[], int]) -> Optional[tuple[int, int]]: ...


@runtime_checkable
class OversubscriptionDetector(Protocol):
    """Watches the metrics after every step (``LLM(oversubscription_detector=...)``) and returns a
    warning to log, or None. May keep state between calls; must not change the metrics."""

    def observe(self, metrics: EngineMetrics) -> Optional[str]: ...


@runtime_checkable
class SchedulingStep(Protocol):
    """One step of continuous batching (``LLM(scheduler=MyScheduler)``, a ``Scheduler`` subclass).

    The step's plan is made in two passes; each adds to the plan ``out`` and returns the token budget
    it leaves. ``schedule_running(out, budget)``: every running sequence, oldest first, is planned its
    uncomputed tokens, or what the budget has left if that is less. Before a sequence is planned it
    must have room to grow; making room may preempt running sequences not yet planned, or the
    sequence itself, which is then not planned. ``schedule_waiting(out, budget)``: the swapped and
    the waiting sequences stand in one line, oldest arrival first, and each resumes or starts while
    it fits: within the budget, within ``max_num_seqs`` (counting the samples its request will
    fork), and, while anything runs, leaving the watermark free (or cached for no one); the block
    manager says whether its blocks fit. The first that does not fit stops the line, so no newer one
    overtakes it.

    Must keep true: no sequence is planned twice in a step, nor for 0 tokens, nor past its end, nor
    past the budget. The engine runs ``schedule_waiting`` in steps without a preemption, and in a step
    that planned nothing, again after each paused sequence that gives up its device blocks, newest
    first and the first in line last, until it plans. Only then may a sequence the step preempted
    start again in it, its blocks copied out and back (the copy phases keep that order).
    After the step the engine records what was computed and sampled: the two passes only plan. The
    actions they plan with are the base class's (``kvlib.core.scheduler.Scheduler``; lab 04 lists them).
    """

    def schedule_running(self, out, budget: int) -> int: ...

    def schedule_waiting(self, out, budget: int) -> int: ...


@runtime_checkable
class PreemptionMechanism(Protocol):
    """How a victim's blocks leave the device and come back (``LLM(block_manager=MyBlockManager)``,
    a ``BlockManager`` subclass).

    ``swap_out(seq, count)`` moves the sequence's last ``count`` device blocks (None: all) to new
    host blocks: it keeps its computed tokens, and its host blocks, in position order, now begin
    with the new ones. ``swap_in(seq)`` brings every host block back into a new device block, in
    order, after its device blocks, and lets go of the host blocks. ``drop(seq, count)`` lets go of
    the last ``count`` device blocks (None: all) and of every host block, and returns the computed
    tokens lost. ``host_blocks_needed(seqs, count)`` says how many host blocks ``swap_out`` of each
    of ``seqs`` would allocate. None of them copies K/V: each plans the copies its move implies
    (``copy_out``, ``copy_in``), and the engine makes them all between the planning and the forward
    pass.

    Must keep true: every block reference taken is let go of exactly once (a block shared with
    other sequences stays theirs), and each copy reads what its source held when the step began,
    so a block that a copy of this step reads or writes goes to no one else before the copies run.
    The engine guarantees that the scheduler asked ``host_blocks_needed`` and made that much room
    on the host first (or recomputes instead), that nothing a step swaps out is swapped in by it,
    that the copies run device to host first, and that a request's blocks go through ``drop(seq)``
    when it finishes or is aborted. The methods work with the base class's block actions
    (``kvlib.core.block_manager.BlockManager``), each with one meaning: ``take()`` and
    ``take_host()`` (a new block, one reference), ``release(seq, count)`` (the sequence lets go of
    its last ``count`` device blocks), ``release_host(block)``, and ``copy_out(device, host)`` /
    ``copy_in(host, device)`` (plan a copy; each holds the host block until the copy has run).
    """

    def swap_out(self, seq, count: Optional[int] = None) -> None: ...

    def swap_in(self, seq) -> None: ...

    def drop(self, seq, count: Optional[int] = None) -> int: ...

    def host_blocks_needed(self, seqs: list, count: Optional[int] = None) -> int: ...


@runtime_checkable
class HostPrefixTier(Protocol):
    """Prefix blocks evicted from the device, kept in the host pool (``LLM(host_prefix_tier=MyTier)``,
    built with the host pool's allocator).

    ``put(name, tokens, host_block)`` keeps an already allocated host block (its one reference is
    now the tier's); ``lookup(name, tokens)`` returns the ``CachedBlock`` kept under ``name`` if its
    tokens match, else None; ``touch(name)`` marks it just used; ``evict_one()`` frees the least
    recently used block whose reference count is 1 (more means a move of this step holds it) and
    says whether it found one; iterating yields every kept ``CachedBlock``, ``name in tier`` says
    whether one is kept under ``name`` and ``num_cached`` counts them. Must keep true: the tier
    holds exactly one reference to each block it keeps. The engine guarantees it puts only blocks it
    allocated for the tier, never under a name the tier already keeps, and frees none of them itself.
    """

    def put(self, name: int, tokens: tuple, host_block: int) -> None: ...

    def lookup(self, name: int, tokens: tuple): ...

    def touch(self, name: int) -> None: ...

    def evict_one(self) -> bool: ...

    def __contains__(self, name: int) -> bool: ...

    def __iter__(self): ...

    @property
    def num_cached(self) -> int: ...


def protocol_members(protocol: type) -> list[str]:
    """The methods and attributes a protocol declares (its own, not ``Protocol``'s machinery)."""
    names = set(inspect.get_annotations(protocol))
    names.update(name for name, value in vars(protocol).items() if callable(value) or isinstance(value, property))
    return sorted(name for name in names if not name.startswith("_") or name in ("__contains__", "__iter__"))


def check_implements(piece, protocol: type, argument: str) -> None:
    """A plugged-in piece is refused when the engine is built, not mid-step, if it lacks part of its protocol,
    if a method cannot take the arguments the engine passes, or if it defines a near-namesake of a method the
    engine calls: in a subclass of kvlib's own class, the inherited method would run in its place, unnoticed."""
    members = protocol_members(protocol)
    missing = [name for name in members if not _has(piece, name)]
    if missing:
        raise TypeError(f"{argument}={piece!r} does not implement kvlib.interfaces.{protocol.__name__}: it has no "
                        f"{', '.join(missing)}; see that protocol's docstring for what each must do")
    problems = [problem for name in members if (problem := _call_problem(piece, protocol, name))]
    problems += _near_namesakes(piece, members)
    if problems:
        raise TypeError(f"{argument}={piece!r} does not fit kvlib.interfaces.{protocol.__name__}: "
                        f"{'; '.join(problems)}")


def _has(piece, name: str) -> bool:
    """Whether ``piece`` has ``name``, without running a property (a learner's stub may raise)."""
    try:
        inspect.getattr_static(piece, name)
        return True
    except AttributeError:
        return hasattr(piece, name)  # provided through __getattr__


def _call_problem(piece, protocol: type, name: str) -> Optional[str]:
    """What stops the engine calling ``piece.name`` as the protocol declares it (None: nothing can be seen)."""
    declared = vars(protocol).get(name)
    if not inspect.isfunction(declared):
        return None  # an attribute or a property
    if isinstance(inspect.getattr_static(piece, name, None), property):
        return f"{name} is a property, but the engine calls it as a method {_call(name, declared)}"
    method = getattr(piece, name)
    if not callable(method):
        return f"{name} is {method!r}, but the engine calls it as a method {_call(name, declared)}"
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None  # a builtin without a signature to read
    params = list(inspect.signature(declared).parameters.values())[1:]
    required = [p for p in params if p.default is p.empty]
    for args in (required, params):
        try:
            signature.bind(*args)
        except TypeError:
            return f"{name}{_plain(signature)} cannot be called as {name}({', '.join(p.name for p in args)})"
    return None


def _call(name: str, declared) -> str:
    """``name(a, b=None)``: how the protocol declares a method, without ``self``."""
    signature = inspect.signature(declared)
    return f"{name}{_plain(signature.replace(parameters=list(signature.parameters.values())[1:]))}"


def _plain(signature: inspect.Signature) -> str:
    """``(a, b=None)``: a signature without its annotations, as an error message shows it."""
    return f"({', '.join(str(p.replace(annotation=p.empty)) for p in signature.parameters.values())})"


def _near_namesakes(piece, members: list[str]) -> list[str]:
    """Public methods the piece's own classes (not kvlib's) define under a name close to a member's, never called."""
    own = {name for cls in type(piece).__mro__ if cls is not object and not cls.__module__.startswith("kvlib.")
           for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}
    return [f"it defines {name}, which the engine never calls: is it meant to be {close[0]}?"
            for name in sorted(own - set(members)) if (close := difflib.get_close_matches(name, members, 1, 0.8))]


def check_attention_backend(backend, dtype: torch.dtype) -> None:
    """A backend is refused when the engine is built if it lacks part of its protocol or the model's dtype."""
    check_implements(backend, AttentionBackend, "attention_backend")
    capabilities = backend.capabilities
    if not isinstance(capabilities, BackendCapabilities):
        raise TypeError(f"attention_backend={backend!r} declares capabilities={capabilities!r}; it must be a "
                        f"kvlib.attention.capabilities.BackendCapabilities")
    if dtype not in capabilities.dtypes:
        supported = ", ".join(str(d).removeprefix("torch.") for d in capabilities.dtypes)
        raise ValueError(f"attention backend {backend.name!r} computes in "
                         f"{supported}, not {str(dtype).removeprefix('torch.')}: set EngineConfig(dtype=...) to "
                         f"one of those, or choose another backend")


def check_preemption_policy(policy, preemption_mode: str) -> None:
    """The mode has one owner, ``EngineConfig.preemption_mode``: a policy always chooses victims, and brings a
    choice of mode of its own only in auto mode, the one mode that asks it (a fixed mode would ignore it)."""
    if not _has(policy, "select_victim"):
        raise TypeError(f"the preemption policy {policy!r} has no select_victim(candidates, shortfall) method")
    if preemption_mode == "auto" and not _has(policy, "choose_mode"):
        raise TypeError(f"preemption_mode='auto' asks the policy to choose swap or recompute, but {policy!r} "
                        f"has no choose_mode(victim, context) method")
    if preemption_mode == "auto" and not _has(policy, "cost_model"):
        raise TypeError(f"preemption_mode='auto' prices swap and recompute with the policy's cost_model (None: "
                        f"measured at start-up), but {policy!r} has none; give it cost_model = None, or a "
                        f"PreemptionCostModel")
    problems = [problem for name in ("select_victim", "choose_mode")
                if _has(policy, name) and (problem := _call_problem(policy, PreemptionPolicy, name))]
    if problems:
        raise TypeError(f"preemption_policy={policy!r} does not fit kvlib.interfaces.PreemptionPolicy: "
                        f"{'; '.join(problems)}")
    if preemption_mode != "auto" and _has(policy, "choose_mode") and _written_outside_kvlib(policy.choose_mode):
        raise ValueError(f"{type(policy).__name__} chooses between swap and recompute itself (it defines "
                         f"choose_mode), but EngineConfig.preemption_mode={preemption_mode!r} fixes the mode and never "
                         f"asks it; set preemption_mode='auto' to let the policy choose")


def _written_outside_kvlib(method) -> bool:
    """Whether a method is the piece's own code, not one of kvlib's (a kvlib policy's ``choose_mode`` is simply
    never asked in a fixed mode)."""
    module = getattr(getattr(method, "__func__", method), "__module__", None) or ""
    return not module.startswith("kvlib.")
