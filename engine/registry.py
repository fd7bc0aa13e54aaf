"""The models localchat knows by name, and `resolve()`: name, Hub repo id or local directory -> source.

Sizes are computed from the tensor tables of the real checkpoints (shapes from their config.json,
dtypes from the published tensor listings); GLM-4.5V bf16 and gpt-oss-20b match the published
totals (200.63 GiB / 18,106 tensors and 12.82 GiB / 459 tensors). The FP8 figure assumes a bf16
[rows, 1] scale per quantized row and is an estimate until checked against the real files.
Only the root Hugging Face format files are downloaded: gpt-oss repos also carry `original/`
(OpenAI's own layout) and `metal/`, which would double the download.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from .planner import GpuInfo, KvLayout, Plan, WeightBytes, plan

# Root files a checkpoint needs: weights, their index, configs, tokenizer, chat template, processor.
ALLOW_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
IGNORE_PATTERNS = ("original/*", "metal/*", "*/*")  # root files only
# Tokenizer, templates and configs on top of the weights (tokenizer.json is ~7-28 MB).
_SMALL_FILES_BYTES = 30_000_000
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UnknownModel(ValueError):
    pass


@dataclass(frozen=True)
class RegistryEntry:
    """A named model. weights: bytes and tensor-parallel split; kv: what its KV cache holds."""

    name: str
    repo_id: str
    format: str  # "bf16" | "fp8" | "mxfp4"
    description: str
    weights: WeightBytes
    kv: KvLayout
    alternative: str | None = None  # smaller sibling to suggest when this one does not fit
    allow_patterns: tuple[str, ...] = ALLOW_PATTERNS
    ignore_patterns: tuple[str, ...] = IGNORE_PATTERNS

    @property
    def weight_bytes(self) -> int:
        return self.weights.total

    @property
    def download_bytes(self) -> int:
        """Approximate: weights plus the small files."""
        return self.weights.total + _SMALL_FILES_BYTES

    def plan(self, gpus: list[GpuInfo], **kwargs) -> Plan:
        kwargs.setdefault("alternative", self.alternative)
        return plan(self.kv, self.weights, gpus, fp8=self.format == "fp8", **kwargs)


_GLM_KV = KvLayout(full_layers=46, sliding_layers=0, kv_heads=8, head_dim=128, max_context=65536)
_GPT_OSS_20B_KV = KvLayout(full_layers=12, sliding_layers=12, kv_heads=8, head_dim=64,
                           max_context=131072, sliding_window=128)
_GPT_OSS_120B_KV = KvLayout(full_layers=18, sliding_layers=18, kv_heads=8, head_dim=64,
                            max_context=131072, sliding_window=128)

REGISTRY: dict[str, RegistryEntry] = {e.name: e for e in (
    RegistryEntry(
        "glm-4.5v", "zai-org/GLM-4.5V", "bf16", "GLM-4.5V vision-language MoE, 106B (12B active), bf16",
        WeightBytes(total=215_421_877_760, replicated=1_765_334_528, fp8_numel=105_586_098_176,
                    fp8_rows=40_998_016, fp8_source_bytes=211_172_196_352),
        _GLM_KV, alternative="glm-4.5v-fp8"),
    RegistryEntry(
        "glm-4.5v-fp8", "zai-org/GLM-4.5V-FP8", "fp8", "GLM-4.5V with FP8 linear weights (channel scales)",
        WeightBytes(total=109_917_775_616, replicated=1_765_334_528), _GLM_KV),
    RegistryEntry(
        "gpt-oss-20b", "openai/gpt-oss-20b", "mxfp4", "gpt-oss 21B (3.6B active), MXFP4 experts, text only",
        WeightBytes(total=13_761_264_768, replicated=4_707_456), _GPT_OSS_20B_KV),
    RegistryEntry(
        "gpt-oss-120b", "openai/gpt-oss-120b", "mxfp4", "gpt-oss 117B (5.1B active), MXFP4 experts, text only",
        WeightBytes(total=65_248_815_744, replicated=26_971_776), _GPT_OSS_120B_KV, alternative="gpt-oss-20b"),
)}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. kind: "registry" | "hub" (any repo id) | "local" (a directory)."""

    kind: str
    name: str
    repo_id: str | None = None
    revision: str | None = None
    local_path: Path | None = None
    entry: RegistryEntry | None = None
    allow_patterns: tuple[str, ...] = ALLOW_PATTERNS
    ignore_patterns: tuple[str, ...] = IGNORE_PATTERNS

    def wants(self, path_in_repo: str) -> bool:
        """Whether a repo file is part of the download (root HF-format files only)."""
        if any(fnmatch.fnmatchcase(path_in_repo, p) for p in self.ignore_patterns):
            return False
        return any(fnmatch.fnmatchcase(path_in_repo, p) for p in self.allow_patterns)


def known_names() -> str:
    return ", ".join(REGISTRY)


def entry_for_repo(repo_id: str) -> RegistryEntry | None:
    for e in REGISTRY.values():
        if e.repo_id.lower() == repo_id.lower():
            return e
    return None


def hub_source(repo_id: str, revision: str | None = None) -> ModelSource:
    """The source for a repo id, with the registry's name and patterns when it is a known model."""
    entry = entry_for_repo(repo_id)
    if entry is None:
        return ModelSource("hub", repo_id, repo_id, revision=revision)
    return ModelSource("registry", entry.name, entry.repo_id, revision=revision, entry=entry,
                       allow_patterns=entry.allow_patterns, ignore_patterns=entry.ignore_patterns)


def resolve(model: str) -> ModelSource:
    """A registry name ("gpt-oss-20b"), a Hub repo id ("org/name", optionally "org/name@revision"),
    or a local checkpoint directory. An existing directory wins over a repo id of the same spelling."""
    text = model.strip()
    if not text:
        raise UnknownModel(f"no model given; known models: {known_names()}")
    entry = REGISTRY.get(text.lower())
    if entry is not None:
        return hub_source(entry.repo_id)
    path = Path(text).expanduser()
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text
    if path.is_dir():
        return ModelSource("local", str(path), local_path=path.resolve())
    if looks_like_path or path.exists():
        raise UnknownModel(f"{text} is not a directory (a local model is a folder holding config.json and *.safetensors)")
    repo, _, revision = text.partition("@")
    if _REPO_ID.match(repo):
        return hub_source(repo, revision or None)
    close = difflib.get_close_matches(text.lower(), list(REGISTRY), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UnknownModel(f"unknown model {text!r}: {hint}known models: {known_names()}; "
                       "or give a Hub repo id (org/name) or a local directory")
