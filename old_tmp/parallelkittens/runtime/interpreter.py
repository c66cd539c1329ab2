"""Patches that let unchanged multi-rank kernels run correctly under Triton's interpreter (``TRITON_INTERPRET=1``).

Nothing happens at import time: :func:`install` applies the patches (idempotently), :func:`uninstall` restores the
originals. They replace private internals of ``triton.runtime.interpreter`` (triton 3.9):

* Thread safety: ``InterpreterBuilder.grid_idx/grid_dim`` were one global (concurrent launches corrupted
  ``program_id``) and become thread-local; ``_patch_lang`` patched and restored ``triton.language`` per launch, under
  other threads' launches; now running launches share one reference-counted patch.
* Concurrent programs: ``GridExecutor.__call__`` ran a launch's programs one after another, so a program waiting on a
  higher-numbered one deadlocked; now each program has a thread. The first failure reaches the launcher with its
  original type and the program id in the message; the other programs stop at their next memory access.
* Bounds checks: ``create_masked_load/masked_store/atomic_cas/atomic_rmw`` (which plain, atomic, polling and
  tensor-descriptor accesses all reach) raise ``MemoryError`` unless the active addresses lie in tensor arguments of
  the launch or in buffers given to :func:`register_buffer` (say, peer heaps reached through raw addresses).
* bf16, stored as uint16 and computed on as bit patterns: ``binary_op``, ``unary_op``, ``ternary_op``,
  ``create_fma/erf/rsqrt/dot``, ``cast_impl``, ``create_fp_to_fp`` and the numpy paths of ``ReduceOps/ScanOps`` now
  compute in float32 and round to bf16 (nearest even), as a GPU does for one bf16 op (reductions round once, at the
  end). bf16 ``atomic_add`` (refused by the C++ helper) becomes a compare-and-swap loop on the enclosing 32-bit
  word, atomic among threads and processes alike. ``create_descriptor_reduce`` (missing: every
  ``tensor_descriptor.atomic_*`` failed) is added.
* Device functions are rewritten (parsed and compiled) one at a time: program threads reached a function's first
  call together, and CPython 3.11's AST construction is not safe on several threads at once.
* Inline asm: ``create_inline_asm`` calls emulations given to :func:`register_asm` (:func:`read_memory` and
  :func:`write_memory` help write them).
* ``options.debug`` of the builder is set, so ``tl.device_assert`` and the integer-overflow checks raise.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton._C.libtriton import interpreter as _native
from triton._C.libtriton import ir as _ir
from triton.runtime import interpreter as _I
from triton.runtime.errors import InterpreterError
from triton.runtime.jit import TensorWrapper
from triton.tools.tensor_descriptor import TensorDescriptor

_TH = _I.TensorHandle
_Range = tuple[int, int]

_options = {"concurrent_programs": True, "check_bounds": True}
_patches: Any = None  # the _LangPatchScope holding every original while installed
_tls = threading.local()  # per thread: grid_idx, grid_dim, launch

_orig_patch_lang: Callable[[Any], Any] = _I._patch_lang
# Stands for a kernel whose globals see both language modules, so the shared patch covers every kernel.
_ALL_LANGS = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})

_buffers_lock = threading.Lock()
_buffers: dict[_Range, int] = {}
_buffer_ranges: tuple[_Range, ...] = ()

_asm: dict[str, Callable[..., Any]] = {}


# ----------------------------------------------------------------------------------------------- public API
def install(*, concurrent_programs: bool = True, check_bounds: bool = True) -> None:
    """Apply all interpreter patches (idempotent; a repeated call only updates the two options).

    Args:
        concurrent_programs: run each program of a launch on its own thread, so programs may wait on each other.
        check_bounds: raise ``MemoryError`` on loads, stores and atomics outside arguments and registered buffers.
    """
    global _patches, _orig_patch_lang
    _options.update(concurrent_programs=concurrent_programs, check_bounds=check_bounds)
    if _patches is not None:
        return
    _orig_patch_lang = _I._patch_lang
    scope = _I._LangPatchScope()
    B = _I.InterpreterBuilder
    for name in ("grid_idx", "grid_dim"):  # thread-local, each program thread has its own
        prop = property(lambda _, n=name: getattr(_tls, n, None), lambda _, v, n=name: setattr(_tls, n, v))
        scope.set_attr(B, name, prop)
    scope.set_attr(_I, "_patch_lang", _lang.nested)
    scope.set_attr(_I.InterpretedFunction, "rewrite", _one_rewrite_at_a_time(_I.InterpretedFunction.rewrite))
    scope.set_attr(_I.GridExecutor, "__call__", _grid_executor_call)
    for name, wrap in _BUILDER_WRAPPERS.items():
        scope.set_attr(B, name, wrap(getattr(B, name)))
    scope.set_attr(B, "create_descriptor_reduce", _create_descriptor_reduce)
    scope.set_attr(B, "create_inline_asm", _create_inline_asm)
    scope.set_attr(_I.ReduceOps, "apply_impl", _f32_reduce_scan(_I.ReduceOps.apply_impl, _NUMPY_REDUCES))
    scope.set_attr(_I.ScanOps, "apply_impl", _f32_reduce_scan(_I.ScanOps.apply_impl, _NUMPY_SCANS))
    builder = _I.interpreter_builder
    scope.set_attr(builder, "options", dataclasses.replace(builder.options, debug=True))
    _patches = scope



_rewrite_lock = threading.Lock()


def _one_rewrite_at_a_time(rewrite: Callable[[Any], Any]) -> Callable[[Any], Any]:
    # A device function is rewritten (its source parsed and compiled) at its first call, which program threads
    # reach together; CPython 3.11 can fail building ASTs on several threads at once ("AST constructor recursion
    # depth mismatch"), so rewrites take turns. Later calls find the result cached and take no lock.
    def locked(self):
        done = self.rewritten_fn.get(self.fn)
        if done is not None:
            return done
        with _rewrite_lock:
            return rewrite(self)

    return locked

def uninstall() -> None:
    """Restore every patched interpreter internal. Registered buffers and asm emulations are kept."""
    global _patches
    if _patches is None:
        return
    if _lang.users:
        raise RuntimeError("cannot uninstall the interpreter patches while a launch is running")
    _patches.restore()
    _patches = None


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _patches is not None


def register_buffer(t: torch.Tensor) -> None:
    """Allow kernels to access the whole storage of ``t`` (counted: register as often as you unregister)."""
    global _buffer_ranges
    r = _storage_range(t)
    with _buffers_lock:
        _buffers[r] = _buffers.get(r, 0) + 1
        _buffer_ranges = tuple(_buffers)


def unregister_buffer(t: torch.Tensor) -> None:
    """Undo one :func:`register_buffer` of ``t``'s storage; ``ValueError`` if it is not registered."""
    global _buffer_ranges
    r = _storage_range(t)
    with _buffers_lock:
        if r not in _buffers:
            raise ValueError(f"buffer at {r[0]:#x} ({r[1] - r[0]} bytes) is not registered")
        _buffers[r] -= 1
        if not _buffers[r]:
            del _buffers[r]
        _buffer_ranges = tuple(_buffers)


def register_asm(asm: str, fn: Callable[..., np.ndarray]) -> None:
    """Emulate ``tl.inline_asm_elementwise(asm, ...)`` by ``fn(*args)`` (whitespace in ``asm`` is not significant).

    ``fn`` gets one numpy array per argument, already broadcast (pointers as uint64 addresses, bf16 as float32), and
    returns an array (or a tuple, one per requested dtype) broadcastable to the result shape.
    """
    _asm[_asm_key(asm)] = fn


def unregister_asm(asm: str) -> None:
    """Forget the emulation of ``asm``, if any."""
    _asm.pop(_asm_key(asm), None)


def read_memory(addresses: np.ndarray, np_dtype: Any) -> np.ndarray:
    """Load one ``np_dtype`` element from each address (bounds-checked like a kernel load)."""
    addrs = np.array(addresses, dtype=np.uint64, order="C")
    dtype = np.dtype(np_dtype)
    _check_access(addrs, None, dtype.itemsize, "load")
    return _native.load(addrs, np.ones(addrs.shape, bool), np.zeros(addrs.shape, dtype), dtype)


def write_memory(addresses: np.ndarray, values: np.ndarray) -> None:
    """Store ``values`` (broadcast to the shape of ``addresses``) at the addresses (bounds-checked)."""
    addrs = np.array(addresses, dtype=np.uint64, order="C")
    vals = np.array(np.broadcast_to(values, addrs.shape), order="C")
    _check_access(addrs, None, vals.itemsize, "store")
    _native.store(addrs, vals, np.ones(addrs.shape, bool))


# --------------------------------------------------------------------------------- threads and launches
class _SharedLangPatch:
    """One patch of ``triton.language`` shared by the running launches: the first patches, the last restores."""

    def __init__(self) -> None:
        self.lock, self.users, self.scope = threading.Lock(), 0, None

    def __enter__(self) -> None:
        with self.lock:
            if not self.users:
                self.scope = _orig_patch_lang(_ALL_LANGS)
            self.users += 1

    def __exit__(self, *exc_info: Any) -> None:
        with self.lock:
            self.users -= 1
            if not self.users:
                self.scope.restore()

    def nested(self, fn: Any) -> Any:
        # Replaces _patch_lang at device-function calls, which re-patch and never restore.
        return types.SimpleNamespace(restore=lambda: None) if self.users else _orig_patch_lang(fn)


_lang = _SharedLangPatch()


class _Aborted(BaseException):
    """Stops a program after another program of its launch failed (BaseException: device calls wrap Exception)."""


class _Launch:
    """One launch: kernel, arguments, grid, the arguments' memory ranges, and the failures of its programs."""

    def __init__(self, fn: Callable[..., Any], args: dict, grid: tuple[int, int, int], ranges: tuple) -> None:
        self.fn, self.args, self.grid, self.ranges = fn, args, grid, ranges
        self.failed = False  # read without the lock by programs, at each memory access
        self.failures: list[tuple[tuple[int, int, int], BaseException]] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        pids = list(itertools.product(*map(range, self.grid)))
        if _options["concurrent_programs"] and len(pids) > 1:
            threads = [threading.Thread(target=self._guarded, args=(pid,), daemon=True) for pid in pids]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            except BaseException:  # e.g. KeyboardInterrupt: programs stop at their next memory access
                self.failed = True
                raise
        else:
            saved = getattr(_tls, "launch", None)
            for pid in pids:
                if self._guarded(pid):
                    break
            _tls.launch = saved
        if self.failures:
            _raise_program_error(*self.failures[0])

    def _guarded(self, pid: tuple[int, int, int]) -> bool:
        """Run one program; record its failure (returned as True) instead of raising it."""
        try:
            _tls.launch = self
            _I.interpreter_builder.set_grid_dim(*self.grid)
            _I.interpreter_builder.set_grid_idx(*pid)
            self.fn(**self.args)
            return False
        except _Aborted:
            return True
        except BaseException as exc:
            with self.lock:
                self.failures.append((pid, exc))
            self.failed = True
            return True


def _grid_executor_call(self: Any, *args_dev: Any, **kwargs: Any) -> None:
    """``GridExecutor.__call__`` of triton 3.9, with a shared language patch, bounds ranges and threaded programs."""
    argspec = inspect.getfullargspec(self.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
    args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
    for hook in self.pre_run_hooks:
        hook(*args_hst, **kwargs_hst)
    with _lang:
        args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        args = {name: arg if name in self.constexprs else _I._implicit_cvt(arg) for name, arg in args.items()}
        grid = self.grid(args) if callable(self.grid) else self.grid
        assert len(grid) <= 3, "grid must have at most 3 dimensions"
        grid = tuple(grid) + (1,) * (3 - len(grid))
        _Launch(self.fn, args, grid, _argument_ranges([*args_hst, *kwargs_hst.values()])).run()
    self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)


def _raise_program_error(pid: tuple[int, int, int], exc: BaseException) -> None:
    if triton.knobs.compilation.front_end_debugging:
        raise exc
    root = exc  # device-function calls wrap errors in InterpreterError(repr(e)); report the original
    while isinstance(root, InterpreterError) and root.__cause__ is not None:
        root = root.__cause__
    where = f"[in program {pid}]"
    try:
        err = type(root)(f"{root} {where}")
    except Exception:
        err = InterpreterError(f"{root!r} {where}")
    raise err from root


# ---------------------------------------------------------------------------------------- bounds checks
def _storage_range(t: Any) -> _Range:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _argument_ranges(arg: Any) -> tuple[_Range, ...]:
    if isinstance(arg, (tuple, list)):
        return tuple(r for item in arg for r in _argument_ranges(item))
    if isinstance(arg, (TensorDescriptor, TensorWrapper)):
        return _argument_ranges(arg.base)
    return (_storage_range(arg),) if isinstance(arg, torch.Tensor) else ()


def _check_access(addrs: np.ndarray, mask: np.ndarray | None, size: int, what: str) -> None:
    launch = getattr(_tls, "launch", None)
    if launch is not None and launch.failed:
        raise _Aborted
    if not _options["check_bounds"]:
        return
    addrs = np.asarray(addrs)
    if mask is not None:
        addrs, mask = np.broadcast_arrays(addrs, np.asarray(mask, dtype=bool))
        addrs = addrs[mask]
    addrs = addrs.reshape(-1).astype(np.uint64, copy=False)
    if addrs.size == 0:
        return
    ranges = (launch.ranges if launch is not None else ()) + _buffer_ranges
    lo, hi = int(addrs.min()), int(addrs.max()) + size
    if any(start <= lo and hi <= end for start, end in ranges):  # the common case: one buffer holds all
        return
    ok = np.zeros(addrs.shape, dtype=bool)
    for start, end in ranges:
        if end - start >= size:
            ok |= (addrs >= np.uint64(start)) & (addrs <= np.uint64(end - size))
    if not ok.all():
        bad = addrs[~ok]
        raise MemoryError(
            f"interpreter bounds check: {what} of {bad.size} element(s) outside every kernel argument and "
            f"registered buffer, first at {int(bad[0]):#x}"
        )


def _check(ptr: Any, mask: Any, what: str) -> None:
    pointee = ptr.dtype.scalar.element_ty
    size = 8 if isinstance(pointee, tl.pointer_type) else max(1, pointee.primitive_bitwidth // 8)
    _check_access(ptr.data, None if mask is None else mask.data, size, what)


def _checked(what: str, ptr_at: int, mask_at: int | None) -> Callable[[Callable], Callable]:
    """Wrapper factory: check the pointer (and mask) at these positional places before the original access."""

    def wrap(orig: Callable) -> Callable:
        def access(self, *args, **kwargs):  # the descriptor path passes cache_policy=, is_volatile= by keyword
            _check(args[ptr_at], None if mask_at is None else args[mask_at], what)
            return orig(self, *args, **kwargs)

        return access

    return wrap


def _checked_rmw(orig: Callable) -> Callable:
    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        _check(ptr, mask, "atomic")
        if rmwOp == _ir.ATOMIC_OP.FADD and _is_bf16(val):
            return _cas_bf16_add(ptr, val, mask)
        return orig(self, rmwOp, ptr, val, mask, sem, scope)

    return create_atomic_rmw


# --------------------------------------------------------------------------------------------------- bf16
def _is_bf16(h: Any) -> bool:
    return isinstance(h, _TH) and h.data.dtype == np.uint16 and h.dtype.scalar == tl.bfloat16


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(x: np.ndarray, rtz: bool = False) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    bits, sixteen = x.view(np.uint32), np.uint32(16)
    # round to nearest even: add 0x7fff plus the lowest kept bit, then truncate; NaNs stay (quiet) NaNs
    bias = np.uint32(0) if rtz else np.uint32(0x7FFF) + ((bits >> sixteen) & np.uint32(1))
    return np.where(np.isnan(x), (bits >> sixteen) | np.uint32(0x40), (bits + bias) >> sixteen).astype(np.uint16)


def _f32(h: Any) -> Any:
    return _TH(_bf16_to_f32(h.data), tl.float32) if _is_bf16(h) else h


def _via_f32(orig: Callable, round_back: bool = True) -> Callable:
    """Wrap a builder op: bf16 operands are computed on in float32, float results rounded back to bf16."""

    def op(self, *args):
        if not any(_is_bf16(a) for a in args):
            return orig(self, *args)
        out = orig(self, *[_f32(a) for a in args])
        if out.data.dtype == np.float32 and round_back:
            return _TH(_f32_to_bf16(out.data), tl.bfloat16)
        return _TH(out.data, tl.int1) if out.data.dtype == np.bool_ else out

    return op


def _cast(orig: Callable) -> Callable:
    """Wrap ``cast_impl``/``create_fp_to_fp`` (which has a rounding mode): casts from or to bf16 go through float32."""

    def cast(self, src, dst_type, *rounding_mode):
        dst = dst_type.scalar
        if not (dst == tl.bfloat16 or _is_bf16(src)):
            return orig(self, src, dst_type, *rounding_mode)
        if src.dtype.scalar.is_fp8():  # the interpreter's own fp8 decoder
            f32 = orig(self, src, tl.float32, *rounding_mode).data
        else:
            f32 = _f32(src).data.astype(np.float32)
        if dst == tl.bfloat16:
            return _TH(_f32_to_bf16(f32, rtz=_ir.ROUNDING_MODE.RTZ in rounding_mode), dst)
        if dst.is_fp8():
            return orig(self, _TH(f32, tl.float32), dst_type, *rounding_mode)
        return _TH(f32.astype(_I._get_np_dtype(dst)), dst)

    return cast


def _cas_bf16_add(ptr: Any, val: Any, mask: Any) -> Any:
    """bf16 atomic add by compare-and-swap on the aligned 32-bit word holding each element (as GPUs emulate 16-bit
    atomics): atomic among threads and among processes sharing the memory. Little-endian, like every host here."""
    shape = np.shape(ptr.data)
    addrs = np.ascontiguousarray(ptr.data, dtype=np.uint64).reshape(-1)
    vals = np.broadcast_to(_bf16_to_f32(val.data), shape).reshape(-1)
    active = np.broadcast_to(np.asarray(True if mask is None else mask.data, dtype=bool), shape).reshape(-1)
    words, shift = addrs & ~np.uint64(3), ((addrs & np.uint64(2)) * np.uint64(8)).astype(np.uint32)
    old = np.zeros(addrs.shape, dtype=np.uint16)
    todo = np.flatnonzero(active)
    seen = _native.load(words[todo], np.ones(todo.shape, bool), np.zeros(todo.shape, np.uint32), np.dtype(np.uint32))
    while todo.size:  # lanes whose word changed meanwhile (another lane, thread or process) retry with its new value
        cur = ((seen >> shift[todo]) & np.uint32(0xFFFF)).astype(np.uint16)
        new = _f32_to_bf16(_bf16_to_f32(cur) + vals[todo]).astype(np.uint32) << shift[todo]
        want = (seen & ~(np.uint32(0xFFFF) << shift[todo])) | new
        got = _native.atomic_cas(words[todo], seen, want, _native.MEM_SEMANTIC.ACQUIRE_RELEASE)
        done = got == seen
        old[todo[done]] = cur[done]
        todo, seen = todo[~done], got[~done]
    return _TH(old.reshape(shape), tl.bfloat16)


def _create_descriptor_reduce(self: Any, kind: Any, desc: Any, value: Any, indices: list) -> None:
    """``tensor_descriptor.atomic_*``: element-wise atomics on the block's in-bounds elements."""
    elem = desc.base.dtype.element_ty
    op = kind.name  # ADD, MIN, MAX, AND, OR, XOR (INC, DEC: not reachable from triton.language)
    if op == "ADD" and elem.is_floating():
        op = "FADD"
    elif op in ("MIN", "MAX") and elem.is_int_unsigned():
        op = "U" + op
    if op not in _ir.ATOMIC_OP.__members__:
        raise NotImplementedError(f"descriptor reduce {kind.name} is not supported in interpreter mode")
    ptrs, mask = desc.materialize_pointers(indices)
    if value.dtype.scalar != elem:
        value = self.cast_impl(value, elem)
    self.create_atomic_rmw(_ir.ATOMIC_OP.__members__[op], ptrs, value, mask, _ir.MEM_SEMANTIC.RELAXED, None)


# Combine functions whose reductions/scans the interpreter runs in numpy (others call the patched element-wise ops).
_NUMPY_REDUCES = ("_sum_combine", "_elementwise_max", "_elementwise_min") + tuple(
    f"_arg{m}_combine_tie_break_{t}" for m in ("min", "max") for t in ("left", "fast")
)
_NUMPY_SCANS = ("_sum_combine", "_prod_combine")


def _retyped(t: Any, data: np.ndarray, dtype: Any) -> Any:
    return tl.core.tensor(_TH(data, dtype), t.type.with_element_ty(dtype))


def _f32_reduce_scan(orig: Callable, numpy_combines: tuple[str, ...]) -> Callable:
    """The numpy fast paths of reductions/scans, on bf16 inputs: in float32, results rounded back to bf16."""

    def apply_impl(self, input):
        was_bf16 = [_is_bf16(t.handle) for t in input]
        if not any(was_bf16) or not any(self.combine_fn is getattr(tl.standard, n) for n in numpy_combines):
            return orig(self, input)
        out = orig(
            self, tuple(_retyped(t, _f32(t.handle).data, tl.float32) if _is_bf16(t.handle) else t for t in input)
        )
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        for i, t in enumerate(out):  # outputs line up with inputs; indices (int32) stay as they are
            if i < len(was_bf16) and was_bf16[i] and t.dtype == tl.float32:
                out[i] = _retyped(t, _f32_to_bf16(t.handle.data), tl.bfloat16)
        return out

    return apply_impl


# --------------------------------------------------------------------------------------------- inline asm
def _asm_key(asm: str) -> str:
    return " ".join(asm.split())


def _asm_result(array: Any, ty: Any) -> Any:
    elem = ty.scalar
    if elem == tl.bfloat16:
        data = _f32_to_bf16(np.asarray(array, dtype=np.float32))
    else:
        data = np.asarray(array).astype(_I._get_np_dtype(elem))
    shape = tuple(ty.shape) if isinstance(ty, tl.block_type) else (1,)
    return _TH(np.ascontiguousarray(np.broadcast_to(data, shape)), elem)


def _create_inline_asm(self: Any, inlineAsm: str, constraints: str, values: list, ty_list: list, isPure, pack) -> Any:
    fn = _asm.get(_asm_key(inlineAsm))
    if fn is None:
        raise NotImplementedError(f"inline asm has no interpreter emulation (see register_asm): {inlineAsm!r}")
    out = fn(*[_f32(v).data for v in values])
    outs = [out] if len(ty_list) == 1 else list(out)  # one array per requested dtype
    results = [_asm_result(o, ty) for o, ty in zip(outs, ty_list, strict=True)]
    return types.SimpleNamespace(get_result=results.__getitem__)  # what the semantic layer reads


# Builder methods wrapped by install(): name -> wrapper factory taking the original.
_BUILDER_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    "create_masked_load": _checked("load", 0, 1),  # (ptrs, mask, other, cache_policy, is_volatile)
    "create_masked_store": _checked("store", 0, 2),  # (ptrs, value, mask, cache_policy)
    "create_atomic_cas": _checked("atomic", 0, None),  # (ptr, cmp, val, sem, scope)
    "create_atomic_rmw": _checked_rmw,
    **dict.fromkeys(("binary_op", "unary_op", "ternary_op", "create_fma", "create_erf", "create_rsqrt"), _via_f32),
    "create_dot": lambda orig: _via_f32(orig, round_back=False),  # the accumulator (fp32) sets the result type
    "cast_impl": _cast,
    "create_fp_to_fp": _cast,
}
