"""The sandbox's watch over Triton launches in lab 03: feedback on what a launcher handed its kernels.

It runs beside the learner's code, so it can only cost points (code loaded before it can rebind it);
the grader checks the same rule where the learner cannot reach, in the graded source (``kernel_rule``).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

import kvlib

_NOT_YOURS = (str(Path(kvlib.__file__).resolve().parent), "<frozen")


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@contextmanager
def launch_log(inputs: tuple[torch.Tensor, ...]):
    """Records every Triton launch while active (``launches``: name, whether the learner's own). A kernel of the
    learner's may read the inputs, never change them, and write one output: zeroed when first handed over, changed
    by nothing else between and after its kernels (``outputs``: storage -> its bytes after the last of them)."""
    from triton.runtime import interpreter, jit
    log = SimpleNamespace(inputs={t.untyped_storage().data_ptr(): (t, storage_bytes(t).clone()) for t in inputs},
                          launches=[], outputs={}, problems=[], handed_cache=False)

    def changed(when: str) -> None:
        if any(not torch.equal(storage_bytes(t), before) for t, before in log.inputs.values()):
            log.problems.append(f"an input tensor (query, caches, block table or lengths) changed {when}: your "
                                f"kernel may only read them")

    def recording(original):
        def run(kernel_self, *args, **kwargs):
            fn = getattr(kernel_self, "fn", None)
            name, filename = getattr(fn, "__name__", "?"), getattr(getattr(fn, "__code__", None), "co_filename", "")
            own = bool(filename) and not filename.startswith(_NOT_YOURS) and "/triton/" not in filename
            log.launches += [] if kwargs.get("warmup", False) else [(name, own)]
            if kwargs.get("warmup", False) or not own:
                return original(kernel_self, *args, **kwargs)
            outputs = []
            for arg in [a for a in (*args, *kwargs.values()) if hasattr(a, "data_ptr")]:
                ptr = arg.untyped_storage().data_ptr() if isinstance(arg, torch.Tensor) else None
                if ptr in log.inputs:
                    log.handed_cache |= log.inputs[ptr][0].dim() == 4
                elif ptr is None:
                    log.problems.append(f"your kernel {name} was handed a {type(arg).__name__}: hand it tensors")
                elif ptr in log.outputs and not torch.equal(storage_bytes(arg), log.outputs[ptr]):
                    log.problems.append(f"a tensor handed to your kernel {name} changed since your kernel last ran: "
                                        f"only your kernels may write the output")
                else:
                    outputs.append(storage_bytes(arg) if ptr in log.outputs else storage_bytes(arg).zero_())
            changed(f"before your kernel {name} ran")
            result = original(kernel_self, *args, **kwargs)
            log.outputs.update({b.untyped_storage().data_ptr(): b.clone() for b in outputs})
            return result
        return run
    saved = [(c, c.__dict__["run"]) for c in (jit.JITFunction, interpreter.InterpretedFunction) if "run" in vars(c)]
    for cls, original in saved:
        setattr(cls, "run", recording(original))
    try:
        yield log
    finally:
        for cls, original in saved:
            setattr(cls, "run", original)
    changed("while your launcher ran")
