"""Downloads against the local fake Hub: clean pull, cache hit without network, resume after a cut
(same call, new call, killed process), checksum refusal, 404, gated repo, full disk, offline."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fakehub import FakeHub, FakeRepo, isolate_hf_env, tiny_checkpoint
from localchat.engine.hub import (AccessDenied, ChecksumMismatch, DownloadFailed, ModelNotFound,
                                  NotEnoughDisk, OfflineMissing, ensure_local, sync)
from localchat.engine.hub_cache import CachedRepo
from localchat.engine.spec import ModelSpec

REPO = "openai/gpt-oss-20b"  # a registry repo, so the registry's patterns apply
SHARD = "model-00000-of-00001.safetensors"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    hub = FakeHub().start()
    files = tiny_checkpoint()
    hub.add(FakeRepo(REPO, files))
    hub.add(FakeRepo("org/gated-model", tiny_checkpoint(seed=1), sha="f" * 40, gated=True))
    cache = isolate_hf_env(monkeypatch, tmp_path, hub)
    yield hub, files, cache
    hub.stop()


def _fast(**kw):
    return dict(progress_bar=False, backoff_s=0.0, **kw)


def test_clean_pull_then_cache_hit_makes_no_requests(fake):
    hub, files, cache = fake
    events = []
    path = ensure_local("gpt-oss-20b", on_progress=events.append, **_fast())
    assert path == cache / "models--openai--gpt-oss-20b" / "snapshots" / FakeRepo(REPO, {}).sha
    wanted = {"config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja",
              SHARD, "model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert present == wanted  # original/, metal/ and README.md are not fetched
    for name in wanted:
        assert (path / name).read_bytes() == files[name]
        assert (path / name).is_symlink()
    assert ModelSpec.from_dir(path).num_layers == 24
    assert set(load_file(path / SHARD)) == {"model.layers.0.mlp.experts.down_proj_blocks", "model.embed_tokens.weight"}
    fetched = [r for r in hub.log if "/resolve/" in r.path]
    assert not any("original/" in r.path or "metal/" in r.path for r in fetched)
    total = sum(len(files[n]) for n in wanted)
    assert events[-1].overall_done == events[-1].overall_total == total
    assert events[-1].files_done == events[-1].files_total == len(wanted)
    shard_events = [e for e in events if e.file == SHARD]
    assert [e.done for e in shard_events] == sorted(e.done for e in shard_events)
    assert shard_events[-1].done == shard_events[-1].total == len(files[SHARD])

    before = len(hub.log)
    again = sync("openai/gpt-oss-20b", **_fast())
    assert again.path == path and again.from_cache and again.fetched_bytes == 0
    assert len(hub.log) == before  # no network at all


def test_cut_transfer_resumes_in_a_new_call_without_refetching(fake):
    hub, files, _ = fake
    size = len(files[SHARD])
    cut_at = size // 2 + 12345
    hub.cut[SHARD] = cut_at
    with pytest.raises(DownloadFailed, match="run the same command again to resume") as err:
        sync("gpt-oss-20b", **_fast(retries=0))
    assert SHARD in str(err.value)
    repo = CachedRepo.of(REPO)
    sha256 = hashlib.sha256(files[SHARD]).hexdigest()
    assert repo.partial(sha256).stat().st_size == cut_at
    assert not repo.blob(sha256).exists()

    path = ensure_local("gpt-oss-20b", **_fast())
    shard_gets = [r for r in hub.requests_for(SHARD) if r.method == "GET"]
    assert [r.range for r in shard_gets] == [None, f"bytes={cut_at}-"]
    assert shard_gets[1].status == 206
    assert sum(r.body_bytes for r in shard_gets) == size  # bytes before the cut were not fetched again
    assert (path / SHARD).read_bytes() == files[SHARD]


def test_dropped_connection_is_retried_within_the_call(fake):
    hub, files, _ = fake
    hub.cut[SHARD] = 1_000_000
    path = ensure_local("gpt-oss-20b", **_fast(retries=2))
    ranges = [r.range for r in hub.requests_for(SHARD) if r.method == "GET"]
    assert ranges == [None, "bytes=1000000-"]
    assert (path / SHARD).read_bytes() == files[SHARD]


def test_killed_process_resumes_in_another_process(fake, tmp_path):
    hub, files, _ = fake
    size = len(files[SHARD])
    stall_at = 1_500_000
    release = threading.Event()
    hub.stall[SHARD] = (stall_at, release)
    code = ("from localchat.engine.hub import ensure_local\n"
            "ensure_local('gpt-oss-20b', progress_bar=False, max_workers=1)\n")
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    partial = CachedRepo.of(REPO).partial(hashlib.sha256(files[SHARD]).hexdigest())
    deadline = time.time() + 20
    while not (partial.exists() and partial.stat().st_size == stall_at):
        assert child.poll() is None, child.stdout.read().decode()
        assert time.time() < deadline, "the child never reached the stall point"
        time.sleep(0.02)
    child.kill()
    child.wait()
    release.set()
    del hub.stall[SHARD]

    path = ensure_local("gpt-oss-20b", **_fast())
    gets = [r for r in hub.requests_for(SHARD) if r.method == "GET"]
    assert gets[-1].range == f"bytes={stall_at}-"
    assert gets[-1].body_bytes == size - stall_at
    assert (path / SHARD).read_bytes() == files[SHARD]


def test_content_not_matching_sha256_is_refused_and_not_used(fake):
    hub, files, _ = fake
    bad = bytearray(files[SHARD])
    bad[len(bad) // 2] ^= 0xFF
    hub.serve_instead[SHARD] = bytes(bad)
    with pytest.raises(ChecksumMismatch) as err:
        sync("gpt-oss-20b", **_fast(max_workers=1))
    message = str(err.value)
    assert SHARD in message and "not used" in message and hashlib.sha256(files[SHARD]).hexdigest() in message
    repo = CachedRepo.of(REPO)
    sha256 = hashlib.sha256(files[SHARD]).hexdigest()
    assert not repo.blob(sha256).exists() and not repo.partial(sha256).exists()
    assert not (repo.snapshot(FakeRepo(REPO, {}).sha) / SHARD).exists()
    with pytest.raises(OfflineMissing, match=SHARD):  # the refused file is not part of the cache
        ensure_local("gpt-oss-20b", offline=True)

    del hub.serve_instead[SHARD]
    path = ensure_local("gpt-oss-20b", **_fast())
    assert (path / SHARD).read_bytes() == files[SHARD]


def test_verify_replaces_a_corrupted_cached_file(fake):
    hub, files, _ = fake
    path = ensure_local("gpt-oss-20b", **_fast())
    blob = (path / SHARD).resolve()
    blob.write_bytes(b"\0" * len(files[SHARD]))  # same size, wrong content: only a hash can tell
    fixed = sync("gpt-oss-20b", verify=True, **_fast())
    assert (fixed.path / SHARD).read_bytes() == files[SHARD]
    assert fixed.fetched_bytes == len(files[SHARD])


def test_wrong_repo_is_a_404_naming_the_repo_and_the_registry(fake):
    with pytest.raises(ModelNotFound) as err:
        ensure_local("nobody/no-such-model", **_fast())
    message = str(err.value)
    assert "nobody/no-such-model" in message and "gpt-oss-20b" in message and "glm-4.5v-fp8" in message


def test_gated_repo_without_access_says_how_to_get_it(fake, monkeypatch):
    hub, _, _ = fake
    with pytest.raises(AccessDenied) as err:
        ensure_local("org/gated-model", **_fast())
    message = str(err.value)
    assert "hf auth login" in message and "accept the license" in message and f"{hub.url}/org/gated-model" in message

    with pytest.raises(AccessDenied, match="token has no access"):
        ensure_local("org/gated-model", token="hf_wrong", **_fast())

    monkeypatch.setenv("HF_TOKEN", "hf_good_token")
    path = ensure_local("org/gated-model", **_fast())
    assert (path / "config.json").is_file()
    assert all(r.auth for r in hub.log if "gated-model/resolve/" in r.path and r.status == 200)


def test_full_disk_is_refused_before_downloading(fake, monkeypatch):
    hub, _, _ = fake
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 1_000_000, 1_000_000))
    with pytest.raises(NotEnoughDisk) as err:
        ensure_local("gpt-oss-20b", **_fast())
    message = str(err.value)
    need = sum(len(d) for n, d in tiny_checkpoint().items() if "/" not in n and n != "README.md")
    assert "gpt-oss-20b" in message and f"{need / 1e6:.1f} MB more are needed" in message
    assert "1.0 MB are free" in message
    assert "HF_HUB_CACHE" in message
    assert not [r for r in hub.log if "/resolve/" in r.path]


def test_offline_uses_the_cache_only(fake, monkeypatch):
    hub, files, cache = fake
    with pytest.raises(OfflineMissing) as err:
        ensure_local("gpt-oss-20b", offline=True)
    assert "not in the cache" in str(err.value) and "localchat pull gpt-oss-20b" in str(err.value)
    assert hub.log == []

    path = ensure_local("gpt-oss-20b", **_fast())
    before = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ensure_local("gpt-oss-20b") == path
    (path / "model-00001-of-00001.safetensors").resolve().unlink()  # the blob itself is gone
    with pytest.raises(OfflineMissing) as err:
        ensure_local("gpt-oss-20b")
    assert "model-00001-of-00001.safetensors" in str(err.value) and "1 file(s)" in str(err.value)
    assert len(hub.log) == before

    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert ensure_local("gpt-oss-20b", **_fast()) == path  # online again: the one missing file is fetched
    assert [r.path.rsplit("/", 1)[-1] for r in hub.log[before:] if "/resolve/" in r.path] == \
        ["model-00001-of-00001.safetensors"]


def test_offline_works_with_a_cache_written_by_an_older_huggingface_hub(fake, monkeypatch):
    hub, files, _ = fake
    path = ensure_local("gpt-oss-20b", **_fast())
    for tree in (CachedRepo.of(REPO).folder / "trees").iterdir():
        tree.unlink()  # no stored listing: fall back to config + the shards the index names
    assert ensure_local("gpt-oss-20b", offline=True) == path
    (path / SHARD).unlink()
    with pytest.raises(OfflineMissing, match=SHARD):
        ensure_local("gpt-oss-20b", offline=True)


def test_local_directory_is_used_as_is(tmp_path, fake):
    hub, _, _ = fake
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert ensure_local(str(tmp_path / "ckpt")) == (tmp_path / "ckpt").resolve()
    assert hub.log == []


def test_cache_is_shared_with_huggingface_hub_both_ways(fake):
    from huggingface_hub import hf_hub_download, snapshot_download
    hub, files, cache = fake
    root_files = [n for n in files if "/" not in n and n != "README.md"]
    theirs = snapshot_download(REPO, endpoint=hub.url, cache_dir=cache, allow_patterns=root_files)
    before = len(hub.log)
    assert ensure_local("gpt-oss-20b", offline=True) == Path(theirs)
    assert len(hub.log) == before

    other = FakeRepo("org/other", tiny_checkpoint(seed=2), sha="a" * 40)
    hub.add(other)
    ours = ensure_local("org/other", **_fast())
    found = hf_hub_download("org/other", SHARD, cache_dir=cache, local_files_only=True)
    assert Path(found) == ours / SHARD and Path(found).read_bytes() == other.files[SHARD]
