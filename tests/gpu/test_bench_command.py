"""`localchat bench --dummy` on a truncated model, end to end on the GPU."""
import json

import pytest

from localchat.app.cli import main


@pytest.mark.gpu
def test_bench_writes_rows_against_the_floor(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "gpt-oss-20b", "--dummy", "--layers", "2", "--batch", "1,4", "--prompt-len", "64",
                 "--gen-len", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(0 < r["floor_ratio"] < 1.5 and r["tok_s_total"] > 0 for r in rows)
