"""Run a notebook top to bottom in a fresh kernel of this Python, importing this kvlib.

The kernel is started from the running interpreter (not whatever "python3" kernel spec is
installed), with this kvlib's folder first on PYTHONPATH, so a notebook is graded and tested
against the code that grades it, wherever the notebook file lives.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import ipykernel.kernelspec
import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.utils import run_sync
from nbclient import NotebookClient

import kvlib

CELL_TIMEOUT_S = 300


class CurrentEnvKernelSpecs(KernelSpecManager):
    """Every kernel name resolves to an ipykernel running on this interpreter."""

    def get_kernel_spec(self, kernel_name):
        return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                      **ipykernel.kernelspec.get_kernel_dict())


def execute_notebook(path: Path, *, allow_errors: bool, timeout: int = CELL_TIMEOUT_S,
                     env: Optional[dict[str, str]] = None) -> nbformat.NotebookNode:
    """Read and execute ``path``; return the executed notebook."""
    nb = nbformat.read(path, as_version=4)
    execute(nb, Path(path).parent, allow_errors=allow_errors, timeout=timeout, env=env)
    return nb


def execute(nb: nbformat.NotebookNode, folder: Path, *, allow_errors: bool, timeout: int = CELL_TIMEOUT_S,
            env: Optional[dict[str, str]] = None, **client_options) -> None:
    """Execute ``nb`` in place with ``folder`` as the working directory.

    With ``allow_errors`` a failing cell does not stop the run, and a cell that runs past
    ``timeout`` seconds is interrupted, so the cells after it still run. ``client_options``
    go to :class:`nbclient.NotebookClient` (e.g. its ``on_cell_execute`` hook).

    The kernel is shut down when the notebook is done, however it ends (a client handed a kernel
    manager leaves the kernel running: each one is a Python process holding torch, and grading a
    class would otherwise pile them up until memory runs out).
    """
    kernel = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvKernelSpecs())
    client = NotebookClient(nb, km=kernel, timeout=timeout, allow_errors=allow_errors,
                            interrupt_on_timeout=allow_errors,
                            resources={"metadata": {"path": str(Path(folder).resolve())}}, **client_options)
    try:
        client.execute(env=_kernel_env(env), stderr=subprocess.DEVNULL,  # the kernel's own log, not cell output
                       cleanup_kc=True)
    finally:
        run_sync(_shut_down)(kernel)


async def _shut_down(kernel: AsyncKernelManager) -> None:
    """Kill ``kernel``'s process if the client left one (a kernel that failed to start, say)."""
    if kernel.has_kernel:
        await kernel.shutdown_kernel(now=True)


def _kernel_env(extra: Optional[dict[str, str]]) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    package_parent = str(Path(kvlib.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return env
