"""bench.py runs end to end on CPU at small sizes, so a broken benchmark shows up in CI, not on the GPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode", [[], ["--prefix", "--prefix-len", "48"], ["--latency"], ["--cpu-profile"],
                                  ["--compare", "hf"]],
                         ids=["standard", "prefix", "latency", "cpu-profile", "compare-hf"])
def test_bench_smoke(tmp_path, mode):
    """Guards against bench.py modes that crash or report tokens they did not generate."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "bench.py"), "--arch", "tiny", "--num-seqs", "4", "--max-input-len", "40",
           "--max-output-len", "8", "--json", str(out), *mode]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())
    expected = {"--prefix": 4 * 64, "--latency": 256}.get(mode[0] if mode else None, None)
    for row in rows:
        assert row["requests"] in (1, 4) and row["tok_per_s"] > 0
        if expected:
            assert row["output_tokens"] == expected
    if mode[:1] == ["--compare"]:  # the peer generated exactly the same number of tokens
        assert len(rows) == 2 and rows[0]["output_tokens"] == rows[1]["output_tokens"]
