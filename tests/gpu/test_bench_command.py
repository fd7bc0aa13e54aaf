"""`localchat bench --dummy` on truncated models, end to end on the GPU."""
import json

import pytest

from localchat.app.cli import main


@pytest.mark.gpu
def test_bench_serves_batches_and_compares_with_transformers(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "gpt-oss-20b", "--dummy", "--layers", "2", "--batch", "1,4", "--prompt-len", "64",
                 "--gen-len", "16", "--compare", "transformers", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    assert all(0 < r["floor_ratio"] < 1.5 and r["tok_s_total"] > 0 and r["graph_ms"] > 0 for r in result["rows"])
    assert result["compare"]["layers"] == 2 and result["compare"]["transformers_tok_s"] > 0


@pytest.mark.gpu
def test_bench_times_an_image_prompt(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "glm-4.5v-fp8", "--dummy", "--layers", "2", "--batch", "2", "--prompt-len", "32",
                 "--gen-len", "8", "--image", "448x336", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    img = result["image"]
    assert img["prompt_tokens"] == (336 // 14) * (448 // 14) // 4 + 2 + 50  # image tokens, markers, question
    assert img["image_encode_ms"] > 0 and img["ttft_ms"] >= img["image_encode_ms"]
