"""`localchat pull | list | rm | doctor`: getting models, seeing what is cached, checking the machine.

`add_model_commands(subparsers)` adds the four subcommands to the launcher's argparse parser; each
sets `func(args) -> int`. A user error prints one line to stderr and returns 1 (no traceback).
`python -m localchat.app.model_commands` prints the README's table of disk and GPU needs.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from localchat.engine.hub import HubError, cached_status, is_offline, sync
from localchat.engine.hub_cache import CachedRepo, cache_root, cached_repos, free_disk_bytes, human_bytes
from localchat.engine.planner import GiB, GpuInfo, KvLayout, Plan, checkpoint_weight_bytes, gib, local_gpus, plan
from localchat.engine.registry import REGISTRY, UnknownModel, hub_source, resolve
from localchat.engine.spec import ModelSpec, UnsupportedModel

PROG = "localchat"
VERSIONED_PACKAGES = ("torch", "triton", "transformers", "huggingface_hub", "safetensors", "tokenizers", "gradio")


def add_model_commands(subparsers) -> None:
    p = subparsers.add_parser("pull", help="download a model into the Hugging Face cache (resumable)")
    p.add_argument("model", help="registry name (e.g. gpt-oss-20b), Hub repo id (org/name) or local directory")
    p.add_argument("--offline", action="store_true", help="use the cache only; say what is missing")
    p.add_argument("--refresh", action="store_true", help="check the Hub for a newer commit even if cached")
    p.add_argument("--verify", action="store_true", help="re-hash cached files and fetch again any that differ")
    p.set_defaults(func=cmd_pull)
    p = subparsers.add_parser("list", help="models in the cache, their size and whether they fit the GPUs")
    p.add_argument("--all", action="store_true", help="also list known models that are not downloaded")
    p.set_defaults(func=cmd_list)
    p = subparsers.add_parser("rm", help="delete a model from the cache")
    p.add_argument("model")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_rm)
    p = subparsers.add_parser("doctor", help="GPUs, driver, versions, disk, cache, and which models fit")
    p.add_argument("--assume-gpus", metavar="NxGB", help="plan for N GPUs of GB memory each instead of the local ones")
    p.set_defaults(func=cmd_doctor)


def _user_errors(fn):
    @functools.wraps(fn)
    def run(args) -> int:
        try:
            return fn(args)
        except (HubError, UnknownModel, UnsupportedModel, ValueError, FileNotFoundError) as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
            return 130
    return run


@_user_errors
def cmd_pull(args) -> int:
    result = sync(args.model, offline=args.offline or None, refresh=args.refresh, verify=args.verify)
    name = resolve(args.model).name
    if result.from_cache and not result.fetched_bytes:
        print(f"{name}: already complete in the cache: {result.path}")
    else:
        print(f"{name}: downloaded {human_bytes(result.fetched_bytes)} "
              f"({len(result.files)} files, {human_bytes(result.total_bytes)} in all): {result.path}")
    print(f"  {_fit_text(_plan_dir(result.path, name, local_gpus()))}")
    return 0


@_user_errors
def cmd_list(args) -> int:
    gpus = local_gpus()
    rows = []
    seen = set()
    for repo in cached_repos():
        src = hub_source(repo.repo_id)
        name = src.name
        seen.add(name)
        _, sha, missing = cached_status(src)
        if sha is None:
            state, fit = "incomplete (no finished snapshot)", "-"
        elif missing:
            state, fit = f"incomplete ({len(missing)} files missing)", "-"
        else:
            state, fit = "complete", _fit_text(_plan_dir(repo.snapshot(sha), name, gpus), short=True)
        if repo.partial_bytes():
            state += f", {human_bytes(repo.partial_bytes())} partial"
        rows.append((name, human_bytes(repo.size_on_disk()), state, fit))
    if args.all:
        for entry in REGISTRY.values():
            if entry.name not in seen:
                rows.append((entry.name, f"~{human_bytes(entry.download_bytes)}", "not downloaded",
                             _fit_text(entry.plan(gpus), short=True)))
    if not rows:
        print(f"no models in the cache at {cache_root()}; try `{PROG} pull gpt-oss-20b` ({PROG} list --all shows more)")
        return 0
    _print_table(("MODEL", "SIZE", "STATE", "FITS THE LOCAL GPUS"), rows)
    return 0


@_user_errors
def cmd_rm(args) -> int:
    src = resolve(args.model)
    if src.local_path is not None:
        raise ValueError(f"{src.local_path} is a local directory: rm only deletes models from the cache at {cache_root()}")
    repo = CachedRepo.of(src.repo_id)
    if not repo.folder.is_dir():
        raise ValueError(f"{src.name} is not in the cache at {repo.root} (`{PROG} list` shows what is)")
    size = human_bytes(repo.size_on_disk())
    if not args.yes:
        if not sys.stdin.isatty():
            raise ValueError(f"not deleting {src.name} ({size}) without confirmation: pass --yes")
        if input(f"delete {src.name} ({size}) from {repo.folder}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    freed = repo.remove()
    print(f"removed {src.name} from the cache: {human_bytes(freed)} freed")
    return 0


@_user_errors
def cmd_doctor(args) -> int:
    gpus = _assumed_gpus(args.assume_gpus) if args.assume_gpus else local_gpus()
    lines = [("python", f"{platform.python_version()} ({sys.executable})")]
    lines += [(pkg, _version(pkg)) for pkg in VERSIONED_PACKAGES]
    lines.append(("cuda", _cuda_text()))
    lines.append(("driver", _driver_version() or "not found (no nvidia-smi / NVIDIA kernel module)"))
    if args.assume_gpus:
        lines.append(("gpus", f"assumed: {args.assume_gpus}"))
    for g in gpus:
        cc = f", compute capability {g.capability[0]}.{g.capability[1]}" if g.capability else ""
        lines.append((f"gpu {g.index}", f"{g.name}{cc}, {gib(g.total_bytes)} total, {gib(g.free_bytes)} free"))
    if not gpus:
        lines.append(("gpus", "none found: localchat needs a CUDA GPU to serve these models"))
    root = cache_root()
    repos = cached_repos(root)
    lines.append(("cache", f"{root} ({_cache_source()}), {len(repos)} model(s), "
                           f"{human_bytes(sum(r.size_on_disk() for r in repos))}"))
    lines.append(("free disk", f"{human_bytes(free_disk_bytes(root))} at {root}"))
    lines.append(("offline", "on (HF_HUB_OFFLINE)" if is_offline() else "off"))
    lines.append(("hub token", _token_source()))
    _print_table(None, lines)
    print("\nmodels (registry sizes; KV cache bf16):")
    _print_table(("MODEL", "DOWNLOAD", "FITS"), [(e.name, f"~{human_bytes(e.download_bytes)}", _fit_text(e.plan(gpus)))
                                              for e in REGISTRY.values()])
    return 0


def _plan_dir(path: Path, name: str, gpus: list[GpuInfo]) -> Plan | str:
    try:
        spec = ModelSpec.from_dir(path)
        weights = checkpoint_weight_bytes(path, name)
    except (UnsupportedModel, FileNotFoundError, ValueError, KeyError) as e:
        return f"cannot plan: {e}"
    entry = REGISTRY.get(name)
    return plan(KvLayout.from_spec(spec), weights, gpus, alternative=entry.alternative if entry else None,
                fp8=spec.quant.method == "fp8")


def _fit_text(p: Plan | str, short: bool = False) -> str:
    if isinstance(p, str):
        return p
    if not short:
        return p.summary()
    if p.verdict == "no_gpu":
        return "no GPU"
    if p.chosen is None:
        return "no: " + (p.advice[0] if p.advice else "too large")
    text = f"yes, {p.chosen.tp} GPU" + ("s" if p.chosen.tp > 1 else "")
    return text + (f", --max-context {p.chosen.max_context}" if p.verdict == "fits_reduced" else "")


def _print_table(header, rows) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    all_rows = ([tuple(header)] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]) - 1)]
    for r in all_rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + ("  " if widths else "") + r[-1])


def _assumed_gpus(text: str) -> list[GpuInfo]:
    """"2x80" -> two GPUs of 80 GiB, 0.5 GiB of it in use (board sizes as sold are close to GiB)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+(?:\.\d+)?)\s*(?:GB|GiB|G)?\s*", text)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"--assume-gpus wants NxGB, e.g. 2x80 for two 80 GB GPUs (got {text!r})")
    total = int(float(m.group(2)) * GiB)
    return [GpuInfo(f"{float(m.group(2)):g} GB GPU", total, total - GiB // 2, i) for i in range(int(m.group(1)))]


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda_text() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.version.cuda:
        return "CPU-only build of torch (no CUDA)"
    return f"torch built for CUDA {torch.version.cuda}; available: {'yes' if torch.cuda.is_available() else 'no'}"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc = Path("/proc/driver/nvidia/version")
    return proc.read_text().splitlines()[0].strip() if proc.is_file() else None


def _cache_source() -> str:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        if os.environ.get(var):
            return f"from {var}"
    return "default"


def _token_source() -> str:
    from huggingface_hub import constants
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "found in HF_TOKEN"
    if Path(constants.HF_TOKEN_PATH).is_file():
        return "found (stored by `hf auth login`)"
    return "none (gated or private models need `hf auth login` or HF_TOKEN)"


# Boards as the driver reports them (total MiB from nvidia-smi).
README_GPU_SETS = (("1x RTX 4090 24 GB", 1, "NVIDIA GeForce RTX 4090", 24564),
                   ("1x H100 80 GB", 1, "NVIDIA H100 80GB HBM3", 81559),
                   ("2x H100 80 GB", 2, "NVIDIA H100 80GB HBM3", 81559),
                   ("1x H200 141 GB", 1, "NVIDIA H200", 143771),
                   ("2x H200 141 GB", 2, "NVIDIA H200", 143771))


def needs_table(gpu_sets=README_GPU_SETS) -> str:
    """Markdown: per model the download, weights, KV per token, and the plan on each GPU set
    (all memory free but 0.5 GiB)."""
    head = ["model", "format", "download", "weights", "KV / token"] + [s[0] for s in gpu_sets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in REGISTRY.values():
        cells = [e.name, e.format, f"~{human_bytes(e.download_bytes)}", gib(e.weight_bytes),
                 f"{e.kv.bytes_per_token() // 1024} KiB"]
        for _, n, board, mib in gpu_sets:
            gpus = [GpuInfo(board, mib << 20, (mib << 20) - GiB // 2, i) for i in range(n)]
            p, prefix = e.plan(gpus), ""
            if p.chosen is None and p.advice and p.advice[0].startswith("--quantize"):
                p, prefix = e.plan(gpus, quantize="fp8"), "--quantize fp8: "
            if p.chosen is None:
                cells.append("no")
            else:
                c = p.chosen
                cells.append(f"{prefix}{c.tp} GPU{'s' if c.tp > 1 else ''}, ctx {c.max_context} "
                             f"(KV room {c.kv_tokens // 1000}k tokens)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(needs_table())
