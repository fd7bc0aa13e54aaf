"""Broken checkpoints: each problem is one CheckpointError naming the file or tensor and the fix,
raised before any tensor data is read."""
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import open_fixture  # noqa: E402

from localchat.engine.weights.errors import CheckpointError  # noqa: E402
from localchat.engine.weights.loader import load_weights, read_spec  # noqa: E402

INDEX = "model.safetensors.index.json"


def copy(name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(open_fixture(name), dst)
    return dst


def shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][tensor]


def edit(ckpt: Path, file: Path, change) -> None:
    """Rewrite one file with change(tensors) applied, keeping the index in step."""
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    index = ckpt / INDEX
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != file.name or k in tensors}
        idx["weight_map"].update({k: file.name for k in tensors})
        index.write_text(json.dumps(idx))


def load_error(ckpt: Path, **kw) -> str:
    calls = []
    with pytest.raises(CheckpointError) as e:
        load_weights(ckpt, read_spec(ckpt), on_progress=lambda *a: calls.append(a), model_id="org/tiny", **kw)
    assert calls == [], "data was read before the checkpoint was validated"
    return str(e.value)


def test_missing_shard(tmp_path):
    ckpt = copy("glm-bf16", tmp_path)
    (ckpt / "model-00003-of-00005.safetensors").unlink()
    msg = load_error(ckpt)
    assert "model-00003-of-00005.safetensors" in msg and "missing" in msg and "localchat pull org/tiny" in msg


def test_truncated_last_shard_is_caught_before_reading(tmp_path):
    ckpt = copy("glm-bf16", tmp_path)
    last = ckpt / "model-00005-of-00005.safetensors"
    data = last.read_bytes()
    last.write_bytes(data[:-100])
    msg = load_error(ckpt)
    assert "model-00005-of-00005.safetensors is truncated" in msg and "tensor model." in msg
    assert "localchat pull org/tiny" in msg


@pytest.mark.parametrize("damage", ["json", "length", "offsets", "short"])
def test_corrupt_header(tmp_path, damage):
    ckpt = copy("gpt-oss-bf16", tmp_path)
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "json":
        data[8:12] = b"\x00\xffxx"
    elif damage == "length":
        data[:8] = struct.pack("<Q", len(data) * 4)
    elif damage == "offsets":
        header = json.loads(data[8:8 + n])
        name = sorted(k for k in header if k != "__metadata__")[0]
        header[name]["data_offsets"][1] += 2
        raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
        assert len(raw) == n
        data[8:8 + n] = raw
    else:
        data = data[:5]
    f.write_bytes(bytes(data))
    msg = load_error(ckpt)
    assert str(f) in msg and ("corrupt" in msg or "truncated" in msg) and "localchat pull" in msg


def test_missing_tensor(tmp_path):
    ckpt = copy("glm-bf16", tmp_path)
    name = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    edit(ckpt, shard_of(ckpt, name), lambda t: t.pop(name))
    msg = load_error(ckpt)
    assert name in msg and "missing" in msg and str(ckpt) in msg


def test_index_lists_a_tensor_the_shard_lacks(tmp_path):
    ckpt = copy("glm-bf16", tmp_path)
    name = "model.language_model.layers.0.self_attn.k_proj.weight"
    file = shard_of(ckpt, name)
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, str(file))  # the index still names it
    msg = load_error(ckpt)
    assert name in msg and file.name in msg


def test_wrong_shape(tmp_path):
    ckpt = copy("gpt-oss-bf16", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    edit(ckpt, ckpt / "model.safetensors", lambda t: t.update({name: t[name][:-1].clone()}))
    msg = load_error(ckpt)
    assert name in msg and "[31, 64]" in msg and "[32, 64]" in msg and "model.safetensors" in msg


def test_wrong_dtype(tmp_path):
    ckpt = copy("gpt-oss-mxfp4", tmp_path)
    name = "model.layers.0.input_layernorm.weight"
    edit(ckpt, shard_of(ckpt, name), lambda t: t.update({name: t[name].to(torch.int32)}))
    msg = load_error(ckpt)
    assert name in msg and "I32" in msg and "BF16" in msg


def test_mxfp4_blocks_wrong_dtype(tmp_path):
    ckpt = copy("gpt-oss-mxfp4", tmp_path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    edit(ckpt, shard_of(ckpt, name), lambda t: t.update({name: t[name].to(torch.int16)}))
    msg = load_error(ckpt)
    assert name in msg and "U8" in msg


def test_fp8_weight_without_scale(tmp_path):
    ckpt = copy("glm-fp8-channel", tmp_path)
    scale = "model.language_model.layers.1.mlp.experts.3.down_proj.weight_scale"
    edit(ckpt, shard_of(ckpt, scale), lambda t: t.pop(scale))
    msg = load_error(ckpt)
    assert scale in msg and "no scale" in msg and "experts.3.down_proj.weight" in msg


def test_fp8_scale_of_the_wrong_layout(tmp_path):
    ckpt = copy("glm-fp8-block", tmp_path)
    scale = "model.language_model.layers.0.mlp.down_proj.weight_scale_inv"
    edit(ckpt, shard_of(ckpt, scale), lambda t: t.update({scale: torch.ones(64, 1)}))
    msg = load_error(ckpt)
    assert scale in msg and "[64, 1]" in msg and "[1, 2]" in msg and "block" in msg


def test_fp8_weight_in_a_checkpoint_without_fp8_config(tmp_path):
    ckpt = copy("glm-fp8-channel", tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = load_error(ckpt)
    assert "float8" in msg and "quantization_config" in msg


def test_unknown_quant_method(tmp_path):
    ckpt = copy("glm-fp8-channel", tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        read_spec(ckpt)
    assert "awq" in str(e.value) and str(ckpt / "config.json") in str(e.value)


def test_unexpected_tensor_reported_unless_harmless(tmp_path):
    ckpt = copy("gpt-oss-bf16", tmp_path)
    harmless = {"model.layers.7.mlp.router.weight": torch.zeros(4, 64),  # past num_layers (MTP-style)
                "model.rotary_emb.inv_freq": torch.zeros(8)}
    edit(ckpt, ckpt / "model.safetensors", lambda t: t.update(harmless))
    load_weights(ckpt, read_spec(ckpt))
    edit(ckpt, ckpt / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.experts.extra": torch.zeros(3)}))
    msg = load_error(ckpt)
    assert "unexpected" in msg and "model.layers.0.mlp.experts.extra" in msg
    relaxed = load_weights(ckpt, read_spec(ckpt), strict=False)
    assert "model.layers.0.mlp.experts.extra" not in relaxed


def test_no_weights_at_all(tmp_path):
    ckpt = copy("gpt-oss-bf16", tmp_path)
    (ckpt / "model.safetensors").unlink()
    msg = load_error(ckpt)
    assert "no .safetensors files" in msg and str(ckpt) in msg


def test_error_carries_file_and_tensor(tmp_path):
    ckpt = copy("gpt-oss-bf16", tmp_path)
    name = "model.norm.weight"
    edit(ckpt, ckpt / "model.safetensors", lambda t: t.update({name: t[name][:10].clone()}))
    with pytest.raises(CheckpointError) as e:
        load_weights(ckpt, read_spec(ckpt))
    assert e.value.tensor == name and e.value.file == ckpt / "model.safetensors"
