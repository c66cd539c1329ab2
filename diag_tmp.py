import os, sys, time
import torch
import parallelkittens as pk

def per_call(n):
    ctx = pk.context()
    x = torch.ones(1024, device="cuda")
    pt = pk.empty(1024, torch.float32, name="pt")
    out = {}
    for name, fn in [("staged", lambda: pk.ops.all_reduce(x)), ("zero_copy", lambda: pk.ops.all_reduce(pt.local))]:
        fn(); torch.cuda.synchronize(); pk.sync()
        t = time.time()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out[name] = round((time.time() - t) / n * 1e3, 2)
    return out

if __name__ == "__main__":
    for w, backend in ((1, "cuda"), (2, "cuda-shared")):
        t = time.time()
        try:
            print(sys.argv[1], w, pk.spawn(per_call, w, 20, backend=backend, timeout=100), round(time.time() - t, 1), flush=True)
        except Exception as e:
            print(sys.argv[1], w, "failed", str(e)[:500], flush=True)
