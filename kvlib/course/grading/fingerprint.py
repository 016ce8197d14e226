"""How much of kvlib's own answer a submission's graded code repeats: a flag for the instructor, not a score.

Both sides are cut into shingles: runs of eight tokens with comments, docstrings and string
contents dropped and every name that is not a keyword or an attribute made the same, so renaming
variables does not hide a copy. The share of kvlib's shingles that the learner's code also has is
the resemblance; at :data:`FLAG_AT` or more the report and the gradebook say so, and an instructor
decides. Definitions shorter than :data:`MIN_SHINGLES` are not compared: a short method, or a
textbook online-softmax step, resembles every correct answer.
"""
from __future__ import annotations

import io
import keyword
import tokenize

SHINGLE = 8
FLAG_AT = 0.6
MIN_SHINGLES = 200
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}


def tokens(source: str) -> list[str]:
    out: list[str] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in _SKIPPED:
                continue
            if token.type == tokenize.STRING:
                out.append("S")
            elif token.type == tokenize.NAME and not keyword.iskeyword(token.string) and (not out or out[-1] != "."):
                out.append("N")
            else:
                out.append(token.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def shingles(source: str) -> set[tuple[str, ...]]:
    words = tokens(source)
    return {tuple(words[i:i + SHINGLE]) for i in range(max(0, len(words) - SHINGLE + 1))}


def resemblance(learner: set[tuple[str, ...]], kvlib_source: str) -> float:
    """The share of kvlib's shingles found in the learner's (``shingles`` of their code), 0 to 1."""
    theirs = shingles(kvlib_source)
    if len(theirs) < MIN_SHINGLES:
        return 0.0
    return len(theirs & learner) / len(theirs)
