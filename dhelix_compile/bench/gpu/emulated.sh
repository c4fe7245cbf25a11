#!/usr/bin/env bash
# The emulated cluster on one GPU: the emulation's CUDA tests, the emulator's timing checks, then a
# Llama-3-8B-shaped layer stack at TP=8 in bfloat16 on an NVLink and a 400 Gbit/s InfiniBand link,
# every variant.
#   bash dhelix_compile/bench/gpu/emulated.sh OUT_DIR
# (on the GPU machine; nothing is downloaded: the package installs without its dependencies)
# Environment: LINKS ("ib400 nvlink4"), VARIANTS, MODEL, PARALLEL, REPEATS, REPEAT_S (the bench's
# --time-limit-s for its timed repeats), and the per-stage
# limits TESTS_S, TIMING_S, BENCH_S (seconds; a stage past its limit is stopped, the next runs).
set -uo pipefail
out=${1:?usage: emulated.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
git log -1 --format='commit %h %cd' 2>/dev/null || true
variants=${VARIANTS:-inductor,inductor_overlap,dhelix,helix}
model=${MODEL:-llama3_8b_gpu}
echo "== tests on CUDA"
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_emulation.py -k "cuda and (outputs or tp8)" \
    2>&1 | grep -v "^\[rank" | tail -40
echo "== the emulator against its link model"
timeout "${TIMING_S:-90}" python3 -m dhelix_compile.bench.emulated_timing --device cuda --link nvlink4 --repeats 5 \
    --out "$out/timing_nvlink4.json" 2>&1 | tail -40
for link in ${LINKS:-ib400 nvlink4}; do
    echo "== $link"
    timeout "${BENCH_S:-240}" python3 -m dhelix_compile bench --link "emulated:$link,ranks=8" --device cuda --dtype bfloat16 \
        --model "$model" --parallel "${PARALLEL:-tp}" --variants "$variants" --microbatches 2 --repeats "${REPEATS:-5}" \
        --warmup 2 --time-limit-s "${REPEAT_S:-90}" --out "$out/bench_$link.json" 2>&1 | tail -60
done
