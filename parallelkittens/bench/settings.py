"""The benchmarks' own PK_* variables, parsed once per process into one frozen `BenchSettings`.

They choose what a benchmark runs and how many calls it times, never what an op does, so they live here and not
in the runtime's `Settings`. They are parsed as the runtime's are (`runtime/settings.py: parse`): a bad value is
a `PKError` naming the variable. The README lists them in its table of variables the runtime does not read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ..runtime.settings import defaults, parse

# name: (field, default, effect), as the runtime's `VARIABLES`: the one place a variable, its default and its
# meaning are written; `BenchSettings` declares each field's type and takes its default from here.
VARIABLES: dict[str, tuple[str, object, str]] = {
    "PK_BENCH_MAX_ITERS": ("max_iters", 200, "most calls a benchmark times back to back per measurement"),
    "PK_BENCH_FULL": ("full", False, "`1`: the attention benchmarks also run the sequences whose forward takes "
                                     "over about a second per GPU"),
    "PK_BENCH_SEQS": ("seqs", "", "comma-separated total sequence lengths the attention benchmarks run instead "
                                  "of their sweep (for example `4096,8192`)"),
}

_DEFAULT = defaults(VARIABLES)


@dataclass(frozen=True)
class BenchSettings:
    """The benchmark variables of one process, parsed (see `VARIABLES` for each one's meaning and default)."""

    max_iters: int = _DEFAULT["max_iters"]
    full: bool = _DEFAULT["full"]
    seqs: str = _DEFAULT["seqs"]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BenchSettings:
        """Parse the benchmark variables of `environ` (default: this process's)."""
        return parse(cls, VARIABLES, environ)


@functools.cache
def bench_settings() -> BenchSettings:
    """This process's benchmark settings, read on first use."""
    return BenchSettings.from_env()
