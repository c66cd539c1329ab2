"""The examples run as their docstrings say."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ring_push_example():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ring_push.py")], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PK_DEBUG="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[4.0, 1.0, 2.0, 3.0]"


def test_ring_push_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "ring_push.py"), "--torchrun"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PK_DEBUG="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    # two processes share stdout, so their lines may interleave: look for the two values anywhere
    assert sorted(re.findall(r"\d\.0", out.stdout)) == ["1.0", "2.0"], out.stdout


def test_tp_mlp_example_trains_like_torch():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tp_mlp.py"), "--ranks", "2", "--steps", "3"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PK_DEBUG="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "losses agree to bf16 precision: True", out.stdout
