"""lwm's Triton kernels compile for an H100 (sm_90) on this machine without its GPU (Triton's bundled ptxas), at the
shapes the model runs and at the largest tiles ``triton_attention.fits`` admits, without spilling registers and
within the shared memory an sm_90 block has (``benchmarks/triton_kernels.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90_without_spilling(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    shapes = ["16,0,64", "15,1,64", "1,15,64", "64,0,64", "32,0,64", "16,0,16"]  # base, rollout, generation, limits
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_kernels.py"), "--arch", "90",
                             "--shapes", *shapes], capture_output=True, text=True, env=env, timeout=580)
    if result.returncode == 2:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("fwd |", "bwd |"))]
    # forward and backward x (4 masks, or causal with and without a window after cached positions) for each
    # admitted shape and dtype: bf16 all six, fp32 all but 64 x 64
    masks = {"16,0,64": 4, "15,1,64": 2, "1,15,64": 2, "64,0,64": 4, "32,0,64": 4, "16,0,16": 4}
    assert len(rows) == 2 * (2 * sum(masks.values()) - masks["64,0,64"])
    assert "all compiled without spilling" in result.stdout
