"""Where a GPU's modelled cost model and a run measured on that GPU part, one term at a time.

A lesson prices GPUs it cannot time from published peaks and assumed shares of them
(:mod:`kvlib.course.gpu_profiles`); a run recorded on one of them (:mod:`kvlib.course.measured_runs`)
brings the cost model that GPU's own probe measured, and its victims preempted both ways. When the
two disagree about which victims should recompute, putting one measured term at a time in place of
its modelled value shows which assumption the disagreement rests on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from kvlib.cli.gpu_shapes import SHAPES
from kvlib.core.cost_model import PreemptionCostModel
from kvlib.course.gpu_profiles import GPUProfile, ModelShape
from kvlib.course.measured_runs import MeasuredRun, decided, on_chip, way
from kvlib.model.config import ModelConfig
from kvlib.model.default import DEFAULT_MODEL_PATH

# The cost model's terms, as a lesson names them, with the unit and scale each is shown in.
TERMS = {
    "host_link_bytes_per_s": ("host link", "GB/s", 1e-9),
    "prefill_tokens_per_s": ("prefill speed", "tokens/s", 1.0),
    "floor_seconds": ("floor", "ms", 1e3),
    "overlap": ("overlap", "", 1.0),
    "attention_seconds_per_pair": ("attention per pair", "ns", 1e9),
    "attention_call_seconds": ("attention call", "ms", 1e3),
    "copy_call_seconds": ("copy call", "ms", 1e3),
}


def profile_for(run: MeasuredRun, profiles: list[GPUProfile]) -> GPUProfile | None:
    """The profile of the GPU a run was measured on ("NVIDIA H200" is "H200 SXM 141GB", not "GH200 144GB")."""
    return next((p for p in profiles if on_chip(p.name, run.device)), None)


def run_shape(run: MeasuredRun) -> ModelShape | None:
    """The shape of the model a run measured: the built-in model, or a real shape the GPU check wrote."""
    if run.model == "default":
        config = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())
    else:
        shape = next((s for name, s in SHAPES.items() if run.model.startswith(f"{name}-shaped")), None)
        if shape is None:
            return None
        config = shape.config(getattr(torch, run.dtype))
    return ModelShape.from_config(ModelConfig.from_dict(config))


def picks(cost: PreemptionCostModel, run: MeasuredRun) -> tuple[int, int]:
    """``(agreed, decided)``: of the run's victims with a measured winner (none where both were hidden or the swap
    was not clear of 0), at how many the cost model picks the same way."""
    winners = decided(run.victims)
    agreed = sum(cost.choose(v.num_blocks, run.block_bytes, v.num_tokens, run.batch)
                 == way(v) for v in winners)
    return agreed, len(winners)


@dataclass(frozen=True)
class TermSwap:
    """One term of the modelled cost model replaced by the run's measured value, and what the model then says."""

    term: str
    modelled: float
    measured: float
    agreed: int  # measured victims whose winner the model with this one term measured picks
    decided: int


def term_by_term(modelled: PreemptionCostModel, run: MeasuredRun) -> list[TermSwap]:
    """Each term of ``modelled`` in turn replaced by the one ``run`` measured, the others kept."""
    measured = run.cost_model
    return [TermSwap(term, getattr(modelled, term), getattr(measured, term),
                     *picks(replace(modelled, **{term: getattr(measured, term)}), run)) for term in TERMS]


def deciding_terms(swaps: list[TermSwap], modelled_agreed: int) -> list[str]:
    """The terms that, measured alone, bring the model to the run's every winner where the modelled one missed some."""
    return [s.term for s in swaps if s.agreed == s.decided > modelled_agreed]


def shown(term: str, value: float) -> str:
    """A term's value in the unit a lesson shows it in."""
    _, unit, scale = TERMS[term]
    value *= scale
    return f"{value:,.0f} {unit}".strip() if abs(value) >= 1000 else f"{value:.3g} {unit}".strip()
