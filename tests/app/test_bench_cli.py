"""`localchat bench`'s arguments, checked before it needs a GPU (the runs themselves:
tests/gpu/test_bench_command.py)."""
import json

import pytest

from localchat.app import bench
from localchat.app.cli import main
from localchat.engine.model_configs import CONFIG_DIR
from localchat.engine.spec import ModelSpec


def test_bench_refuses_a_chunk_that_is_no_size(capsys):
    assert main(["bench", "glm-4.5v-fp8", "--dummy", "--chunk", "0"]) == 2
    assert "--chunk must be a positive number of tokens, got 0" in capsys.readouterr().err


def test_bench_hands_its_chunk_to_the_engine(monkeypatch):
    # the step budget reaches the engine as max_batch_tokens; unset, the engine keeps its own
    seen = []

    class Recorded:
        @staticmethod
        def from_model(*args, **kwargs):
            seen.append(kwargs["max_batch_tokens"])

    monkeypatch.setattr("localchat.engine.runtime.engine.Engine", Recorded)
    monkeypatch.setattr("localchat.app.bench_prompts.SyntheticPrompts", lambda spec, n: None)
    spec = ModelSpec.from_config(json.loads((CONFIG_DIR / "gpt-oss-20b.json").read_text()))
    for chunk in (4096, None):
        bench.make_engine(spec, None, 0, 512, 16, 1, 0, chunk)
    assert seen == [4096, None]


def test_bench_help_names_the_chunk(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--chunk TOKENS" in capsys.readouterr().out
