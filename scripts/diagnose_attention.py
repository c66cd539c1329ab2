"""Print the attention tests' failures as each case finishes (the GPU run's quick look at errors)."""

import sys
import time

import torch

sys.path.insert(0, "tests")
import test_attention as T  # noqa: E402

import parallelkittens as pk  # noqa: E402

if __name__ == "__main__":
    what = sys.argv[1:] or ["gpu2", "ring2", "flash"]
    for name in what:
        start = time.time()
        if name == "flash":
            result = pk.spawn(T._flash_cases, 1)
        elif name.startswith("ring"):
            result = pk.spawn(T._ring_cases, int(name[4:]), 64, 4, 2, torch.float32, timeout=300)
        elif name.startswith("gpu"):
            result = pk.spawn(T._gpu_bf16_and_graph, int(name[3:]), 25, timeout=300)
        print(f"== {name} ({time.time() - start:.0f} s):", result[0] or "ok", flush=True)
