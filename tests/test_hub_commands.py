"""`localchat pull | list | rm | doctor` through an argparse parser built here, against the fake Hub."""
from __future__ import annotations

import argparse
import io

import pytest

from fakehub import FakeHub, FakeRepo, isolate_hf_env, tiny_checkpoint
from localchat.app import model_commands
from localchat.engine.hub import DownloadFailed, sync
from localchat.engine.planner import GpuInfo

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 81559 << 20, 80000 << 20, 0, (9, 0))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    hub = FakeHub().start()
    hub.add(FakeRepo("openai/gpt-oss-20b", tiny_checkpoint()))
    hub.add(FakeRepo("org/gated-model", tiny_checkpoint(seed=1), sha="f" * 40, gated=True))
    cache = isolate_hf_env(monkeypatch, tmp_path, hub)
    monkeypatch.setattr(model_commands, "local_gpus", lambda: [H100])
    yield hub, cache
    hub.stop()


def run(capsys, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="localchat")
    model_commands.add_model_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_pull_then_pull_again(fake, capsys):
    hub, cache = fake
    code, out, err = run(capsys, "pull", "gpt-oss-20b")
    assert code == 0, err
    assert "gpt-oss-20b: downloaded" in out and str(cache / "models--openai--gpt-oss-20b" / "snapshots") in out
    assert "fits on 1 GPU" in out  # planned from the downloaded headers and config.json
    before = len(hub.log)
    code, out, _ = run(capsys, "pull", "openai/gpt-oss-20b", "--offline")
    assert code == 0 and "already complete in the cache" in out and len(hub.log) == before


def test_pull_errors_are_one_line_without_traceback(fake, capsys):
    for argv, needle in ((("pull", "gpt-oss-20b", "--offline"), "localchat pull gpt-oss-20b"),
                         (("pull", "gpt-oss-20"), "did you mean gpt-oss-20b"),
                         (("pull", "nobody/nothing"), "was not found"),
                         (("pull", "org/gated-model"), "hf auth login")):
        code, out, err = run(capsys, *argv)
        assert code == 1 and needle in err, (argv, err)
        assert err.startswith("localchat: ") and err.count("\n") == 1 and "Traceback" not in err


def test_list_shows_complete_and_partial_models(fake, capsys):
    hub, _ = fake
    code, out, _ = run(capsys, "list")
    assert code == 0 and "no models in the cache" in out
    hub.add(FakeRepo("org/other", tiny_checkpoint(seed=3), sha="b" * 40))
    hub.cut["model-00000-of-00001.safetensors"] = 1_000_000
    with pytest.raises(DownloadFailed):
        sync("org/other", progress_bar=False, retries=0, max_workers=1)
    assert run(capsys, "pull", "gpt-oss-20b")[0] == 0
    code, out, _ = run(capsys, "list", "--all")
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "complete" in rows["gpt-oss-20b"] and "yes, 1 GPU" in rows["gpt-oss-20b"]
    assert "incomplete (4 files missing), 1.0 MB partial" in rows["org/other"]  # the shard cut at 1 MB and the 3 after it
    assert "not downloaded" in rows["glm-4.5v"] and "~215.5 GB" in rows["glm-4.5v"]
    assert "not downloaded" in rows["gpt-oss-120b"] and "yes, 1 GPU" in rows["gpt-oss-120b"]


def test_rm_asks_unless_yes(fake, capsys, monkeypatch):
    _, cache = fake
    assert run(capsys, "pull", "gpt-oss-20b")[0] == 0
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal: no prompt possible
    code, _, err = run(capsys, "rm", "gpt-oss-20b")
    assert code == 1 and "pass --yes" in err
    assert (cache / "models--openai--gpt-oss-20b").is_dir()
    code, out, _ = run(capsys, "rm", "gpt-oss-20b", "--yes")
    assert code == 0 and "removed gpt-oss-20b" in out and "MB freed" in out
    assert not (cache / "models--openai--gpt-oss-20b").exists()
    code, _, err = run(capsys, "rm", "gpt-oss-20b", "--yes")
    assert code == 1 and "not in the cache" in err


def test_doctor_reports_the_machine_and_what_fits(fake, capsys):
    _, cache = fake
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    for needle in ("torch", "triton", "transformers", "huggingface_hub", "driver", "free disk",
                   f"{cache} (from HF_HUB_CACHE)", "hub token", "none (gated or private models need"):
        assert needle in out, needle
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 79.6 GiB total" in out
    fits = {line.split()[0]: line for line in out.split("models (")[1].splitlines()[2:]}
    assert "fits on 1 GPU" in fits["gpt-oss-120b"] and "does not fit" in fits["glm-4.5v"]
    code, out, _ = run(capsys, "doctor", "--assume-gpus", "2x141")
    assert code == 0 and "glm-4.5v      ~215.5 GB  fits on 2 GPUs" in out
    code, _, err = run(capsys, "doctor", "--assume-gpus", "lots")
    assert code == 1 and "--assume-gpus wants NxGB" in err


def test_doctor_says_fp8_needs_a_newer_gpu(fake, capsys, monkeypatch):
    a100 = [GpuInfo("NVIDIA A100-SXM4-80GB", 81920 << 20, 81000 << 20, i, (8, 0)) for i in range(2)]
    monkeypatch.setattr(model_commands, "local_gpus", lambda: a100)
    code, out, _ = run(capsys, "doctor")
    fits = {line.split()[0]: line for line in out.split("models (")[1].splitlines()[2:]}
    assert code == 0 and "FP8 weights need a GPU of compute capability 8.9" in fits["glm-4.5v-fp8"]
    assert "fits on 1 GPU" in fits["gpt-oss-120b"] and "--quantize" not in fits["glm-4.5v"]


def test_needs_table_has_a_row_per_model():
    table = model_commands.needs_table().splitlines()
    assert len(table) == 2 + 4
    glm = next(r for r in table if r.startswith("| glm-4.5v |"))
    assert "--quantize fp8: 1 GPU, ctx 65536" in glm  # one H200 with FP8 at load
