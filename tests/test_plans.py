"""Plans (built once per call signature, then only called), the settings object, and the package's layers."""

import ast
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.bench.settings import VARIABLES as BENCH_VARIABLES
from parallelkittens.runtime.settings import VARIABLES, Settings
from parallelkittens.testing import check_close, rank_data, shared_seed

PACKAGE = pathlib.Path(pk.__file__).parent
COSTLY = ("plans", "agreements", "tunings", "heap_blocks", "heap_pools", "allocations")


def _every_op(seed: int, n: int) -> dict:
    """One call of every op on inputs of size `n`; the results, for comparing calls."""
    ctx = pk.context()
    me, world = ctx.local_rank, ctx.local_world_size
    x = rank_data((n, 8), torch.float32, seed, me)
    a = rank_data((8 * n, 16), torch.float16, seed, 10 + me)
    b = rank_data((16, 24), torch.float16, seed, 20 + me)
    return {
        "all_reduce": pk.ops.all_reduce(x), "all_gather": pk.ops.all_gather(x, 1),
        "reduce_scatter": pk.ops.reduce_scatter(torch.cat([x] * world)), "all_to_all": pk.ops.all_to_all(
            torch.cat([x] * world, 1), 1, 0), "matmul": pk.ops.matmul(a, b),
        "all_gather_matmul": pk.ops.all_gather_matmul(a, b), "matmul_reduce_scatter": pk.ops.matmul_reduce_scatter(
            torch.cat([a] * world), b), "matmul_all_reduce": pk.ops.matmul_all_reduce(a, b),
    }


def _second_calls() -> dict:
    ctx = pk.context()
    seed = shared_seed()
    first = _every_op(seed, 5)
    after_first = {k: ctx.stats[k] for k in COSTLY}
    again = _every_op(seed, 5)
    after_second = {k: ctx.stats[k] for k in COSTLY}
    _every_op(seed, 7)  # new shapes: new plans
    after_new = {k: ctx.stats[k] for k in COSTLY}
    pk.sync()
    # the fused reductions add shares in the order they land: equal within rounding, not always bit for bit
    differ = [name for name in first if (check_close(name, again[name], first[name].double(), first[name].dtype,
                                                     "gemm") if "matmul_" in name else
                                         not torch.equal(first[name], again[name]))]
    return {"first": after_first, "second": after_second, "new": after_new, "differ": differ,
            "plans": len(ctx.plans)}


@pytest.mark.parametrize("world", worlds("1,2"))
def test_a_second_call_builds_agrees_tunes_and_allocates_nothing(world, monkeypatch):
    monkeypatch.setenv("PK_INTERPRET_SMS", "12")  # two communicator counts to choose from: the fused ops tune
    for rank, got in enumerate(pk.spawn(_second_calls, world, timeout=600)):
        assert got["second"] == got["first"], (rank, got)
        assert got["first"]["plans"] == 8 == got["plans"] - 8, (rank, got)
        assert got["new"]["plans"] == 16, (rank, got)
        if world > 1:
            assert got["first"]["agreements"] == 7 and got["first"]["tunings"] == 2, (rank, got)  # matmul: local
            assert got["new"]["agreements"] == 14, (rank, got)
        assert not got["differ"], (rank, got["differ"])


def _one_launch_per_call() -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from parallelkittens.runtime import launch

    class TorchOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    me = pk.context().local_rank
    seed = shared_seed()
    small, large = rank_data((100,), torch.float32, seed, me), rank_data((3000, 2), torch.float32, seed, 10 + me)
    pt = pk.empty((3000, 2), torch.float32, name="one_launch")
    pt.local.copy_(large)
    pk.sync()
    calls = {"all_reduce one-shot": lambda: pk.ops.all_reduce(small),
             "all_reduce two-shot": lambda: pk.ops.all_reduce(large),  # 24 KB > PK_ONE_SHOT_BYTES
             "all_reduce out=x": lambda: pk.ops.all_reduce(large, out=large),
             "all_reduce of a parallel tensor": lambda: pk.ops.all_reduce(pt),
             "all_gather": lambda: pk.ops.all_gather(large, 1), "reduce_scatter": lambda: pk.ops.reduce_scatter(large),
             "all_to_all": lambda: pk.ops.all_to_all(large, 0, 1)}
    counted, original = [], launch.Launcher.__call__

    def counting(self, *values):
        counted.append(self.kernel.__name__)
        with _disable_current_modes():
            original(self, *values)

    got = {}
    for name, call in calls.items():
        call()  # builds the plan
        counted.clear()
        launch.Launcher.__call__ = counting
        try:
            with TorchOps() as ops:
                call()
        finally:
            launch.Launcher.__call__ = original
        got[name] = (list(counted), ops.seen)
    pk.sync()
    pt.free()
    return got


@pytest.mark.parametrize("world", worlds("2"))
def test_a_collective_call_is_one_launch(world, monkeypatch):
    # a plain tensor's copy into symmetric memory, and a two-shot all_reduce's two phases, are inside the kernel
    monkeypatch.setenv("PK_ONE_SHOT_BYTES", "4096")
    for rank, got in enumerate(pk.spawn(_one_launch_per_call, world, timeout=600)):
        for name, (launched, ops) in got.items():
            assert launched == ["_pull_kernel"], (rank, name, launched)
            in_place = name in ("all_reduce out=x", "all_reduce of a parallel tensor")
            allocating = [] if in_place else ["aten.empty.memory_format"]
            assert ops == allocating, (rank, name, ops)


def _fused_alone() -> list:
    ctx = pk.context()
    seed = shared_seed()
    a, b = rank_data((40, 16), torch.float16, seed, 1), rank_data((16, 24), torch.float16, seed, 2)
    pk.barrier()  # the job's first collective takes the meeting's heap block
    before = {k: ctx.stats[k] for k in ("heap_blocks", "heap_pools", "tunings")}
    got = [torch.equal(op(a, b), pk.ops.matmul(a, b)) for op in (
        pk.ops.all_gather_matmul, pk.ops.matmul_reduce_scatter, pk.ops.matmul_all_reduce)]
    try:
        pk.ops.matmul_reduce_scatter(a, b[:8])
    except pk.PKError as e:
        got.append(str(e).split(":")[0])
    return got + [{k: ctx.stats[k] - v for k, v in before.items()}]


def test_at_one_rank_the_fused_ops_are_the_plain_gemm():
    # nothing to gather or reduce: no symmetric memory, no tuning, the GEMM's own tiles, the fused op's errors
    (got,) = pk.spawn(_fused_alone, 1)
    assert got == [True, True, True, "matmul_reduce_scatter", {"heap_blocks": 0, "heap_pools": 0, "tunings": 0}]


def _held_plan() -> list[str]:
    ctx = pk.context()
    me, world = ctx.local_rank, ctx.local_world_size
    seed = shared_seed()
    a_parts = [rank_data((6, 16), torch.bfloat16, seed, r) for r in range(world)]
    b = rank_data((16, 8), torch.bfloat16, seed, 99)
    plan = pk.ops.all_gather_matmul.plan(a_parts[me], b, num_comm_sms=1)
    out = torch.full((6 * world, 8), float("nan"), dtype=torch.bfloat16, device=ctx.device)
    built = ctx.stats["plans"]
    result = plan(a_parts[me], b, out=out)
    problems = [] if result is out else ["plan(..., out=c) did not return c"]
    problems.append(check_close("held plan", out, torch.cat([p.double() for p in a_parts]) @ b.double(),
                                torch.bfloat16, "gemm"))
    if pk.ops.all_gather_matmul.plan(a_parts[me], b, num_comm_sms=1) is not plan or ctx.stats["plans"] != built:
        problems.append("the op's lookup did not find the held plan")
    for bad, needle in [((rank_data((7, 16), torch.bfloat16, seed, me), b), "built for"),
                        ((a_parts[me].float(), b.float()), "built for")]:
        try:
            plan(*bad)
            problems.append(f"no error for {bad[0].shape} {bad[0].dtype}")
        except pk.PKError as e:
            if needle not in str(e):
                problems.append(str(e))
    try:
        plan(a_parts[me], b, out=torch.empty(3, 8, dtype=torch.bfloat16, device=ctx.device))
        problems.append("no error for a wrong out")
    except pk.PKError as e:
        if "out must be" not in str(e):
            problems.append(str(e))
    x = rank_data((10,), torch.float32, seed, me)
    reduce = pk.ops.all_reduce.plan(x)
    problems.append(check_close("all_reduce plan", reduce(x, out=x), sum(rank_data((10,), torch.float32, seed, r)
                                                                           .double() for r in range(world)),
                                torch.float32))
    pk.sync()
    return [p for p in problems if p]


@pytest.mark.parametrize("world", worlds("1,3"))
def test_a_held_plan_is_called_without_lookup_and_checks_its_inputs(world):
    for rank, problems in enumerate(pk.spawn(_held_plan, world)):
        assert not problems, (rank, problems)


def _settings() -> tuple:
    s = pk.context().settings
    return s.debug, s.wait_timeout_s, s.one_shot_bytes


def test_settings_are_read_once_into_the_context(monkeypatch):
    monkeypatch.setenv("PK_ONE_SHOT_BYTES", "4096")
    wait = float(os.environ["PK_WAIT_TIMEOUT"])  # conftest's 20 s, or the GPU suite's 60
    assert pk.spawn(_settings, 2) == [(True, wait, 4096)] * 2  # conftest sets PK_DEBUG=1


def test_a_bad_setting_is_named():
    with pytest.raises(pk.PKError, match="PK_DEBUG='yes' is not 0 or 1"):
        Settings.from_env({"PK_DEBUG": "yes"})
    with pytest.raises(pk.PKError, match="PK_TIMEOUT='-1' is not a positive number"):
        Settings.from_env({"PK_TIMEOUT": "-1"})
    assert Settings.from_env({}) == Settings()


def test_ranks_with_different_settings_fail_on_every_rank():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    code = "import parallelkittens as pk\ntry:\n    pk.init()\nexcept pk.PKError as e:\n    print(e)\n"
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PK_ONE_SHOT_BYTES=str(4096 * (rank + 1)), PK_BACKEND="cpu", TRITON_INTERPRET="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        time.sleep(0.5)  # rank 0 serves the store
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert "ranks disagree on how the job runs" in out and "one_shot_bytes=8192" in out, out + err[-2000:]


# ----------------------------------------------------------------------------------------------- the layers
LAYERS = ["runtime", "language", "template", "ops", "nn"]  # each may import only those before it


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules `path` imports, anywhere in it (functions included), as dotted names."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("parallelkittens"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("parallelkittens"))
    return found


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def test_layers_only_point_down():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in LAYERS:
            continue
        mine = LAYERS.index(parts[1])
        for target in _imports(path):
            tparts = target.split(".")
            if len(tparts) > 1 and tparts[1] in LAYERS and LAYERS.index(tparts[1]) > mine:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_nothing_imports_in_a_circle():
    modules = _modules()
    edges = {name: {t for t in _imports(path) if t in modules and t != name and not modules[t].name == "__init__.py"}
             for name, path in modules.items()}
    # Tarjan's strongly connected components: any with two or more modules is a circle
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


_ALONE = """
import importlib, sys, types, pathlib
root = pathlib.Path({root!r})
package = types.ModuleType("parallelkittens")  # the package without its __init__: each module on its own
package.__path__ = [str(root)]
sys.modules["parallelkittens"] = package
importlib.import_module({module!r})
print(sorted(m for m in sys.modules if m.startswith("parallelkittens.") and m.split(".")[1] != "runtime"))
"""


@pytest.mark.parametrize("module", sorted(p.stem for p in (PACKAGE / "runtime").glob("*.py") if p.stem != "__init__"))
def test_each_runtime_module_imports_alone_without_the_language(module):
    code = _ALONE.format(root=str(PACKAGE), module=f"parallelkittens.runtime.{module}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"runtime.{module} pulls in {out.stdout.strip()}"


def test_every_pk_variable_read_in_the_package_is_in_the_readme():
    readme = (PACKAGE.parent / "README.md").read_text()
    listed = set(re.findall(r"^\| `(PK_[A-Z_]+)`", readme, re.M))
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read.update(re.findall(r"\b(PK_[A-Z][A-Z_]+)\b", path.read_text()))
    known = set(VARIABLES) | set(BENCH_VARIABLES)
    assert known <= listed, f"settings missing from the README's tables: {sorted(known - listed)}"
    assert read <= listed, f"PK_* names in the package that the README's table misses: {sorted(read - listed)}"
    assert read <= known | {"PK_TEST_WORLDS", "PK_TEST_CALLS"}, sorted(read - known)


def test_no_module_reads_a_pk_variable_but_settings():
    readers = []
    reading = re.compile(r"environ\.get\([\"']PK_|environ\[[\"']PK_\w+[\"']\](?!\s*=)")  # not writing
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name != "settings.py" and reading.search(text):
            readers.append(str(path.relative_to(PACKAGE)))
    assert readers == [], readers


EXAMPLES = PACKAGE.parent / "examples"


def _new_op() -> list[str]:
    """The recipe's example op (examples/scaled_all_gather.py), declared with no other code: its plan, its custom op
    traced by torch.compile(fullgraph=True), its gradient, and the refusals every op makes."""
    sys.path.insert(0, str(EXAMPLES))
    from scaled_all_gather import ScaledAllGather, scaled_all_gather

    ctx = pk.context()
    me, world = ctx.local_rank, ctx.local_world_size
    seed = shared_seed()
    xs = [rank_data((37,), torch.float32, seed, r) for r in range(world)]
    weights = rank_data((37 * world,), torch.float32, seed, 99)
    want = 2.0 * torch.cat(xs).double()
    want_grad = 2.0 * world * weights[37 * me:37 * (me + 1)].double()  # the gradient of every rank's output
    problems = [check_close("eager", scaled_all_gather(xs[me], 2.0), want, torch.float32)]
    plan = scaled_all_gather.plan(xs[me], 2.0)
    built = [key for key in ctx.plans if key[0] == "scaled_all_gather"]
    problems.append(None if isinstance(plan, ScaledAllGather) else f"plan is a {type(plan).__name__}")
    problems.append(check_close("held plan", plan(xs[me]), want, torch.float32))
    for name, fn in [("eager", lambda t: scaled_all_gather(t, 2.0) * 3),
                     ("compiled", torch.compile(lambda t: scaled_all_gather(t, 2.0) * 3, backend="aot_eager",
                                                fullgraph=True))]:
        leaf = xs[me].clone().requires_grad_()
        out = fn(leaf)
        (out * weights).sum().backward()
        problems += [check_close(f"{name} output", out, 3 * want, torch.float32),
                     check_close(f"{name} gradient", leaf.grad, 3 * want_grad, torch.float32)]
    if [key for key in ctx.plans if key[0] == "scaled_all_gather"] != built:
        problems.append("calls after the first built more plans")
    refused = [(xs[me].int(), "dtype torch.int32 is not supported"),
               (xs[me].view(1, 37), "x must be a 1-D torch.Tensor"), (torch.ones(37, device="meta"), "on meta")]
    if world > 1:
        refused.append((torch.ones(40 + me), "ranks called it differently"))  # a new plan on every rank
    for bad, needle in refused:
        try:
            scaled_all_gather(bad.to(ctx.device) if bad.device.type != "meta" else bad, 2.0)
            problems.append(f"no error for {needle}")
        except pk.PKError as e:
            problems.append(None if needle in str(e) else f"expected {needle!r}: {e}")
    try:
        plan(xs[me][:36])
        problems.append("a held plan took a tensor it was not built for")
    except pk.PKError as e:
        problems.append(None if "this plan was built for contiguous x torch.float32 (37,)" in str(e) else str(e))
    problems.append(check_close("after the refusals", scaled_all_gather(xs[me], 2.0), want, torch.float32))
    pk.sync()
    return [p for p in problems if p]


@pytest.mark.parametrize("world", worlds("1,3"))
def test_a_new_op_is_a_kernel_a_plan_class_and_one_declaration(world):
    for rank, problems in enumerate(pk.spawn(_new_op, world, timeout=600)):
        assert not problems, (rank, problems)


def test_the_recipe_in_the_docs_is_the_example_and_under_60_lines():
    code = (EXAMPLES / "scaled_all_gather.py").read_text()
    assert code in (PACKAGE.parent / "docs" / "plans.md").read_text()
    assert len(code.splitlines()) < 60
