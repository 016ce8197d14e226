"""The two ways a model folder can fail to load, so callers can tell them apart.

:class:`CheckpointError`: a file is unreadable or disagrees with another (fix or replace the file).
:class:`UnsupportedModelError`: the files are sound but ask for math kvlib does not implement
(choose another checkpoint); both name the file and what in it is wrong.
"""


class CheckpointError(ValueError):
    """A file of the model folder is broken, or contradicts the others."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but uses a feature kvlib does not implement."""
