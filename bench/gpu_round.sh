#!/usr/bin/env bash
# One round of GPU checks on a CUDA machine where the package is not installed. Steps are chosen
# with STEPS (default: the first five): kernels, model, runtime, serve, kernel-bench,
# host (engine host-time profile), breakdown (time per MoE kernel), moe-half2 (MXFP4 packed-f16 timings),
# attention-splits (decode attention against splits, key tile, warps and stages), floor (pure reads
# of a decode step's bytes, bench/read_floor.py), moe-mma (the MXFP4 tensor-core kernels' GPU tests and
# tile sweep), profile (the kernels of one eager decode step in launch order, bench/profile_step.py), router (the one-launch MoE router's GPU
# tests and tile sweep, bench/bench_router.py), moe-pairs (the MXFP4 kernels over two pairs of one expert: GPU
# tests of the row kernels, then their time per MoE kernel against the default at 8-64 tokens), moe-registers
# (the MXFP4 TMA row kernels held to fewer registers a thread for more programs an SM: GPU tests, then
# their time per MoE kernel against the default at 4-48 tokens), generations (the kernel forms the
# launchers choose for Ampere, Ada and consumer Blackwell, run on this GPU against their references;
# the loader on the GPU, --quantize fp8 included), targets (the MXFP4 MoE with and without the down
# register cap, decode attention's GPU tests and its engine and plain forms against stages, register
# caps and key tiles, then the kernel table for the MoE and decode attention), prefill (what a long
# prompt or an image waits for: the FP8 MoE at 64-4096 tokens, prefill attention over 2K-32K keys,
# a new image's preprocessing (host and device), the vision tower at three image sizes, the
# kernels of a 2048-token prefill of GLM-4.5V-FP8 and gpt-oss-120b, and cuBLAS's FP8 GEMMs with
# the bias in their epilogue, bench/scaled_mm_bias_probe.py), prefill-mxfp4 (gpt-oss-120b's MXFP4 MoE at 256-4096 tokens over tensor-core
# tiles, its kernels one by one, Nsight Compute's view of them at 1024 tokens, and the kernels of
# a 2048-token gpt-oss-120b prefill), fp8-accumulate (GLM-4.5V's FP8 experts at prefill sizes with
# their FP8 dots summing the K loop in place: GPU tests, then against before_kernels/moe_gemm.py,
# the file from before, with bench/ab_kernels.sh: the MoE alone, the dense FP8 linears' cuBLAS call
# with its fast accumulation or not, the other tiles once more now that the dots stay in flight, and
# the kernels of a 4-layer 2048-token GLM-4.5V-FP8 prefill, which fits an H100), prefill-cudnn (prefill attention through cuDNN on keys gathered
# out of the pages in two parts, kernels/attention_cudnn.py: its GPU tests, the merge kernel's and the
# engine's switch on a long prompt, then against the paged kernel and SDPA over 0-30K cached keys,
# bench/bench_prefill_attention.py --cudnn, and what a new shape's first call costs, bench/cudnn_shape_probe.py),
# chunk (a long prompt's time to first token at 2048-, 4096- and 8192-token steps, `localchat bench --chunk`, and
# beside a running answer, bench/bench_prefill_beside_decodes.py), chunk-graphs (steps of up to 256 tokens from
# captured graphs: their GPU test, then short prompts' time to first token alone and beside 8 answering chats,
# graphs off and on, bench/bench_chunk_graphs.py), short-prefill (the short-chunk prefill kernel,
# kernels/attention_short.py: its GPU tests, in the model too, then against the paged kernel at 1-256 queries
# after 512-30K keys, beside 8 decoding sequences, and a short turn's first token after a long conversation,
# bench/bench_short_turns.py).
# Logs go to $OUT.
#   STEPS="runtime model serve" SERVE_ARGS="gpt-oss-20b --dummy --batch 1,8" bash bench/gpu_round.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
STEPS=${STEPS:-kernels model runtime serve kernel-bench}
mkdir -p /tmp/shim/localchat && for d in kernels engine app; do ln -sfn "$PWD/$d" /tmp/shim/localchat/$d; done
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
step kernels && timeout "${KERNEL_TESTS_S:-240}" python3 -m pytest -m gpu tests/kernels -q -s -p no:cacheprovider 2>&1 | tee "$OUT/kernels_gpu.log" | tail -40
step model && timeout "${MODEL_TESTS_S:-200}" python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider ${MODEL_TESTS_K:+-k "$MODEL_TESTS_K"} 2>&1 | tee "$OUT/model_gpu.log" | tail -30
step runtime && timeout "${RUNTIME_TESTS_S:-90}" python3 -m pytest -m gpu tests/runtime -q -s -p no:cacheprovider 2>&1 | tee "$OUT/runtime_gpu.log" | tail -15
step serve && timeout "${SERVE_S:-300}" python3 bench/bench_decode.py ${SERVE_ARGS:-gpt-oss-20b,gpt-oss-120b,glm-4.5v-fp8 --dummy --gen-len 64} --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | tail -40
step kernel-bench && timeout "${BENCH_S:-100}" python3 bench/bench_kernels.py ${BENCH_ARGS:---sweep} 2>&1 | tee "$OUT/bench.log" | tail -60
step host && timeout "${HOST_S:-100}" python3 bench/profile_host.py glm-4.5v-fp8,gpt-oss-20b --layers 2 --batch 32 2>&1 | tee "$OUT/host.log" | grep "ms per step"
step moe-half2 && timeout "${HALF2_S:-150}" python3 bench/bench_moe_sweep.py --half2 --ts ${HALF2_TS:-1,8,32,64} --only mxfp4,mxfp4_20b 2>&1 | tee "$OUT/half2.log" | grep best
step breakdown && timeout "${BREAKDOWN_S:-90}" python3 bench/moe_breakdown.py ${BREAKDOWN_ARGS:---ts 1,8 --words} 2>&1 | tee "$OUT/breakdown.log"
step attention-splits && timeout "${ATTN_S:-300}" python3 bench/bench_attention_splits.py ${ATTN_ARGS:---batches 1,8} 2>&1 | tee "$OUT/attention_splits.log" | tail -80
step floor && timeout "${FLOOR_S:-150}" python3 bench/read_floor.py 2>&1 | tee "$OUT/read_floor.log"
step moe-mma && timeout "${MMA_TESTS_S:-200}" python3 -m pytest -m gpu tests/kernels/test_moe_mx_mma.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/mma_gpu.log" | tail -12
step moe-mma && timeout "${MMA_S:-400}" python3 bench/bench_moe_sweep.py --mma-tiles "${MMA_TILES:-8:16:128:1:3/128:128:4:3,8:16:128:1:3/64:128:2:3,8:32:128:2:3,16:32:128:2:3,32:64:128:4:3,64:128:128:4:3}" --ts ${MMA_TS:-32,8,64,16,128} --only mxfp4,mxfp4_20b 2>&1 | tee "$OUT/mma.log" | grep -E "best|failed"
step profile && timeout "${PROFILE_S:-200}" python3 bench/profile_step.py ${PROFILE_ARGS:-gpt-oss-120b,gpt-oss-20b,glm-4.5v-fp8 --layers 4 --batch 1 --trace} 2>&1 | tee "$OUT/profile.log"
step router && timeout "${ROUTER_TESTS_S:-120}" python3 -m pytest -m gpu tests/kernels/test_moe_router.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/router_gpu.log" | tail -12
step router && timeout "${ROUTER_S:-200}" python3 bench/bench_router.py ${ROUTER_ARGS:-} 2>&1 | tee "$OUT/router.log"
step moe-pairs && timeout "${PAIRS_TESTS_S:-150}" python3 -m pytest -m gpu tests/kernels/test_moe_gemv.py -q -s -p no:cacheprovider -k "row_kernels_gpu or half2_small or two_pairs" 2>&1 | tee "$OUT/pairs_gpu.log" | tail -20
step moe-pairs && timeout "${PAIRS_S:-300}" python3 bench/moe_breakdown.py --ts ${PAIRS_TS:-32,16,8,64} --only mxfp4,mxfp4_20b --rows "${PAIRS_ROWS:-half2:16:512:1:3/T/t0/w/d32:512:1:3/P,half2:16:512:1:3/T/t0/w/d16:512:1:3/P,half2:8:512:1:3/T/t0/w/d16:512:1:3/P}" 2>&1 | tee "$OUT/pairs.log"
# down held to 160 / 144 registers (two pairs a program: 180, five programs an SM by registers; six
# at 160, seven at 144), and at 160 with a fourth stage (34.3 KB a program: six still fit); one-pair
# gate/up to 184 (207: four programs; five)
REG_BASE=half2:32:512:2:3/T/t0/w/d32:512:2:3
REG_DOWN4=half2:32:512:2:3/T/t0/w/d32:512:2:4
step moe-registers && timeout "${REG_TESTS_S:-150}" python3 -m pytest -m gpu tests/kernels/test_moe_gemv.py -q -s -p no:cacheprovider -k "row_kernels_gpu or two_pairs" 2>&1 | tee "$OUT/registers_gpu.log" | tail -20
step moe-registers && timeout "${REG_S:-400}" python3 bench/moe_breakdown.py --ts ${REG_TS:-32,16,12,48,8,4} --only ${REG_ONLY:-mxfp4} --rows "${REG_ROWS:-$REG_BASE/P/r160,$REG_BASE/P/r144,$REG_DOWN4/P/r160,$REG_BASE/r160,$REG_BASE/R184,$REG_BASE/R184/r160}" 2>&1 | tee "$OUT/registers.log" | grep -E "graph|failed"
step generations && timeout "${GEN_TESTS_S:-200}" python3 -m pytest -m gpu tests/kernels/test_moe_defaults.py tests/kernels/test_moe_mx_mma.py tests/kernels/test_fp8_linear.py tests/test_loader.py tests/runtime/test_engine_gpu.py -q -s -p no:cacheprovider -k "other_gpu_generations or float32_decode or scaled_mm_recipes or cuda_unchanged or quantize_fp8_on_cuda" 2>&1 | tee "$OUT/generations_gpu.log" | tail -20
# the down cap as the default: GPU tests of the defaults and row kernels, then the whole model with
# the cap on / off / on (bench/registers_ab.py)
REG_BENCH="gpt-oss-120b --dummy --batch ${REG_BATCH:-16,32} --prompt-len 512 --gen-len 48 --image none"
step registers-default && timeout "${REGD_TESTS_S:-120}" python3 -m pytest -m gpu tests/kernels/test_moe_defaults.py tests/kernels/test_moe_gemv.py -q -p no:cacheprovider -k "row_kernels_gpu or two_pairs or defaults" 2>&1 | tee "$OUT/registers_default_gpu.log" | tail -3
for mode in on off on; do
  step registers-default && timeout "${REGD_S:-150}" python3 bench/registers_ab.py $mode -- $REG_BENCH 2>&1 | tee -a "$OUT/registers_ab.log" | grep -E "DOWN_REGISTERS|batch|tok/s|floor" | tail -8
done
# where the targets stand: the MXFP4 MoE at 16-48 tokens with the down cap (the default) against
# without it; decode attention's GPU tests, then its engine form (rotary inside) at batch 1 and 8
# with one or two stages, held to 128 registers a thread or not, and the plain form at batch 1 over
# key tiles of 64 and 128; last the kernel table for the MoE and decode attention
step targets && timeout "${TARGETS_MOE_S:-150}" python3 bench/moe_breakdown.py --ts 32,16,48 --only mxfp4 --rows "$REG_BASE/P" 2>&1 | tee "$OUT/targets_moe.log" | grep -E "graph|failed"
step targets && timeout 100 python3 -m pytest -m gpu tests/kernels/test_attention_decode.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/targets_attention_gpu.log" | tail -4
step targets && timeout "${TARGETS_ROT_S:-150}" python3 bench/bench_attention_splits.py --rotary --batches 1,8 --ctx 8192 --splits 0,48 --block-n 64 --stages 1,2 --max-registers 0,128 2>&1 | tee "$OUT/targets_attention_rotary.log"
step targets && timeout "${TARGETS_ATTN_S:-100}" python3 bench/bench_attention_splits.py --batches 1 --ctx 8192 --splits 0,128 --block-n 64,128 --stages 1,2 2>&1 | tee "$OUT/targets_attention.log"
step targets && timeout "${TARGETS_BENCH_S:-150}" python3 bench/bench_kernels.py --only moe,attention 2>&1 | tee "$OUT/targets_bench.log" | tail -40
step prefill && timeout "${PREFILL_MOE_S:-150}" python3 bench/bench_moe_prefill.py 2>&1 | tee "$OUT/prefill_moe.log" | grep -v Warn
step prefill && timeout "${PREFILL_ATTN_S:-150}" python3 bench/bench_prefill_attention.py --tiles "" 2>&1 | tee "$OUT/prefill_attention.log" | grep -v Warn
step prefill && timeout "${IMAGE_INPUTS_S:-60}" python3 bench/bench_image_inputs.py 2>&1 | tee "$OUT/image_inputs.log"
step prefill && timeout "${VISION_S:-120}" python3 bench/profile_vision.py 2>&1 | tee "$OUT/vision.log" | head -12
step prefill && timeout "${PREFILL_PROFILE_S:-150}" python3 bench/profile_step.py glm-4.5v-fp8,gpt-oss-120b --layers 4 --prefill 2048 2>&1 | tee "$OUT/prefill_profile.log" | grep -v Warn
step prefill && timeout "${BIAS_PROBE_S:-60}" python3 bench/scaled_mm_bias_probe.py 2>&1 | tee "$OUT/scaled_mm_bias.log"
step prefill-mxfp4 && timeout "${PREFILL_MX_S:-240}" python3 bench/bench_moe_prefill.py --only mxfp4 --ts ${PREFILL_MX_TS:-1024,2048,4096,256} --kernels ${PREFILL_MX_ARGS:-} 2>&1 | tee "$OUT/prefill_mxfp4.log" | grep -v Warn
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
step prefill-mxfp4 && [ -n "$NCU" ] && timeout "${PREFILL_NCU_S:-150}" "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis python3 bench/ncu_moe_step.py mxfp4 ${PREFILL_NCU_T:-1024} ${PREFILL_NCU_TILE:-} > "$OUT/prefill_mxfp4_ncu.log" 2>&1; tail -5 "$OUT/prefill_mxfp4_ncu.log" 2>/dev/null
step prefill-mxfp4 && timeout "${PREFILL_PROFILE_S:-150}" python3 bench/profile_step.py gpt-oss-120b --layers 4 --prefill 2048 2>&1 | tee "$OUT/prefill_profile_oss.log" | grep -v Warn
step fp8-accumulate && timeout "${FP8_ACC_TESTS_S:-150}" python3 -m pytest -m gpu tests/kernels/test_moe.py tests/kernels/test_moe_defaults.py -q -s -p no:cacheprovider -k "glm45v or defaults" 2>&1 | tee "$OUT/fp8_accumulate_gpu.log" | tail -12
step fp8-accumulate && [ -d before_kernels ] && BEFORE_DIR=before_kernels timeout "${FP8_ACC_S:-240}" bash bench/ab_kernels.sh python3 bench/bench_moe_prefill.py --only fp8_channel,fp8_block --ts 1024,4096,256 --tiles 64:128:128:8:3 2>&1 | tee "$OUT/fp8_accumulate.log"
step fp8-accumulate && timeout "${FAST_ACCUM_S:-90}" python3 bench/fast_accum_probe.py 2>&1 | tee "$OUT/fast_accum.log"
step fp8-accumulate && timeout "${FP8_ACC_TILES_S:-150}" python3 bench/bench_moe_prefill.py --only fp8_channel --ts 1024,4096 2>&1 | tee "$OUT/fp8_accumulate_tiles.log" | grep -v Warn
step fp8-accumulate && [ -d before_kernels ] && BEFORE_DIR=before_kernels timeout "${FP8_ACC_TTFT_S:-240}" bash bench/ab_kernels.sh python3 bench/profile_step.py glm-4.5v-fp8 --layers 4 --prefill 2048 2>&1 | tee "$OUT/fp8_accumulate_ttft.log" | grep -E "layers|%" | head -60
step prefill-cudnn && timeout "${CUDNN_TESTS_S:-150}" python3 -m pytest -m gpu tests/kernels/test_attention_cudnn.py tests/kernels/test_attention_merge.py tests/gpu/test_model_cuda.py -k "cudnn or merge or sdpa or long_prefix" -q -s -p no:cacheprovider 2>&1 | tee "$OUT/cudnn_gpu.log" | tail -8
step prefill-cudnn && timeout "${CUDNN_S:-120}" python3 bench/bench_prefill_attention.py --tiles "" --cudnn --prefixes 0,2048,4096,8192,16384,30720 2>&1 | tee "$OUT/prefill_cudnn.log" | grep -v Warn
step prefill-cudnn && timeout "${CUDNN_PROBE_S:-90}" python3 bench/cudnn_shape_probe.py 2>&1 | tee "$OUT/cudnn_shapes.log"
# chunk: a long prompt's time to first token with the engine's steps holding 2048, 4096 or 8192 tokens
# (--chunk), whole models where they fit (GLM-4.5V-FP8 needs an H200's memory; on an H100 its first
# CHUNK_LAYERS layers), one 8192-token prompt and a 16384-token one, batch 1 twice (the second row
# is the one to read: the first builds the new prefill shapes)
CHUNK_GLM_LAYERS=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || echo "--layers ${CHUNK_LAYERS:-24}")
for chunk in 2048 4096 8192; do for len in 8192 16384; do
  step chunk && timeout "${CHUNK_S:-240}" python3 bench/bench_decode.py glm-4.5v-fp8 --dummy $CHUNK_GLM_LAYERS --batch 1,1 --prompt-len $len --gen-len 16 --image none --chunk $chunk 2>&1 | tee -a "$OUT/chunk.log" | grep -E "layers|TTFT"
  step chunk && timeout "${CHUNK_S:-240}" python3 bench/bench_decode.py gpt-oss-120b --dummy --batch 1,1 --prompt-len $len --gen-len 16 --chunk $chunk 2>&1 | tee -a "$OUT/chunk.log" | grep -E "layers|TTFT"
done; done
# the same chunks beside a running answer: its token gaps while a 16K-token prompt is read, and that prompt's TTFT
step chunk && timeout "${CHUNK_S:-240}" python3 bench/bench_prefill_beside_decodes.py gpt-oss-120b 2>&1 | tee -a "$OUT/chunk.log" | grep beside
# chunk-graphs: steps of up to 256 tokens replayed from captured graphs against eager steps
step chunk-graphs && timeout "${CHUNK_GRAPHS_TESTS_S:-120}" python3 -m pytest -m gpu tests/gpu/test_chunk_graphs_cuda.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/chunk_graphs_gpu.log" | grep -E "vs eager|passed|failed"
step chunk-graphs && timeout "${CHUNK_GRAPHS_S:-150}" python3 bench/bench_chunk_graphs.py gpt-oss-120b 2>&1 | tee "$OUT/chunk_graphs.log"
step chunk-graphs && timeout "${CHUNK_GRAPHS_S:-150}" python3 bench/bench_chunk_graphs.py glm-4.5v-fp8 $CHUNK_GLM_LAYERS 2>&1 | tee -a "$OUT/chunk_graphs.log"
# short-prefill: a few queries after long contexts, the packed short-chunk kernel against the paged one
step short-prefill && timeout "${SHORT_TESTS_S:-150}" python3 -m pytest -m gpu tests/kernels/test_attention_short.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/short_prefill_gpu.log" | grep -E "short prefill|passed|failed"
# the layer's choices (a CPU test, unmarked) on the GPU's kernels
step short-prefill && timeout "${SHORT_TESTS_S:-150}" python3 -m pytest tests/kernels/test_attention_routing.py -q -p no:cacheprovider 2>&1 | tee -a "$OUT/short_prefill_gpu.log" | grep -E "passed|failed"
step short-prefill && timeout "${SHORT_TESTS_S:-150}" python3 -m pytest -m gpu tests/gpu/test_model_cuda.py -k short_turn -q -s -p no:cacheprovider 2>&1 | tee -a "$OUT/short_prefill_gpu.log" | grep -E "rel err|passed|failed"
step short-prefill && timeout "${SHORT_TESTS_S:-150}" python3 -m pytest -m gpu tests/gpu/test_chunk_graphs_cuda.py -q -s -p no:cacheprovider 2>&1 | tee -a "$OUT/short_prefill_gpu.log" | grep -E "rel err|passed|failed"
step short-prefill && timeout "${SHORT_S:-150}" python3 bench/bench_prefill_attention.py --tiles "" --chunks 1,16,32,64 --prefixes 512,2048,8192,30720 --short ${SHORT_FORMS:-16:32:512:64:4} 2>&1 | tee "$OUT/short_prefill.log"
step short-prefill && timeout "${SHORT_S:-150}" python3 bench/bench_prefill_attention.py --tiles "" --chunks 16,64,2048 --prefixes 8192,30720 --short ${SHORT_FORMS:-16:32:512:64:4} --decoding 8 --empty 56 2>&1 | tee -a "$OUT/short_prefill.log"
step short-prefill && timeout "${SHORT_S:-150}" python3 bench/bench_short_turns.py gpt-oss-120b --layers 12 --history 512,30720 --turns 16,32,512 2>&1 | tee "$OUT/short_turns.log"
step short-prefill && timeout "${SHORT_S:-150}" python3 bench/bench_short_turns.py glm-4.5v-fp8 --layers 12 --history 512,30720 --turns 16,32,512 2>&1 | tee -a "$OUT/short_turns.log"
# graph steps past the short-chunk kernel's bound not shared between both kernels (SHARED_CAPTURED_STEPS off)
step short-prefill && timeout "${SHORT_S:-150}" python3 bench/bench_short_turns.py glm-4.5v-fp8 --layers 12 --history 512,30720 --turns 32,64,100 --shared off 2>&1 | tee -a "$OUT/short_turns.log"
exit 0
