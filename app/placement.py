"""Where a model runs, decided before anything is downloaded or loaded: which model by default,
whether the local GPUs can hold it and its context, and how to split it over them (the planner's
figures, engine/planner.py), with advice when they cannot."""
from __future__ import annotations

import sys
from pathlib import Path

from .errors import UserError


def tp_size(args) -> int:
    """The tensor-parallel size the flags ask for (--tp, else how many --gpus, else 1)."""
    return args.tp or (len(args.gpus) if args.gpus else 1)


def default_model() -> str:
    """The planner's pick for the local GPUs: GLM-4.5V-FP8 where it fits, else the best that fits."""
    from ..engine.planner import local_gpus
    from ..engine.registry import REGISTRY

    gpus = local_gpus()
    if not gpus:
        raise UserError("no CUDA GPU is visible, and the supported models need one; `localchat --model demo` "
                        "tries the app on the CPU with a tiny built-in model, --model DIR --device cpu runs a small "
                        "local checkpoint; or check the NVIDIA driver (`localchat doctor`)")
    for name in ("glm-4.5v-fp8", "gpt-oss-120b", "gpt-oss-20b"):
        if REGISTRY[name].plan(gpus).chosen is not None:
            return name
    smallest = REGISTRY["gpt-oss-20b"].plan(gpus)
    if smallest.verdict == "unsupported":
        raise UserError(smallest.summary())
    raise UserError("none of the supported models fits the free memory of this machine's GPUs; "
                    "`localchat doctor` shows what each needs")


def refuse_unrunnable(args) -> None:
    """A registry model is planned against the GPUs from its known sizes, so one that cannot run on
    them is refused before its download."""
    from ..engine.planner import local_gpus
    from ..engine.registry import REGISTRY
    from .demo import DEMO_NAME

    entry = REGISTRY.get(args.model)
    if args.model == DEMO_NAME or entry is None or Path(args.model).is_dir():
        return
    if args.quantize and entry.format != "bf16":
        raise UserError(f"--quantize {args.quantize} converts bf16 checkpoints; {args.model} is {entry.format} "
                        "already: run it without --quantize")
    if args.device != "cpu" and not local_gpus():
        # CPU is the reference path (tests, tiny models): refused before a download of many GB
        raise UserError(f"{args.model} needs a CUDA GPU ({entry.plan([], quantize=args.quantize).summary()}). "
                        "`localchat doctor` says what it sees; `--device cpu` runs it on the CPU anyway, very "
                        "slowly and in several times its size of memory; `localchat --model demo` tries the app "
                        "without a GPU")
    check_fits(args, lambda gpus: entry.plan(gpus, max_context=args.max_context, quantize=args.quantize))


def check_checkpoint_fits(args, model_dir: Path) -> None:
    """check_fits with the checkpoint's own sizes and format."""
    from ..engine.planner import checkpoint_weight_bytes, plan
    from ..engine.spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    weights = checkpoint_weight_bytes(model_dir)
    check_fits(args, lambda gpus: plan(spec, weights, gpus, max_context=args.max_context, quantize=args.quantize,
                                       fp8=spec.quant.method == "fp8"))


def check_fits(args, plan_for) -> None:
    """Refuses early, with advice, what would otherwise end in a CUDA out-of-memory error or a
    kernel the GPU cannot run. plan_for(gpus) -> the planner's Plan for those GPUs."""
    from ..engine.planner import MIN_CONTEXT, local_gpus

    gpus = [] if args.device == "cpu" else local_gpus()
    if not gpus:
        return
    if args.tp is None and not args.gpus and len(gpus) > 1:
        place_as_planned(args, plan_for(gpus), plan_for([g for g in gpus if g.index == 0]))
    tp = tp_size(args)
    wanted = (args.gpus or list(range(tp)))[:tp]
    chosen = [g for g in gpus if g.index in wanted]
    if len(chosen) < tp:
        return  # the engine names the missing GPU
    result = plan_for(chosen)
    where = f"GPU {chosen[0].index}" if tp == 1 else f"GPUs {','.join(str(g.index) for g in chosen)}"
    if result.verdict == "unsupported":
        raise UserError(f"{args.model} cannot run on {where}: {result.summary()}")
    if tp > 1:  # the split the user asked for, not the planner's pick
        result.chosen = next((o for o in result.options if o.tp == tp and o.max_context >= MIN_CONTEXT), None)
        if result.chosen is not None and result.chosen.max_context >= result.want_context:
            result.verdict = "fits"
        elif result.chosen is not None:
            result.verdict = "fits_reduced"
    if result.chosen is None:
        more = (f" (this machine has {len(gpus)} GPUs: --tp {len(gpus)} splits the model over them)"
                if len(gpus) > tp else "")
        raise UserError(f"{args.model} does not fit {where}: {result.summary()}{more}")
    if result.verdict == "fits_reduced" and args.max_context is None:
        args.max_context = result.chosen.max_context
        print(f"localchat: context limited to {args.max_context} tokens to fit GPU memory", file=sys.stderr)


def place_as_planned(args, result, on_first) -> None:
    """With several GPUs and no --tp or --gpus: the planner's split where the model and its context
    need more than one GPU, and its GPU (the one with the most free memory) where one holds them
    but GPU 0, the default, holds less (another model may be using it). result / on_first: the
    plans over every GPU and over GPU 0 alone."""
    chosen = result.chosen
    if chosen is None or result.verdict == "unsupported":
        return
    if chosen.tp > 1:
        args.tp, args.gpus = chosen.tp, sorted(chosen.gpu_indices)
        listed = ",".join(map(str, args.gpus))
        print(f"localchat: {args.model} is split over GPUs {listed} (tensor parallel), the fewest that hold it and "
              f"its context; --gpus picks others", file=sys.stderr)
    elif chosen.gpu_indices[0] != 0 and (on_first.chosen is None or on_first.chosen.max_context < chosen.max_context):
        args.gpus = [chosen.gpu_indices[0]]
        print(f"localchat: {args.model} goes on GPU {args.gpus[0]}, which has the most free memory; --gpus picks "
              "another", file=sys.stderr)
