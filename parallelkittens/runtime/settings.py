"""Every PK_* environment variable the runtime reads, parsed once into one frozen `Settings`.

`init()` reads them when a rank joins, keeps them in its `Context` and checks that every rank read the same
values (a rank with other settings is a `PKError` on every rank). `spawn()`, which runs before any rank exists,
reads them in the parent. Nothing else in the package reads the environment for PK_* names, except the
benchmarks, which read their own through `parse` (`bench/settings.py`). `VARIABLES` is the table the README
shows, and a test checks that the two agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from .errors import PKError

# name: (field, default, effect). The one place a variable, its default and its meaning are written: `Settings`
# declares each field's type and takes its default from here.
VARIABLES: dict[str, tuple[str, object, str]] = {
    "PK_BACKEND": ("backend", None, "`cuda` (a GPU per rank, NCCL), `cuda-shared` (ranks share one GPU, gloo; "
                                    "correct, not fast), `cpu` (interpreter); default: the best that runs"),
    "PK_DEBUG": ("debug", False, "`1`: waits (on the device and on the host) give up after PK_WAIT_TIMEOUT instead "
                                 "of PK_TIMEOUT, so a protocol bug fails in seconds (the tests and the demo set it)"),
    "PK_WAIT_TIMEOUT": ("wait_timeout_s", 10.0, "seconds a wait lasts with PK_DEBUG=1 (a rank's first launch may "
                                                "wait for a peer still compiling: allow a minute when kernels "
                                                "compile cold)"),
    "PK_TIMEOUT": ("timeout_s", 600.0, "the watchdog (NCCL's default): without PK_DEBUG, seconds a rank waits on the "
                                       "host for the others to arrive at an agreement (then `PKError` names the "
                                       "missing ranks), and a device wait lasts (then the rank's next launch, "
                                       "`pk.sync()` or its end raises `WaitTimeoutError`)"),
    "PK_JOIN_TIMEOUT": ("join_timeout_s", 60.0, "seconds `init()` waits for every rank to join"),
    "PK_SPAWN_TIMEOUT": ("spawn_timeout_s", 300.0, "seconds `spawn()` lets ranks run"),
    "PK_SPAWN_METHOD": ("spawn_method", "auto", "how `spawn()` starts ranks: `auto` (fork on the CPU backend while "
                                                "the parent has no CUDA and no process group, else `forkserver`), "
                                                "`fork`, `forkserver` or `spawn` (a cold interpreter per rank: the "
                                                "slowest, and safe whatever the main module does at import)"),
    "PK_FAST_LAUNCH": ("fast_launch", True, "`0`: launch every kernel through Triton's own path; by default a plan's "
                                            "later calls go straight to the compiled kernel's launcher"),
    "PK_INTERPRET_SMS": ("interpret_sms", 4, "programs a persistent kernel runs under the interpreter (each is a "
                                             "thread)"),
    "PK_ONE_SHOT_BYTES": ("one_shot_bytes", 256 * 1024, "largest all_reduce (bytes) done in one shot; larger ones "
                                                        "reduce-scatter then all-gather"),
    "PK_JOB_ID": ("job_id", "", "set by `spawn()` for its ranks: names the job's shared-memory files"),
}


def defaults(variables: Mapping[str, tuple[str, object, str]]) -> dict[str, object]:
    """Each variable's default, by its field's name."""
    return {field: default for field, default, _doc in variables.values()}


def parse(cls: type, variables: Mapping[str, tuple[str, object, str]], environ: Mapping[str, str] | None = None):
    """An instance of the frozen dataclass `cls` from the variables of `environ` (default: this process's).

    A variable that is unset or empty keeps its field's default; a bad value is a `PKError` naming the variable.
    The field's declared type says how its value is read: "bool" (0 or 1), "int", "float" (positive), else a string.
    """
    types = {f.name: f.type for f in fields(cls)}
    if set(types) != set(defaults(variables)):
        raise TypeError(f"{cls.__name__}'s fields {sorted(types)} are not its variables' "
                        f"{sorted(defaults(variables))}")
    environ = os.environ if environ is None else environ
    values = {}
    for name, (field, _default, _doc) in variables.items():
        raw = environ.get(name, "")
        if raw == "":
            continue
        kind = types[field]
        try:
            if kind == "bool":
                if raw not in ("0", "1"):
                    raise ValueError
                values[field] = raw == "1"
            elif kind == "int":
                values[field] = int(raw)
            elif kind == "float":
                values[field] = float(raw)
                if values[field] <= 0:
                    raise ValueError
            else:
                values[field] = raw
        except ValueError:
            want = {"bool": "0 or 1", "int": "an integer", "float": "a positive number"}.get(kind, "a string")
            raise PKError(f"environment variable {name}={raw!r} is not {want}") from None
    return cls(**values)


_DEFAULT = defaults(VARIABLES)


@dataclass(frozen=True)
class Settings:
    """The PK_* variables of one process, parsed (see `VARIABLES` for each one's meaning and default)."""

    backend: str | None = _DEFAULT["backend"]
    debug: bool = _DEFAULT["debug"]
    wait_timeout_s: float = _DEFAULT["wait_timeout_s"]
    timeout_s: float = _DEFAULT["timeout_s"]
    join_timeout_s: float = _DEFAULT["join_timeout_s"]
    spawn_timeout_s: float = _DEFAULT["spawn_timeout_s"]
    spawn_method: str = _DEFAULT["spawn_method"]
    fast_launch: bool = _DEFAULT["fast_launch"]
    interpret_sms: int = _DEFAULT["interpret_sms"]
    one_shot_bytes: int = _DEFAULT["one_shot_bytes"]
    job_id: str = _DEFAULT["job_id"]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse the PK_* variables of `environ` (default: this process's); a bad value is a `PKError` naming it."""
        return parse(cls, VARIABLES, environ)

    @property
    def wait_bound_s(self) -> float:
        """How long a wait on a counter lasts before it gives up: PK_WAIT_TIMEOUT in debug mode, else PK_TIMEOUT."""
        return self.wait_timeout_s if self.debug else self.timeout_s

    def shared(self) -> tuple:
        """The fields every rank must agree on (all of them: a job's ranks run under one environment)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))
