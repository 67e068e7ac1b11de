#!/usr/bin/env bash
# One GPU-machine session's checks, in order of what is owed, each step under its own time limit, logs to $OUT.
# Run from the repository root on the device, after `source .device-cache/setup.sh`:
#   STEPS=bench bash tests/gpu/session.sh               # a subset (default: all, what is owed first; one call runs
#                                                        # at most 10 min, so give bench and nvme a call each)
# First it builds the CPU-lane kernel for the machine's Python (the working tree carries no build). Steps:
#   tiers     the tier machinery on CUDA (tests/tiers/test_tiers_gpu.py, tests/tiers/test_nvme_tier_gpu.py: copy ordering,
#             batched copies, pinned arenas; under a minute: STEPS=tiers,nvmeshm fits one call)
#   paired    glm53 bench decode --baseline b38dea7: this code against the commit before the one-hot-path work
#             (issue 23), exact, fast and nvme-exact in paired windows, each window its own process of each
#             side's code. Needs b38dea7 unpacked in .baseline (here: git archive b38dea7 | tar -x -C .baseline,
#             .baseline in .git/info/exclude, carried); windows kept under /tmp are reused, so repeat the call
#             until it reports (PAIRS: paired windows, default 3)
#   tiny      tiers, then fast/nvme KL + top-1 and nvme-exact bit-identity
#             (tests/engine/test_gpu_modes.py -k tiny), then exact mode
#             bit-identity and the engine (tests/engine/test_gpu_engine.py -k "tiny or engine")
#   server    the OpenAI conformance suite against the exllamav3 engine (needs .device-cache/extra, see
#             tests/gpu/stage_extras.sh)
#   width     full-width checks: fast KL/top-1 (2 MoE layers) and exact bit-identity (2 and 3 MoE layers)
#   bench     glm53 bench decode: stock, exact, fast (8 MoE layers as issue 5 asks, 3
#             windows of 128 tokens, a cProfile of one exact window; at 4 layers it took ~3 min with a fresh
#             machine's ~100 s first-prefill penalty, so give it a call of its own). bench, nvme and nvme16
#             keep the checkpoint and store in /tmp (--keep), so a warm machine's next step reuses them
#   nvme      glm53 bench decode with the nvme modes next to exact and fast (8 MoE layers) at the 55 GiB fraction;
#             192 tokens of warm-up decode first (packs a store: ~20 GB of disk; on 2026-11-30 it took 490 s on a
#             fresh machine: watch the 540 s limit); nvmequick: a shorter nvme step (3 x 64 tokens; a fresh machine
#             needs over 250 s before its first window, so give it ~330 s); nvme16: the nvme step at the 16 GiB
#             fraction (223 s); nvmeshm: the 55 GiB fraction with the store in /dev/shm, a store far faster than
#             the machine's virtual disk (NVMESHM_MODES / NVME_MODES: other modes), a cProfile of one nvme-exact window and the read-contention probe (fresh machine: ~200 s before the
#             first window, about 420 s in all with five modes: give it a call of its own); nvmeemu: the same
#             with the store's reads paced as on a drive of each EMU_GBPS rate (--emulate-disk-GBps); disk: that disk's raw
#             rate by reads in flight (after nvme)
#   vision    images (issue 42): text with an image in exact mode bit-identical to stock (tiny and full width, the
#             real tower's dims), exllamav3's image token counts, the tower's VRAM and the screenshot's TTFT, the
#             engine end to end (tests/engine/test_gpu_vision.py; log vision.log)
#   split1    the layer split onto ONE card (two device shares, two budgets): exact and nvme-exact bit-identical
#             to stock over 256 greedy tokens (tests/engine/test_gpu_split.py -k same_card; issue 28)
#   split2    two cards (needs two CUDA devices: nvidia-h200-x2, GLM53_VRAM_BUDGET_GB=24 per card): the two-card
#             bit-identity and 250,000-token prompt tests, then glm53 bench decode --devices 2 (8 MoE layers,
#             exact and fast, each paired one card vs two, per-card picks and link MiB/token); SPLIT_LAYERS=42 for
#             the full-depth fixture
#   depthprobe  the full-depth fixture (issue 25: 45 layers, 3 dense + 42 MoE, always-used linears at K=5, EXL3
#             K=6 head; DEPTH_EXPERTS routed experts per layer, default 8: ~10 GB in /tmp, kept and reused) in stock
#             exllamav3, all in VRAM: load time, then 32 greedy tokens after a 16- and an 8,192-token prompt with
#             first-token time, decode tok/s, torch's peak allocation and the device memory in use
#   planmem   the plan's VRAM estimates against a real prefill (tests/test_engine_spec.py, gpu): torch's peak over two
#             chunks of 2,048 and of 4,096 tokens (activations) and the process's device memory beyond it (the reserve);
#             writes $OUT/plan-memory.json with the figures glm53/planning/plan.py's PREFILL_MEASURED / RESERVE_MEASURED take
#   depth     issue 25's proof, first call: glm53 bench depth --modes stock,exact on the full-depth fixture (3 dense +
#             42 MoE layers, 48 experts, ~26 GB, generated into /tmp/depth and kept; DEPTH_FIXTURE='...': other
#             fixture args), planned for a 24 GB budget at 131,072 tokens: plan vs loaded, TTFT at 8K/32K/120K,
#             decode at 0/8K/32K/120K, peak device memory through the 120K prompt + 512 tokens, exact's 256 greedy tokens against stock's, the per-layer-type step profile,
#             the context-edge checks (tiered modes). Each call's JSON is /tmp/depth/call-MODES.json (and in $OUT);
#             a call without stock takes it from the latest call that had it (or DEPTH_REF=FILE). DEPTH_CONCURRENCY=1:
#             the plan for one sequence (8 staging rows: every prefill borrows cache slots as staging). Other steps' kept
#             /tmp/glm53-bench-* files are removed first when /tmp has under 50 GB free (checkpoint + store ~45 GB)
#   depth2    the second call: fast and nvme-exact on the kept checkpoint (the store packed beside it), ratios and
#             tokens against the first call's stock (on a fresh machine: carry that call's call-stock-exact.json and
#             pass DEPTH_REF=FILE). DEPTH_MODES / DEPTH2_MODES split the modes over more calls where one runs out
#   intpaths  issue 40: every integer path against the reference kernel (the CPU suite), and each one's time at
#             15 threads beside the exact kernel
#   phases    issue 40: tests/gpu/clock_probe.c (the clock under integer and AVX-512 load at 1..16 threads), then
#             glm53 bench cpu-lane's per-phase profile of the integer kernel (PHASES_ISA, default avx512vnni) at
#             PHASES_THREADS (default 1,4,8,15), 4 experts a call and 1; PHASES_BASE=<a kernel.cpp>: the tree
#             built with it, paired against this one (--baseline-lib) at 8 and 15 threads, 1 and 4 experts a call,
#             and 1 a call after 1 ms idle (decode's cadence: the workers asleep)
#   lane      glm53 bench cpu-lane over 1..16 threads: on 2026-11-30 the lane took 667 us per one-row expert with
#             8 threads against 867 us with the 2-core dev machine's 2; find where its scaling stops
#   agent     (DIAGNOSE=1: the server's Triton compiles, GC pauses and sampled stacks, tests/gpu/diagnose)
#             glm53 bench agent on MODEL=<checkpoint dir> (issue 26: the full-depth fixture), exact mode, or nvme-exact
#             with STORE=<store file>: one `glm53 serve`, two 16-turn sessions to AGENT_TOKENS (default 60000) with
#             32-token replies: reasoning dropped by the client (seed 1, half of each reply's budget for reasoning),
#             then kept with no per-request reasoning budget (seed 2: a request continued past its budget reports
#             no cached_tokens from the exllamav3 engine today). At ~40 s per 100K cold tokens: ~100 s a session
#             plus the load; AGENT_LIMIT (default 520 s) bounds the whole step; the turns are in the logs as they run
#   clients   the captured Claude Code and Codex requests (tests/data/clients) replayed through HTTP against glm53 serve
#             in exact mode on the full-depth fixture (MODEL, default /tmp/fx, generated when absent; 24 GiB, 65,536
#             tokens): per request TTFT, prompt tokens and cached share (tests/gpu/replay_clients.py)
#   emu       issue 38: the paced link's rate (tests/bench/test_emulate.py, gpu), then glm53 bench decode --emulate
#             rtx3090-gen4 (PCIe 4.0's 25 GB/s, 11% of the experts in VRAM, the lane on AVX2) on the 8-MoE-layer
#             checkpoint, EMU_MODES (default exact,fast), EMU_WINDOWS (default 2) windows of 96 tokens; EMU_PROFILE=MODE:
#             one more window of MODE under cProfile (where the host's layer step goes)
#   grid      issue 38's grid under the preset: GRID_RATES (default 12 25 50 GB/s) x GRID_SLOTS (default 32 64 VRAM
#             slots a layer) x GRID_MODES (exact,fast,nvme-exact), one bench decode call a point (grid-R-S.json)
#   emuserve  glm53 bench serve --emulate rtx3090-gen4 on the 8-MoE-layer checkpoint, exact: the launcher on CUDA
#   serveconc glm53 bench serve --concurrency 1,2,4,8 on MODEL (SERVE_MODE, default exact; nvme modes need STORE):
#             512-token prompts, 96 tokens per stream, best of 2 rounds per level
#   fairness  issue 41's figure on the exllamav3 engine: glm53 bench fairness on the tiny EXL3 fixture (/tmp/fx,
#             generated), exact, 2 decode slots, a 5-token request alone and beside 2 replies without max_tokens
#             (needs .device-cache/extra for uvicorn, see tests/gpu/stage_extras.sh; the first start compiles ~170 s;
#             FAIR_CONTEXT, default 32768: at 2,048 the H100 ends each unbounded reply in 3 s, before the rest stream)
#   handoff   issue 39's stream-ordered CPU-lane hand-off (glm53/exl3/handoff.py): every lane step late and waited for
#             behind the GPU's flag wait (nothing recomputed), and a lane that dies with the GPU waiting (its forward
#             fails, later ones are stock's); HANDOFF_DUMP: seconds before pytest dumps every thread's stack (a hang);
#             HANDOFF_K: other tests of tests/engine/test_gpu_modes.py
#   gate      issue 39: bench decode, exact beside nvme-exact with every expert in RAM (no store reads: the nvme
#             lookahead gated off), under the consumer-box preset; GATE_LIMIT
#   prestage  issue 39 item 3: bench decode --baseline PRESTAGE_BASE (default f9d725d, unpacked in PRESTAGE_TREE,
#             default .baseline, and carried), PRESTAGE_MODES (default exact) under the consumer-box preset, PAIRS
#             paired windows (default 2); PRESTAGE_LIMIT
#   hostprobe issue 39 item 1: exact with HOSTPROBE_US (default 100) more host time a layer step beside itself under
#             the preset (HOSTPROBE_RATE GB/s, default 25; HOSTPROBE_WINDOWS, default 3): what share of the host's
#             time reaches the token, the most that taking the host out of the step could save
#   zerocopy  issue 39's choice (docs/decode-step-design.md): glm53 bench zero-copy on a generated one-MoE-layer
#             full-width checkpoint (5.5 GB in /tmp, kept): stock vs k misses read in place from pinned RAM vs k
#             misses copied H2D first, k = 1, 2, 4, 8, ms per layer, GB/s, bit-identity; (iv) stock beside the
#             preset's pacing spin on another stream (does the emulation hold the expert kernel back?). No CPU-lane build:
#             `python3 -u -m glm53 bench zero-copy --work /tmp --keep` alone is the whole step (~1 min warm)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-nvmeshm,nvme,nvme16,tiny,width,server,bench,lane}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/summary.log"; }
gpu_pytest() {  # name, limit (s), pytest args...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -m gpu -q -s -p no:cacheprovider --basetemp="/tmp/pt-$name" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  rm -rf "/tmp/pt-$name"
  stamp "$name rc=$rc"
  return $rc
}
# Triton compiles exllamav3's fla kernels and attention shapes on first use (minutes on a fresh machine): one cache for
# every step, seeded from .device-cache/triton.tar.xz (a previous call's $OUT/triton.tar.xz) and packed again at the end.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
if [ -f .device-cache/triton.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xJf .device-cache/triton.tar.xz -C "$TRITON_CACHE_DIR"
  stamp "triton cache seeded: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/summary.log" 2>&1
if [ -d .device-cache/extra ] && ! python3 -c "import fastapi" 2>/dev/null; then
  pip install -q --no-index --no-deps --target /tmp/site-extra .device-cache/extra/*.whl >> "$OUT/summary.log" 2>&1
  export PYTHONPATH="${PYTHONPATH:-}:/tmp/site-extra"
fi
# The CPU-lane kernel is built per Python (the GPU machine's is 3.12); the working tree carries no build.
# KERNEL_BUILD=0 skips it (a minute on a fresh machine) for steps that never run the lane (exact mode, the server).
if [ "${KERNEL_BUILD:-1}" = 1 ]; then
  python3 setup.py -q build_ext --inplace > "$OUT/kernel-build.log" 2>&1
  stamp "kernel build rc=$? $(python3 -c 'from glm53.cpu_lane import kernel; print(kernel.supported_isas() or kernel.unavailable_reason())' 2>&1)"
fi
step_tiers() {
  gpu_pytest tiers 120 tests/tiers/test_tiers_gpu.py tests/tiers/test_nvme_tier_gpu.py
}
step_tiny() {
  step_tiers
  gpu_pytest modes-tiny 300 tests/engine/test_gpu_modes.py -k tiny
  gpu_pytest exact-tiny 360 tests/engine/test_gpu_engine.py -k "tiny or engine"
}
step_modes() {  # the near-exact modes' KL and nvme-exact's bit-identity, tiny and full width, without the exact suites
  gpu_pytest modes-tiny 300 tests/engine/test_gpu_modes.py -k tiny
  gpu_pytest modes-width 400 tests/engine/test_gpu_modes.py -k "glm53_width or every_cold_pick"
}
step_server() {  # the first engine start on a fresh machine compiles the warm-up's shapes (~170 s on the tiny model)
  GLM53_TEST_ENGINE=exl3 timeout 420 python3 -m pytest -q -p no:cacheprovider tests/server/test_server_conformance.py \
    > "$OUT/server.log" 2>&1
  stamp "server rc=$?"
  GLM53_TEST_ENGINE=exl3 timeout 400 python3 -m pytest -q -p no:cacheprovider tests/server/test_server_kv.py \
    > "$OUT/server-kv.log" 2>&1
  stamp "server-kv rc=$?"
}
step_width() {
  gpu_pytest modes-width 400 tests/engine/test_gpu_modes.py -k "glm53_width or every_cold_pick"
  gpu_pytest exact-width 500 tests/engine/test_gpu_engine.py -k glm53_width
}
step_bench() {
  timeout 540 python3 -m glm53 bench decode --moe-layers 8 --tokens 128 --windows 3 --profile exact --work /tmp --keep \
    --modes exact,fast \
    --json "$OUT/bench-decode.json" > "$OUT/bench-decode.log" 2>&1
  stamp "bench rc=$?"
}
step_emu() {  # issue 38: the paced link's own rate, then bench decode under the consumer-box preset (8 MoE layers)
  gpu_pytest emu-link 120 tests/bench/test_emulate.py
  timeout "${EMU_BENCH_LIMIT:-480}" python3 -u -m glm53 bench decode --moe-layers 8 --tokens 96 --windows "${EMU_WINDOWS:-2}" \
    --warmup-tokens 64 --work /tmp --keep --modes "${EMU_MODES:-exact,fast}" --emulate rtx3090-gen4 \
    ${EMU_PROFILE:+--profile "$EMU_PROFILE"} --json "$OUT/bench-emu.json" > "$OUT/bench-emu.log" 2>&1
  stamp "emu rc=$?"
}
step_grid() {  # issue 38's grid: link R (GRID_RATES GB/s) x VRAM slots a layer (GRID_SLOTS of 288) x three modes, each
  # point one bench decode call under the preset (its forecast printed beside each measurement); ~2-3 min a point
  for r in ${GRID_RATES:-12 25 50}; do
    for s in ${GRID_SLOTS:-32 64}; do
      timeout "${GRID_LIMIT:-300}" python3 -u -m glm53 bench decode --moe-layers 8 --tokens 64 --windows 1 \
        --warmup-tokens 32 --work /tmp --keep --modes "${GRID_MODES:-exact,fast,nvme-exact}" --emulate rtx3090-gen4 \
        --link-GBps "$r" --slots "$s" --json "$OUT/grid-$r-$s.json" > "$OUT/grid-$r-$s.log" 2>&1
      stamp "grid R=$r slots=$s rc=$?"
    done
  done
}
step_emuserve() {  # the emulated server (glm53.bench.emulated_serve) on CUDA: one stream through HTTP, exact
  local model
  model=$(find /tmp -maxdepth 2 -type d -path '/tmp/glm53-bench-8L-*/ckpt' 2>/dev/null | head -1)
  if [ -z "$model" ]; then stamp "emuserve: run step emu first (it keeps the 8-MoE-layer checkpoint in /tmp)"; return 1; fi
  # A 12 GiB budget so the plan tiers this 22 GB checkpoint; the preset then caps the slots at the card's share.
  GLM53_VRAM_BUDGET_GB=${EMUSERVE_BUDGET:-12} timeout "${EMUSERVE_LIMIT:-240}" python3 -u -m glm53 bench serve --model "$model" --mode exact --concurrency 1 \
    --prompt-tokens 256 --max-tokens 64 --emulate rtx3090-gen4 --log-dir "$OUT/emuserve" \
    --json "$OUT/bench-emuserve.json" > "$OUT/bench-emuserve.log" 2>&1
  stamp "emuserve rc=$? $(grep -o 'emulating rtx3090-gen4: VRAM slots per MoE layer [^,]*' "$OUT/emuserve/serve.log" | head -1)"
}
step_paired() {  # issue 23's done-when: this code / b38dea7's, exact, fast and nvme-exact, paired windows
  timeout "${PAIRED_LIMIT:-560}" python3 -u -m glm53 bench decode --baseline b38dea7 --baseline-tree .baseline \
    --baseline-windows "${PAIRS:-3}" --moe-layers 8 --tokens 96 --windows 1 --warmup-tokens 64 --work /tmp/paired \
    --keep --modes exact,fast,nvme-exact --json "$OUT/bench-paired.json" > "$OUT/bench-paired.log" 2>&1
  stamp "paired rc=$?"
}
step_nvme() {  # issue 7's shape: 8 MoE layers, next to fast and exact, at the 55 GiB fraction (nvme16: 16 GiB)
  timeout 560 python3 -u -m glm53 bench decode --moe-layers 8 --tokens 96 --windows 3 --warmup-tokens 192 --work /tmp \
    --keep --modes "${NVME_MODES:-exact,fast,nvme-exact,nvme}" \
    --json "$OUT/bench-nvme.json" > "$OUT/bench-nvme.log" 2>&1
  stamp "nvme rc=$?"
}
step_nvmequick() {  # the nvme step shortened (~330 s on a fresh machine): 3 windows of 64 tokens
  timeout 560 python3 -u -m glm53 bench decode --moe-layers 8 --tokens 64 --windows 3 --warmup-tokens 96 --work /tmp \
    --keep --modes "${NVME_MODES:-exact,nvme-exact}" \
    --json "$OUT/bench-nvme.json" > "$OUT/bench-nvme.log" 2>&1
  stamp "nvme (short) rc=$?"
}
step_nvmeshm() {  # the 55 GiB fraction with the store in RAM (/dev/shm): what nvme gives when the disk keeps up
  timeout 560 python3 -u -m glm53 bench decode --moe-layers 8 --tokens 96 --windows 3 --warmup-tokens 128 --work /tmp \
    --keep --store-dir /dev/shm \
    --modes "${NVMESHM_MODES:-fast,nvme,nvme-exact}" \
    --profile "${PROFILE:-nvme-exact}" \
    --json "$OUT/bench-nvmeshm.json" > "$OUT/bench-nvmeshm.log" 2>&1
  stamp "nvme, store in RAM, rc=$?"
  rm -rf /dev/shm/glm53-bench-*
}
step_nvmeemu() {  # the 55 GiB fraction on emulated drives: the store in /dev/shm, its reads paced at each rate
  for gbps in ${EMU_GBPS:-6 2}; do  # GB/s: a PCIe Gen4 NVMe drive, then this machine's virtual disk's rate
    timeout "${EMU_LIMIT:-280}" python3 -u -m glm53 bench decode --moe-layers 8 --tokens 96 --windows 3 \
      --warmup-tokens 128 --work /tmp --keep --store-dir /dev/shm --emulate-disk-GBps "$gbps" \
      --modes "${NVMEEMU_MODES:-fast,nvme-exact,nvme}" \
      --json "$OUT/bench-nvmeemu-$gbps.json" > "$OUT/bench-nvmeemu-$gbps.log" 2>&1
    stamp "nvme, emulated $gbps GB/s drive, rc=$?"
  done
  rm -rf /dev/shm/glm53-bench-*
}
step_disk() {  # the store disk's raw rate by reads in flight (needs a store from the nvme step)
  timeout 120 python3 -m glm53 bench disk-sweep /tmp/glm53-bench-8L-0.11-0.4/experts.glm53 \
    --records 200 > "$OUT/disk-sweep.log" 2>&1
  stamp "disk sweep rc=$?"
}
step_nvme16() {
  timeout 540 python3 -m glm53 bench decode --moe-layers 8 --tokens 96 --windows 3 --warmup-tokens 192 --work /tmp --keep --modes exact,nvme-exact,nvme \
    --ram-fraction 0.125 --json "$OUT/bench-nvme16.json" > "$OUT/bench-nvme16.log" 2>&1
  stamp "nvme 16 GiB fraction rc=$?"
}
step_vision() {  # issue 42: images through the tower, exact vs stock, the tower's VRAM and the screenshot's TTFT
  gpu_pytest vision "${VISION_LIMIT:-580}" tests/engine/test_gpu_vision.py ${VISION_K:+-k "$VISION_K"}
}
step_split1() {  # issue 28 on one GPU: a two-way split onto the same card
  gpu_pytest split1 420 tests/engine/test_gpu_split.py -k same_card
}
step_split2() {  # issue 28 on two GPUs: bit-identity, a 250,000-token prompt, then the paired decode bench
  gpu_pytest split2 420 tests/engine/test_gpu_split.py -k two_cards
  timeout 540 python3 -u -m glm53 bench decode --moe-layers "${SPLIT_LAYERS:-8}" --tokens 96 --windows 3 \
    --warmup-tokens 64 --work /tmp --keep --modes exact,fast --devices 2 \
    --json "$OUT/bench-split2.json" > "$OUT/bench-split2.log" 2>&1
  stamp "bench decode --devices 2 rc=$?"
}
step_depthprobe() {
  timeout 560 python3 -u -m glm53 bench depth-probe --experts "${DEPTH_EXPERTS:-8}" --work /tmp \
    --json "$OUT/depthprobe.json" > "$OUT/depthprobe.log" 2>&1
  local rc=$?
  stamp "depthprobe rc=$rc $(grep -E '^(fixture|loaded|[0-9]+-token)' "$OUT/depthprobe.log" | tr '\n' ';')"
}
depth_disk() {  # the full-depth checkpoint (~26 GB) and its store (~19 GB) need the room other steps' files take
  local free
  free=$(df --output=avail -B1G /tmp | tail -1 | tr -d ' ')
  if [ "${free:-0}" -lt 50 ]; then
    stamp "depth: ${free} GB free in /tmp: removing other steps' kept /tmp/glm53-bench-* files"
    rm -rf /tmp/glm53-bench-* /tmp/paired
  fi
}
depth_call() {  # name, modes: one `glm53 bench depth` call on the kept fixture; stock from an earlier call if absent
  local name=$1 modes=$2 ref refarg=()
  depth_disk
  mkdir -p /tmp/depth
  if [[ ",$modes," != *,stock,* ]]; then
    ref=${DEPTH_REF:-$(find /tmp/depth -maxdepth 1 -name 'call-*stock*.json' 2>/dev/null | sort | tail -1)}
    if [ -n "$ref" ] && [ -f "$ref" ]; then refarg=(--reference "$ref"); else stamp "$name: no stock call to refer to"; fi
  fi
  timeout "${DEPTH_LIMIT:-540}" python3 -u -m glm53 bench depth --work /tmp/depth --keep --modes "$modes" \
    ${DEPTH_FIXTURE:+--fixture "$DEPTH_FIXTURE"} --concurrency "${DEPTH_CONCURRENCY:-0}" --tokens 64 --profile-tokens 16 --checks "${refarg[@]}" \
    --json "/tmp/depth/call-${modes//,/-}.json" > "$OUT/bench-$name.log" 2>&1
  stamp "$name rc=$?"
  cp /tmp/depth/call-*.json /tmp/depth/depth-*.json "$OUT/" 2>/dev/null  # every call's JSON, each mode's own too
}
step_depth() {  # issue 25, first call: stock (the reference) and exact; the fixture is generated once and kept
  depth_call depth "${DEPTH_MODES:-stock,exact}"
}
step_depth2() {  # issue 25, second call: fast and nvme-exact against the first call's stock
  depth_call depth2 "${DEPTH2_MODES:-fast,nvme-exact}"
}
step_lane() {
  { lscpu; numactl --hardware 2>/dev/null; grep -m1 MHz /proc/cpuinfo; } > "$OUT/lscpu.log" 2>&1
  timeout 300 python3 -m glm53 bench cpu-lane --thread-list 1,2,4,8,12,15,16 --json "$OUT/bench-cpu-lane.json" \
    > "$OUT/bench-cpu-lane.log" 2>&1
  stamp "lane rc=$?"
  timeout 120 python3 -m glm53 bench cpu-lane --thread-list 8,15 --no-pin >> "$OUT/bench-cpu-lane.log" 2>&1
  stamp "lane unpinned rc=$?"
}
step_intpaths() {  # issue 40: every integer path (AVX2, AVX2-VNNI, AVX-512, AVX-512 VNNI) against the reference kernel
  # (the CPU suite), then each one's one-row and 8-row time at 15 threads beside the exact kernel
  if [ "${INTPATHS_TESTS:-1}" = 1 ]; then  # INTPATHS_TESTS=0: the timings alone (the suite ran on a host of these ISAs)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/cpu_lane/test_cpu_lane_kernel.py > "$OUT/intpaths-tests.log" 2>&1
    stamp "intpaths tests rc=$? $(tail -1 "$OUT/intpaths-tests.log")"
  fi
  for isa in avx2 avx2vnni avx512 avx512vnni; do
    timeout 60 python3 -m glm53 bench cpu-lane --thread-list "${INTPATHS_THREADS:-1,15}" --rows 1,8 --isa "$isa" --kernel int \
      --json "$OUT/intpaths-$isa.json" > "$OUT/intpaths-$isa.log" 2>&1
    stamp "intpaths $isa rc=$? $(grep -E '^ +15 ' "$OUT/intpaths-$isa.log" | tr -s ' ' | tr '\n' ';')"
  done
}
step_phases() {  # issue 40: the clock under load, and where the served lane kernel's time goes at 1..15 threads
  gcc -O2 -pthread -mavx512f -o /tmp/clock_probe tests/gpu/clock_probe.c && /tmp/clock_probe 1 2 4 8 15 16 > "$OUT/clock.log" 2>&1
  stamp "clock rc=$? $(tr -s ' ' < "$OUT/clock.log" | tr '\n' ';')"
  { lscpu; grep -m1 MHz /proc/cpuinfo; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list; } > "$OUT/lscpu.log" 2>&1
  timeout 200 python3 -m glm53 bench cpu-lane --thread-list "${PHASES_THREADS:-1,4,8,15}" --rows 1,8 --isa "${PHASES_ISA:-avx512vnni}" \
    --kernel int --json "$OUT/phases.json" > "$OUT/phases.log" 2>&1
  stamp "phases rc=$? $(grep -A1 -E '^ +15 +1 ' "$OUT/phases.log" | tr -s ' ' | tr '\n' ';')"
  timeout 60 python3 -m glm53 bench cpu-lane --thread-list 15 --rows 1 --experts 1 --isa "${PHASES_ISA:-avx512vnni}" \
    --kernel int > "$OUT/phases-one.log" 2>&1
  stamp "phases, one expert a call rc=$? $(grep -A1 -E '^ +15 +1 ' "$OUT/phases-one.log" | tr -s ' ' | tr '\n' ';')"
  if [ -n "${PHASES_BASE:-}" ]; then  # PHASES_BASE=<kernel.cpp>: this tree built with that kernel.cpp, timed beside it
    rm -rf /tmp/phbase && mkdir -p /tmp/phbase && cp -r glm53 setup.py pyproject.toml store /tmp/phbase/ \
      && cp "$PHASES_BASE" /tmp/phbase/glm53/cpu_lane/kernel.cpp && rm -f /tmp/phbase/glm53/cpu_lane/_expert_kernel*.so \
      && (cd /tmp/phbase && python3 setup.py -q build_ext --inplace > /dev/null 2>&1)
    for eg in 1:0 4:0 1:1000; do  # experts a call : idle us before each (1000: decode's cadence, workers asleep)
      local e=${eg%:*} g=${eg#*:}
      timeout 90 python3 -m glm53 bench cpu-lane --thread-list 8,15 --rows 1 --experts "$e" --gap-us "$g" --repeats 9 \
        --isa "${PHASES_ISA:-avx512vnni}" --kernel int --baseline-lib "$(ls /tmp/phbase/glm53/cpu_lane/_expert_kernel*.so)" \
        > "$OUT/phases-base-$e-$g.log" 2>&1
      stamp "phases vs $PHASES_BASE, $e experts a call, gap $g us rc=$? $(grep -E '^ +(8|15) +1 ' "$OUT/phases-base-$e-$g.log" | tr -s ' ' | tr '\n' ';')"
    done
  fi
}
step_planmem() {  # issue 25: the plan's prefill-activation and reserve estimates against what a prefill holds
  # (GLM53_MEMORY_CKPT=<full-depth fixture> for the reserve's real figure; default a full-width 4-layer one)
  OUT="$OUT" gpu_pytest planmem 500 tests/test_engine_spec.py -k gpu_prefill_memory
}
wait_ready() {  # url, seconds: poll /ready until 200
  python3 - "$1" "$2" <<'PY'
import sys, time, urllib.request
url, deadline = sys.argv[1], time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        if urllib.request.urlopen(url + "/ready", timeout=5).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit(1)
PY
}
step_agent() {  # issue 26: prefix reuse and TTFT over a 60K-token agent session (needs MODEL; STORE: nvme-exact)
  if [ -z "${MODEL:-}" ]; then stamp "agent: set MODEL=<checkpoint dir> (the full-depth fixture)"; return 1; fi
  local mode=exact port=30123 end=$(( $(date +%s) + ${AGENT_LIMIT:-520} ))
  [ -n "${STORE:-}" ] && mode=nvme-exact
  # DIAGNOSE=1: the server's Triton compiles, GC pauses and sampled stacks (tests/gpu/diagnose), against slow turns
  local hook=()
  [ -n "${DIAGNOSE:-}" ] && hook=(env "GLM53_DIAG=$OUT/agent-$mode" "PYTHONPATH=$PWD/tests/gpu/diagnose:${PYTHONPATH:-}")
  GLM53_MODEL_DIR="$MODEL" GLM53_MODE=$mode GLM53_STORE="${STORE:-}" GLM53_PORT=$port \
    "${hook[@]}" python3 -u -m glm53 serve > "$OUT/agent-$mode-serve.log" 2>&1 &
  local pid=$!
  if wait_ready "http://127.0.0.1:$port" $(( end - $(date +%s) - 60 )); then
    stamp "agent $mode: server ready"
    local args=(--url "http://127.0.0.1:$port" --target-tokens "${AGENT_TOKENS:-60000}" --turns 16 --reply-tokens 32)
    timeout $(( (end - $(date +%s)) * 55 / 100 )) python3 -u -m glm53 bench agent "${args[@]}" --seed 1 \
      --json "$OUT/bench-agent-$mode-dropped.json" > "$OUT/bench-agent-$mode-dropped.log" 2>&1
    stamp "agent $mode, reasoning dropped, rc=$?"
    timeout $(( end - $(date +%s) )) python3 -u -m glm53 bench agent "${args[@]}" --seed 2 --keep-reasoning \
      --reasoning-tokens 0 --json "$OUT/bench-agent-$mode-kept.json" > "$OUT/bench-agent-$mode-kept.log" 2>&1
    stamp "agent $mode, reasoning kept, rc=$?"
  else
    stamp "agent $mode: the server was not ready (see agent-$mode-serve.log)"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
step_clients() {  # issue 35: the real clients' captured requests replayed against glm53 serve on the full-depth fixture
  local model=${MODEL:-/tmp/fx} port=30124 end=$(( $(date +%s) + ${CLIENTS_LIMIT:-560} ))
  if [ ! -f "$model/config.json" ]; then
    stamp "clients: generating the full-depth fixture into $model"
    timeout $(( end - $(date +%s) - 300 )) python3 -m glm53 fixture --kind exl3 --shape glm53 --depth full \
      --experts "${DEPTH_EXPERTS:-48}" --out "$model" > "$OUT/clients-fixture.log" 2>&1 || { stamp "clients: fixture failed"; return 1; }
    stamp "clients: fixture ready"
  fi
  GLM53_MODEL_DIR="$model" GLM53_MODE=exact GLM53_VRAM_BUDGET_GB=24 GLM53_CONTEXT=65536 GLM53_PORT=$port \
    python3 -u -m glm53 serve > "$OUT/clients-serve.log" 2>&1 &
  local pid=$! ready=1
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt $(( end - 60 )) ]; do
    if curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then ready=0; break; fi
    sleep 2
  done
  if [ $ready -eq 0 ]; then
    stamp "clients: server ready"
    timeout $(( end - $(date +%s) )) python3 -u tests/gpu/replay_clients.py "http://127.0.0.1:$port" \
      --json "$OUT/clients.json" > "$OUT/clients.log" 2>&1
    stamp "clients: replayed, rc=$?"
  else
    stamp "clients: the server was not ready (see clients-serve.log)"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
step_serveconc() {  # issue 26: decode tok/s at 1, 2, 4, 8 concurrent streams through HTTP
  if [ -z "${MODEL:-}" ]; then stamp "serveconc: set MODEL=<checkpoint dir>"; return 1; fi
  local mode=${SERVE_MODE:-exact}
  timeout 540 python3 -u -m glm53 bench serve --model "$MODEL" --mode "$mode" ${STORE:+--store "$STORE"} \
    --concurrency 1,2,4,8 --prompt-tokens 512 --max-tokens 96 --rounds 2 --log-dir "$OUT/serveconc-$mode" \
    --json "$OUT/bench-serve-$mode.json" > "$OUT/bench-serve-$mode.log" 2>&1
  stamp "serveconc $mode rc=$?"
}
step_fairness() {
  [ -d /tmp/fx ] || python3 -m glm53 fixture --kind exl3 --out /tmp/fx > "$OUT/fx.log" 2>&1
  local n=${FAIR_UNBOUNDED:-2}  # unbounded replies beside the short request, on FAIR_SLOTS (default 2) decode slots
  GLM53_MODE=exact GLM53_MAX_CONCURRENCY=${FAIR_SLOTS:-2} GLM53_CONTEXT=${FAIR_CONTEXT:-32768} timeout "${FAIR_LIMIT:-400}" \
    python3 -m glm53 bench fairness --model /tmp/fx --unbounded "$n" --rounds 3 --log-dir "$OUT/fair-$n" \
    --json "$OUT/fair-exl3-$n.json" > "$OUT/fair-$n.log" 2>&1
  stamp "fairness ($n unbounded, ${FAIR_SLOTS:-2} slots) rc=$? $(tail -4 "$OUT/fair-$n.log" | tr '\n' ';')"
}
step_imageprobe() {  # issue 36's GPU half: can this machine build the image's CUDA stage? (tools, namespaces, network)
  {
    for tool in buildah podman docker runc crun debootstrap apt-get nvcc; do
      printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo absent)"
    done
    echo "uid: $(id -u); user namespaces: $(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo unknown)"
    unshare --user --map-root-user true 2>&1 && echo "unshare --user: ok" || echo "unshare --user: failed"
    echo "overlay in /proc/filesystems: $(grep -c overlay /proc/filesystems)"; ls -l /dev/fuse 2>&1
    echo "disk free in /tmp: $(df --output=avail -BG /tmp | tail -1)"
    timeout 20 python3 -m pip download -q --no-deps -d /tmp/probe-wheel tini-placeholder-nonexistent==0 2>&1 | tail -2
    timeout 10 python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/', timeout=5)" 2>&1 | tail -1
    timeout 10 python3 -c "import urllib.request; urllib.request.urlopen('http://archive.ubuntu.com/ubuntu/', timeout=5)" 2>&1 | tail -1
  } > "$OUT/imageprobe.log" 2>&1
  stamp "imageprobe: $(tr '\n' ';' < "$OUT/imageprobe.log" | cut -c1-900)"
}
step_handoff() {  # issue 39's stream-ordered lane hand-off: late lane jobs recomputed behind it, then the lane panel
  gpu_pytest handoff "${HANDOFF_LIMIT:-300}" -o faulthandler_timeout="${HANDOFF_DUMP:-150}" tests/engine/test_gpu_modes.py \
    -k "${HANDOFF_K:-late_lane or failed_lane}"
  stamp "handoff: $(grep -E 'late lane|lane kernel|positions|passed|failed' "$OUT/handoff.log" | tr '\n' ';' | cut -c1-900)"
}
step_gate() {  # issue 39: nvme-exact beside exact with every expert in RAM (no store reads: the lookahead gated off)
  timeout "${GATE_LIMIT:-300}" python3 -u -m glm53 bench decode --moe-layers 8 --tokens 96 --windows 2 \
    --warmup-tokens 64 --work /tmp --keep --modes exact,nvme-exact --ram-fraction 1.0 --emulate rtx3090-gen4 \
    --json "$OUT/bench-gate.json" > "$OUT/bench-gate.log" 2>&1
  stamp "gate rc=$? $(tail -12 "$OUT/bench-gate.log" | tr '\n' ';' | cut -c1-900)"
}
step_prestage() {  # issue 39 item 3: exact with the prestage against PRESTAGE_BASE (the commit before it), paired
  # windows under the consumer-box preset (needs PRESTAGE_BASE unpacked in PRESTAGE_TREE, default .baseline, carried)
  timeout "${PRESTAGE_LIMIT:-420}" python3 -u -m glm53 bench decode --baseline "${PRESTAGE_BASE:-f9d725d}" \
    --baseline-tree "${PRESTAGE_TREE:-.baseline}" --baseline-windows "${PAIRS:-2}" --moe-layers 8 --tokens 96 --windows 1 \
    --warmup-tokens 64 --work /tmp --keep --modes "${PRESTAGE_MODES:-exact}" --emulate rtx3090-gen4 \
    --json "$OUT/bench-prestage.json" > "$OUT/bench-prestage.log" 2>&1
  stamp "prestage rc=$? $(grep -E 'x stock|exact|over|median' "$OUT/bench-prestage.log" | tail -8 | tr '\n' ';' | cut -c1-900)"
}
step_hostprobe() {  # issue 39 item 1's ceiling: exact beside itself with HOSTPROBE_US (default 100) more host time a
  # layer step, under the preset at HOSTPROBE_RATE GB/s (default 25): the share of host time that reaches the token
  timeout "${HOSTPROBE_LIMIT:-300}" python3 -u -m glm53 bench decode --moe-layers 8 --tokens 64 --windows "${HOSTPROBE_WINDOWS:-3}" \
    --warmup-tokens 32 --work /tmp --keep --modes "${HOSTPROBE_MODES:-exact}" --emulate rtx3090-gen4 \
    --link-GBps "${HOSTPROBE_RATE:-25}" --host-delay-us "${HOSTPROBE_US:-100}" --json "$OUT/hostprobe.json" \
    > "$OUT/hostprobe.log" 2>&1
  stamp "hostprobe rc=$? $(grep -E '^window |critical path' "$OUT/hostprobe.log" | tail -7 | tr '\n' ';' | cut -c1-900)"
}
step_zerocopy() {
  timeout "${ZC_LIMIT:-300}" python3 -u -m glm53 bench zero-copy --work /tmp --keep --json "$OUT/bench-zero-copy.json" \
    > "$OUT/bench-zero-copy.log" 2>&1
  local rc=$?
  stamp "bench zero-copy rc=$rc $(grep -E '^ +[0-9]+ \||zero-copy is|bit-identical to stock|^\(iv\)|^\(v\)' "$OUT/bench-zero-copy.log" | tr '\n' ';')"
}
for step in ${STEPS//,/ }; do
  if declare -F "step_$step" > /dev/null; then
    "step_$step"
  else
    stamp "unknown step $step (known: $(declare -F | sed -n 's/^declare -f step_//p' | tr '\n' ' '))"
  fi
done
if [ -d "$TRITON_CACHE_DIR" ] && [ "${TRITON_PACK:-1}" = 1 ]; then  # TRITON_PACK=0: no pack (~45 s) where the cache is current
  tar -cJf "$OUT/triton.tar.xz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
  stamp "triton cache packed: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files, $(du -k "$OUT/triton.tar.xz" | cut -f1) KiB"
fi
