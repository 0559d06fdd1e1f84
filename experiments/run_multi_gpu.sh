#!/usr/bin/env bash
# The multi-GPU runs, on whatever GPU count the machine has (2, 4 or 8), each call < 10 minutes.
# Results under ${OUT:-/tmp/mg}; every record is labelled with the D it ran at.
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh check    # env + correctness + 1000-call stress
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh timer    # the timer's resolution: one function timed twice
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh sustained  # layers back to back in one call: fused vs unfused under the power cap
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh sweep    # the 16 seed shapes at D = all GPUs
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh proxy8   # the D = 8 k_shard of each seed shape, at D = 2
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh ablate   # where the time goes; then autotune
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh probe    # communication paths side by side
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh numerics # error-ratio distributions, baseline
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh model    # TP block end to end (the shipped table)
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh layers_llama70b      # the XLA block's exposed communication per projection
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh layers_mixtral8x22b  # the same, Mixtral
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh ag       # retune the backward's all-gather matmul tiles
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh roofline # NVLink push/pull/local TMA vs CUDA figures
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh mesh2d   # 4 GPUs: (dp, tp) = (2, 2) vs 1-D D = 2
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh smallm   # M = 512/2048: GEMM core vs XLA's dot per tile shape
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh smallm_proxy8  # the same at D = 8's k_shard
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh timeline # M = 512/2048: per-call phase timeline (profiler)
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh issue19  # M = 512 (seed, proxy8): E and us above max(T_gemm, T_comm)
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh tiles    # M = 512/2048 (seed, proxy8): retune the CTA tile
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh owner    # D = 2, all 32 shapes: each entry with/without the TMA add
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh order    # M = 8192/32768 (seed, proxy8): retune the tile order
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh prefetch # D = 2, all 32 shapes: each entry with/without prefetch_tiles
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh spread   # D = 2, all 32 shapes: each entry with/without spread_stores
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh owner_pull  # the owner's epilogue pulls (comm_mode "owner") vs push / comm CTAs
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh chains   # 4 GPUs: the ring chain / sum slot (D > 2) vs receive slots / direct push
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh pull_wm  # 4 GPUs, M = 512: 4 pulling CTAs + TMA add + the M split vs the table
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh alone    # one GPU is enough: one rank's program alone
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh pingpong # Config.pingpong over NVLink: checked, stressed, timed
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh pingpong_one  # one GPU: Config.pingpong in loopback, its GEMM core
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh smallm_one  # one GPU: M = 512 GEMM cores, 192-column and ping-pong tiles
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh hang     # the NVLink test that hung 5 of 5 tries, alone / after its sibling
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh stall    # each warpgroup split with/without the TMA add, hangs isolated
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh stall_which   # the split or the 256-column wgmma: which stalls
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh stall_ablate  # the stalled config without the owner's wait / sum
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh stall_loopback  # one GPU: its code dumped, loopback D = 2/4/8
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_ALLOCATOR=default
out=${OUT:-/tmp/mg}; mkdir -p "$out"
quiet() { grep -v '^[IW][0-9]'; }
# The four projections' shape names, comma-joined: for each projection, each M in $1, each
# suffix after it ("" the seed shape, _proxy8 its D = 8 k_shard at D = 2).
projection_names() {
  local ms=$1 names="" p m s; shift
  for p in llama70b_o_proj llama70b_down_proj mixtral8x22b_o_proj mixtral8x22b_w2; do
    for m in $ms; do for s in "$@"; do names="$names${names:+,}${p}_m${m}${s}"; done; done
  done
  echo "$names"
}
case "${1:-check}" in
  check)
    nvidia-smi topo -m | tee "$out/topo.txt"
    python3 -c "import jax; print(jax.__version__, jax.devices())"
    timeout 520 python3 experiments/multi_gpu_check.py --out="$out/multi_gpu_check.json" 2>&1 \
      | quiet | tail -8 ;;
  timer)
    # Two executables of one function as candidates A and B (B / A = 1 but for the timer), in
    # blocks, in rounds and call by call (pallas_rs.bench.alternating), on two GPUs. One GPU
    # (BUILD_NOTES eighty-second and eighty-third sessions, H100 and H200) needs no rerun.
    timeout 300 python3 experiments/timer_check.py --num_devices=2 --functions=gemm,seq \
      --names=llama70b_down_proj_m8192,mixtral8x22b_o_proj_m512 \
      --out="$out/timer_check_2gpu.json" 2>&1 | quiet | tail -20
    # Long sessions, the unfused and the fused path: sessions of up to 512 MiB, 16 GiB (the limit
    # before 2026-12-05), 512 MiB of outputs; 2 rounds, so a 16 GiB session holds 6.4-12.8 GiB,
    # a long run of calls back to back. On one H100 at D = 1 they cost the kernel more than XLA's
    # dot, with the SM clock under the power cap (eighty-third, eighty-fourth sessions); at D = 2?
    # Each method's clock is in the JSON (gpu_clocks).
    i=0
    for lim in 512 16384 512; do
      i=$((i + 1))
      timeout 90 python3 experiments/timer_check.py --num_devices=2 --functions=seq,fused \
        --names=llama70b_down_proj_m8192 --methods=rounds,interleaved --repeats=1 --rounds=2 \
        --trace_calls=0 --session_limit_mib=$lim \
        --out="$out/timer_check_2gpu_held_${i}_${lim}mib.json" 2>&1 | quiet | tail -6
    done ;;
  sustained)
    # Row-parallel layers back to back in one call, as a training step runs them, at D = 2 on the
    # proxy8 shapes (D = 8's per-device work): the unfused path and the fused kernel (the table's
    # configs) taking turns, calls of 4 layers and of >= ~200 ms, the SM clock sampled. Does the
    # fused path's lead hold under the power cap? (D = 1 on one H200: BUILD_NOTES, 2026-12-06.)
    timeout 560 python3 experiments/sustained_load.py --devices=2 --tags=proxy8 \
      --steps=4,200ms,200ms --out="$out/sustained_2gpu_proxy8.json" 2>&1 | quiet | tail -40 ;;
  sweep)
    timeout 560 python3 experiments/matmul_rs_bench.py --mode=multi_gpu --tags=seed \
      --iterations=200 --implementations=xla,fused,auto --xla_peer --keep_going \
      --out="$out/multi_gpu_seed.json" 2>&1 | quiet | tail -40 ;;
  proxy8)
    timeout 560 python3 experiments/matmul_rs_bench.py --mode=multi_gpu --tags=proxy8 \
      --iterations=200 --implementations=xla,fused,auto --keep_going \
      --out="$out/multi_gpu_proxy8.json" 2>&1 | quiet | tail -40 ;;
  ablate)
    timeout 240 python3 experiments/ablate.py --out="$out/ablate.json" --names=\
llama70b_o_proj_m512,llama70b_o_proj_m32768,mixtral8x22b_w2_m2048,llama70b_down_proj_m8192 \
      2>&1 | quiet | tail -8
    timeout 320 python3 experiments/autotune.py --mode=multi_gpu --tags=seed --max_configs=3 \
      --iterations=30 --table="$out/tuning_table.json" --out="$out/autotune_multi_gpu.json" 2>&1 \
      | quiet | tail -20 ;;
  probe)
    # Direct push (ring = the D = 2 default numerics, v1 = fp32 partials) vs kernel v3's comm
    # CTAs pushing (c*) or pulling (p*), with their no-comm ablations (docs/design.md section
    # 3.2); comm variants also time without their mainloop (_nogemm: the in-kernel comm rate).
    timeout 570 python3 experiments/overlap_probe.py --what=check,time --iterations=30 \
      --variants=ring,c2_ring,c4_ring,c8_ring,p2_ring,p4_ring,p8_ring,v1 \
      --names=llama70b_o_proj_m512,mixtral8x22b_o_proj_m2048,llama70b_o_proj_m8192,llama70b_down_proj_m8192 \
      --proxy=llama70b_o_proj_m8192 --out="$out/overlap_probe.json" 2>&1 | quiet | tail -45 ;;
  numerics)
    timeout 400 python3 experiments/numerics.py --mode=loopback,multi_gpu \
      --what=baseline,sweep --time_budget_s=300 --out="$out/numerics.json" 2>&1 \
      | quiet | tail -40 ;;
  model)
    for model in llama70b mixtral8x22b; do
      timeout 200 python3 experiments/model_bench.py --mode=multi_gpu --model=$model \
        --m=2048,8192 --keep_going --out="$out/model_$model.json" 2>&1 | quiet | tail -12
    done
    ;;
  layers_llama70b|layers_mixtral8x22b)
    # Where the block's communication is exposed (issue 20): the XLA block with one projection's
    # collectives removed at a time (model_bench.py --per_layer), one model per call (six
    # programs per M and pass, compiles dominate); `model` times fused and "auto".
    model=${1#layers_}
    timeout 560 python3 experiments/model_bench.py --mode=multi_gpu --model="$model" \
      --m=2048,8192 --implementations=xla --per_layer --keep_going \
      --out="$out/model_layers_$model.json" 2>&1 | quiet | tail -14 ;;
  ag)
    # The backward's all-gather matmul (jax's kernel) at M <= 8192: its default and each CTA
    # tile of candidates.ag_tile_variants vs XLA, into a copy of the tuning table (2% margin).
    cp pallas_rs/tuning/data/tuning_table.json "$out/tuning_table.json"
    names=$(projection_names "512 2048 8192" "")
    timeout 560 python3 experiments/autotune.py --mode=multi_gpu --op=ag_matmul --names="$names" \
      --max_configs=8 --iterations=20 --margin=0.02 --table="$out/tuning_table.json" \
      --out="$out/autotune_ag.json" 2>&1 | quiet | tail -20 ;;
  roofline)
    # NVLink primitives as Mosaic GPU kernels at D = 2 (push, pull, local TMA, head-of-line
    # probe) against the CUDA microbenchmark figures in the script; table last.
    timeout 500 python3 experiments/nvlink_roofline.py --out="$out/nvlink_roofline.json" \
      2>&1 | quiet | tail -45 ;;
  mesh2d)
    # The fused op over "tp" of a (dp, tp) = (2, 2) mesh, each dp group its own data: correct,
    # bit-identical to 1-D D = 2 per group, "auto" as the table says, timed beside 1-D D = 2
    # (issue 21; needs 4 GPUs; the script skips the shapes it cannot start within 420 s).
    timeout 470 python3 experiments/mesh2d_check.py --out="$out/mesh2d_check.json" 2>&1 \
      | quiet | tail -24 ;;
  smallm|smallm_proxy8)
    # Issue 19: the kernel without communication or owner sum ("neither") against XLA's dot,
    # for the table's config, then with the owner's TMA add (tadd, D = 2) on the table's tiles
    # and the M split's 128 x 256 and 128 x 192, and the 128 x 256 at 4 steps with
    # prefetch_tiles (4 divides every seed and proxy8 k_shard's blocks), at M = 512 and 2048.
    suffix=""; [ "$1" = smallm_proxy8 ] && suffix=_proxy8
    names=$(projection_names "512 2048" "$suffix")
    timeout 540 python3 experiments/ablate.py --names="$names" --iterations=50 \
      --configs=table,tadd,tadd_t64x256_wm,tadd_t64x192_wm,tadd_t64x256_wm_s4_pf \
      --ablations=fused,neither \
      --out="$out/ablate_$1.json" 2>&1 | quiet | tail -75 ;;
  alone)
    # Issue 19 on one GPU: one rank's program of a D-device call alone on all SMs
    # (fused.rank_alone: no NVLink, no waits, no barrier): its GEMM core ("neither") and with its
    # local stores and owner loads ("no_comm") against XLA's dot of the same per-GPU GEMM, at
    # M = 512/2048, D = 2 (seed and proxy8 k_shard) and D = 8 (the pairs walk at M = 512),
    # there beside the configs that beat the table one rank alone on one H100 (BUILD_NOTES
    # 2026-12-07, 106th: the M split's 128 x 192 tile, the ping-pong, one epilogue slot);
    # ablate.py's "other us" column is jax's zero-fill of the semaphores.
    seed=$(projection_names "512 2048" ""); proxy=$(projection_names "512 2048" _proxy8)
    timeout 350 python3 experiments/ablate.py --alone --num_devices=2 --names="$seed,$proxy" \
      --iterations=50 --configs=table,tadd,tadd_t64x192_wm --ablations=no_comm,neither \
      --out="$out/ablate_alone_d2.json" 2>&1 | quiet | tail -90
    timeout 240 python3 experiments/ablate.py --alone --num_devices=8 --names="$seed" \
      --iterations=50 --configs=table,t64x192_wm_s4_o3_pf,t128x128_s5_pp_gm_g8,t128x128_s4_o1_pf \
      --ablations=no_comm,neither \
      --out="$out/ablate_alone_d8.json" 2>&1 | quiet | tail -80 ;;
  order|tiles)
    # Each shape's incumbent config (table or default) against candidates.order_variants
    # (order: every tile order at M = 8192 / 32768; row bands 8 high took 0-12% off the D = 2
    # table's GEMM core one rank alone at M = 32768, eleventh session) or tile_variants
    # (tiles, issue 19: every CTA tile shape at M = 512 / 2048, the M split's 128 x 256 /
    # 128 x 192 / 128 x 128 among them), seed and proxy8, into a copy of the tuning table; a
    # challenger needs a 2% win (--margin); one autotune call per M (the larger first for
    # order), each merging shape by shape into the table copy, so a cut call keeps what it
    # measured and the other M still runs.
    cp pallas_rs/tuning/data/tuning_table.json "$out/tuning_table.json"
    ms="512 2048"; [ "$1" = order ] && ms="32768 8192"
    for m in $ms; do
      names=$(projection_names "$m" "" _proxy8)
      timeout 275 python3 experiments/autotune.py --mode=multi_gpu --candidates="$1" --tags= \
        --names="$names" --iterations=20 --margin=0.02 --table="$out/tuning_table.json" \
        --out="$out/autotune_$1_m$m.json" 2>&1 | quiet | tail -14
    done ;;
  owner|prefetch|spread)
    # Each of the 32 D = 2 entries (seed and proxy8) with one switch flipped where it runs, into
    # a copy of the tuning table; a challenger needs a 2% win. "owner": the owner's sum by TMA
    # add (Config.tma_add, D = 2); "prefetch": the next tile's blocks loaded during this tile's
    # end (Config.prefetch_tiles: 2-10% off D = 8's short k_shards on one GPU, BUILD_NOTES
    # 2026-12-06), which the entries, measured before it, leave off; also at a depth one step
    # off the entry's where that lets it run (most entries' 3 steps divide no D = 2 k_shard).
    # "spread": a tile's stores (the pushes to the owner) spread over the next tile's blocks
    # (Config.spread_stores: on one H100 1-6% off a D = 8 rank's GEMM core; over NVLink, where
    # a push holds up the SM's next loads, never measured: BUILD_NOTES 2026-12-06, ninetieth).
    cp pallas_rs/tuning/data/tuning_table.json "$out/tuning_table.json"
    for tag in seed proxy8; do
      timeout 270 python3 experiments/autotune.py --mode=multi_gpu --candidates="$1" \
        --tags=$tag --iterations=20 --margin=0.02 --table="$out/tuning_table.json" \
        --out="$out/autotune_$1_$tag.json" 2>&1 | quiet | tail -18
    done ;;
  owner_pull)
    # comm_mode "owner" (docs/design.md section 3.2, never run over NVLink before): its bits
    # against the direct push, then its time against the table's config and 4 pulling comm CTAs
    # (fused and without communication: the exposed part), small M to large.
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/test_fused_multigpu.py -k owner_pull 2>&1 | tail -4
    timeout 360 python3 experiments/ablate.py --out="$out/ablate_owner_pull.json" \
      --configs=table,ow,p4 --ablations=fused,no_comm --iterations=50 --names=\
llama70b_o_proj_m512,llama70b_down_proj_m512,llama70b_o_proj_m2048,llama70b_down_proj_m2048,\
mixtral8x22b_w2_m2048,llama70b_o_proj_m8192,llama70b_o_proj_m8192_proxy8 2>&1 | quiet | tail -24 ;;
  chains)
    # D > 2 (four GPUs): pulling comm CTAs chaining the peers' partials by TMA add in ring order
    # (docs/design.md section 3.5), never run over NVLink before: their bits against the direct
    # push, then their time against the same comm CTAs with receive slots and the direct push,
    # in the ring's numerics (ring, into the output) and with fp32 partials (f32, the sum slot).
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/test_fused_multigpu.py -k chained_adds 2>&1 | tail -4
    timeout 360 python3 experiments/ablate.py --out="$out/ablate_chains.json" \
      --configs=ring,p4_ring,p4_ring_tadd,f32,p4_f32,p4_f32_tadd --ablations=fused \
      --iterations=30 --names=llama70b_o_proj_m2048,mixtral8x22b_w2_m2048,llama70b_o_proj_m8192 \
      2>&1 | quiet | tail -24 ;;
  pull_wm)
    # D > 2 (four GPUs), M = 512: four pulling comm CTAs chaining the adds into the output (the
    # ring's numerics) leave the compute CTAs the GEMM core, and the add lets NVLink take the M
    # split's tiles (128 x 192 for Mixtral's N = 6144, 128 x 256 for Llama's 8192): one rank
    # alone 8-37% less local work than the table's (BUILD_NOTES 2026-12-02, sixteenth session).
    # Their bits over NVLink first (also 64 x 384 tiles over 64-row chunks, D = 8's M = 512 path
    # without pairs: seventeenth session), then the time (fused, and without communication).
    # Mixtral's 128 x 192 tiles are one wave (4 chunks x 32 on 128 compute CTAs), so their pulls
    # start when it ends (1.5-wave tiles cost more local work than they would hide: BUILD_NOTES
    # 2026-12-02, seventeenth session).
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/test_fused_multigpu.py -k chained_adds 2>&1 | tail -4
    timeout 200 python3 experiments/ablate.py --out="$out/ablate_pull_wm_mixtral.json" \
      --configs=table,p4_ring_tadd_t64x192_wm,p4_ring_tadd --ablations=fused,no_comm \
      --iterations=50 --names=mixtral8x22b_o_proj_m512,mixtral8x22b_w2_m512 2>&1 | quiet | tail -16
    timeout 160 python3 experiments/ablate.py --out="$out/ablate_pull_wm_llama.json" \
      --configs=table,p4_ring_tadd_t64x256_wm,p4_ring_tadd --ablations=fused,no_comm \
      --iterations=50 --names=llama70b_o_proj_m512,llama70b_down_proj_m512 2>&1 \
      | quiet | tail -16 ;;
  issue19)
    # Issue 19's fused targets, first on x2: on the four M = 512 seed shapes (D = all GPUs) and
    # their proxy8 shapes (D = 2), E >= 0.9 and T_fused <= max(T_gemm, T_comm) + 5 us (the
    # table's over_us column), every output checked; `smallm`/`smallm_proxy8` time the cores.
    names=$(projection_names 512 "" _proxy8)
    timeout 560 python3 experiments/matmul_rs_bench.py --mode=multi_gpu --names="$names" \
      --iterations=200 --implementations=xla,fused,auto --keep_going \
      --out="$out/multi_gpu_issue19_m512.json" 2>&1 | quiet | tail -40 ;;
  timeline)
    # Issue 19: where a small-M call's time goes (Mosaic GPU profiler traces under $out/traces).
    timeout 400 python3 experiments/timeline.py --configs=table --trace_dir="$out/traces" \
      --names=llama70b_o_proj_m512,llama70b_down_proj_m512,mixtral8x22b_o_proj_m512,\
mixtral8x22b_w2_m512,llama70b_o_proj_m2048,mixtral8x22b_o_proj_m2048 \
      --out="$out/timeline.json" 2>&1 | quiet | tail -20 ;;
  stall)
    # The fifth session's stall (BUILD_NOTES): Llama o_proj's (n, k) at M = 512 / 2048 with the
    # warpgroups split along M or N, each with and without the TMA add, then 10 stress calls;
    # one process per variant, so a hang (stacks on stderr after 60 s) ends only its own.
    # The stack dump's top frames say whether a stalled call is compiling or running.
    for v in t64x256_wm_noadd t64x256_wm_tadd t128x128_wn_noadd t128x128_wn_tadd; do
      echo "== $v"
      timeout 140 python3 experiments/multi_gpu_check.py --variant=$v --m=512,2048 --unverified \
        --nk=8192x8192 --stress_calls=10 --case_timeout_s=60 --out="$out/stall_$v.json" 2>&1 \
        | tee "$out/stall_$v.log" | quiet | grep -E '^\{|^nvlink|Timeout|File' | head -24
    done
    # The same family in loopback on one GPU (D = 2, 4, 8 virtual ranks, the M = 2048 shape).
    echo "== loopback t64x256_wm_noadd"
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 experiments/multi_gpu_check.py \
      --variant=t64x256_wm_noadd --m=2048 --nk=8192x8192 --stress_calls=4 --case_timeout_s=60 \
      --out="$out/stall_loopback.json" 2>&1 | tee "$out/stall_loopback.log" | quiet \
      | grep -E '^\{|^loopback|Timeout|File' | head -16 ;;
  pingpong)
    # Config.pingpong (the warpgroup tiles in turn through one SMEM ring) has never run over
    # NVLink (BUILD_NOTES 2026-12-07): Llama o_proj's and Mixtral w2's (n, k) at M = 2048 and
    # 8192, every element checked, then 20 stress calls; one process per variant, so a hang
    # ends only its own; then the fused time with and without it. nvlink_unverified's pingpong
    # clause is lifted only after this runs clean.
    for v in t128x128_wn_s4_pp t128x128_wn_s4_pp_tadd_ring; do
      echo "== $v"
      timeout 150 python3 experiments/multi_gpu_check.py --variant=$v --m=2048,8192 --unverified \
        --nk=8192x8192,6144x16384 --stress_calls=20 --case_timeout_s=60 \
        --out="$out/pingpong_$v.json" 2>&1 | tee "$out/pingpong_$v.log" | quiet \
        | grep -E '^\{|^nvlink|Timeout|File' | head -24
    done
    timeout 240 python3 experiments/ablate.py --unverified --iterations=50 \
      --names=llama70b_o_proj_m2048,llama70b_o_proj_m8192,mixtral8x22b_w2_m2048 \
      --configs=table,t128x128_wn_s4,t128x128_wn_s4_pp --ablations=fused,neither \
      --out="$out/ablate_pingpong.json" 2>&1 | quiet | tail -12 ;;
  pingpong_one)
    # One GPU: the fused body's ping-pong in loopback at D = 4 and 8, every element against the
    # error rule (clean on one H100, BUILD_NOTES 2026-12-07); then its GEMM core beside the
    # 4-step prefetch kernel's, D = 8's k_shard; on an H200 also the hundred-and-second entry's
    # spread variants and two more tile orders at M = 2048 (issue 19's two H200 misses; the
    # ping-pong closes both there: BUILD_NOTES 2026-12-07, 112th session).
    for d in 4 8; do
      timeout 120 python3 experiments/ablate.py --num_devices=$d --iterations=10 \
        --names=llama70b_o_proj_m2048,mixtral8x22b_w2_m2048 --configs=t128x128_s4,t128x128_s4_pp \
        --ablations=fused,neither --out="$out/ablate_pingpong_loopback_d$d.json" 2>&1 | quiet \
        | tail -12
    done
    h200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
    ms=2048,8192; [ "$h200" -gt 0 ] && ms=2048
    timeout 200 python3 experiments/gemm_core.py --projections=llama70b_o_proj,mixtral8x22b_o_proj \
      --ms=$ms --ds=8 --jax= --ours=t64x256_wm_s4_pf,t128x128_s5_pp_gm_g8,t128x128_s6_pp_gm_g8 \
      --iterations=40 \
      --out="$out/gemm_core_pingpong_fused.json" 2>&1 | quiet | tail -16
    if [ "$h200" -gt 0 ]; then
      timeout 200 python3 experiments/gemm_core.py --projections=llama70b_o_proj,mixtral8x22b_o_proj \
        --ms=2048 --ds=8 --jax= --iterations=40 \
        --ours=t64x256_wm_s4_pf,t64x256_wm_s3_pf_ss,t64x256_wm_s2_pf_ss,t64x256_wm_s3_ss,\
t64x256_wm_s3_pf_o4,t64x128_wm_s4_pf_ss,t128x128_wm_s2_pf_ss,t128x64_s4_pf_ss,\
t128x128_s6_pp_gm_g4,t128x128_s6_pp_gn_g4 \
        --out="$out/gemm_core_spread_h200.json" 2>&1 | quiet | tail -16
    fi ;;
  smallm_one)
    # One GPU (either card): issue 19's M = 512 GEMM core at D = 8's k_shard, the 4-step
    # prefetch kernel beside the two 128 x 192 CTA tile kernels fastest for Mixtral on an H200
    # (BUILD_NOTES 2026-12-06: 0.937-0.972x XLA's dot) and the ping-pong's tiles (on one H100,
    # 2026-12-07: 128 x 192 CTA tiles 0.98-1.00x for Mixtral, 64-row ping-pong tiles 1.02-1.42x).
    timeout 300 python3 experiments/gemm_core.py \
      --projections=llama70b_o_proj,llama70b_down_proj,mixtral8x22b_o_proj,mixtral8x22b_w2 \
      --ms=512 --ds=8 --jax= --iterations=40 \
      --ours=t64x256_wm_s4_pf,t64x192_wm_s4_o3_pf,t64x192_wm_s4_pf_ss,t128x128_s6_pp_gm_g8,\
t64x192_wm_s6_pp_gm_g8,t64x256_wm_s5_pp,t64x128_wm_s8_pp \
      --out="$out/gemm_core_smallm_one.json" 2>&1 | quiet | tail -16 ;;
  hang)
    # test_tma_add_bit_identical_over_nvlink[2048-8192-8192] hung in 5 of 5 tries (fifth
    # session 3, seventy-sixth 2), each after [512-2048-4096] had passed in the same process,
    # while both its configs ran alone (the `stall` step; the M split without the add 212 calls,
    # seventy-sixth session): the case alone in a fresh process, then the pair as the
    # selection runs it, then the pair the other way round (pytest keeps the order given);
    # pytest's faulthandler dumps every thread's stack at 95 s. Then the rest of the D = 2
    # NVLink bit tests the hang kept from running, one process.
    t=tests/test_fused_multigpu.py::test_tma_add_bit_identical_over_nvlink
    for sel in "$t[2048-8192-8192]" "$t[512-2048-4096] $t[2048-8192-8192]" \
               "$t[2048-8192-8192] $t[512-2048-4096]"; do
      echo "== $sel" | tee -a "$out/hang.log"
      # shellcheck disable=SC2086  # $sel: one or two test ids
      timeout 115 python3 -m pytest -q -p no:cacheprovider -m multigpu \
        -o faulthandler_timeout=95 $sel 2>&1 | tee -a "$out/hang.log" \
        | grep -E "passed|failed|Timeout|File|Thread" | head -24
    done
    echo "== owner_pull or pairs_split" | tee -a "$out/hang.log"
    timeout 180 python3 -m pytest -q -p no:cacheprovider -m multigpu -o faulthandler_timeout=160 \
      tests/test_fused_multigpu.py -k "owner_pull or pairs_split" 2>&1 | tee -a "$out/hang.log" \
      | grep -E "passed|failed|Timeout|File|Thread" | head -24 ;;
  stall_which)
    # Which feature of the stalled config stalls (after `stall`, if t64x256_wm_noadd stalled
    # again): the M split with 128-column wgmma tiles (t64x128_wm: 128 x 128 CTA tiles) and
    # 256-column wgmma tiles along N (t64x256_wn: 64 x 512, a 2-step pipeline), both without
    # the add, at Llama o_proj M = 2048; one process each. What stalls is what
    # fused.nvlink_unverified must keep refusing; what runs, it can let through.
    for v in t64x128_wm_noadd t64x256_wn_noadd; do
      echo "== $v"
      timeout 120 python3 experiments/multi_gpu_check.py --variant=$v --m=2048 --unverified \
        --nk=8192x8192 --stress_calls=10 --case_timeout_s=50 --out="$out/stall_which_$v.json" \
        2>&1 | tee "$out/stall_which_$v.log" | quiet | grep -E '^\{|^nvlink|Timeout|File' | head -16
    done ;;
  stall_ablate)
    # Which wait stalls (after `stall`): the stalled config at Llama o_proj M = 2048 with the
    # owner's wait or its sum (loads + adds) left out, one process each, ptxas register and
    # spill counts beside the N split's.
    for a in fused no_owner_wait no_reduce; do
      for v in t64x256_wm_noadd t128x128_wn_noadd; do
        echo "== $v $a"
        MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python3 experiments/ablate.py \
          --names=llama70b_o_proj_m2048 --configs=$v --ablations=$a --iterations=5 --unverified \
          --out="$out/stall_ablate_${v}_$a.json" 2>&1 | tee "$out/stall_ablate_${v}_$a.log" \
          | grep -E 'registers|spill|llama70b|Timeout|rror' | head -12
        echo "rc=${PIPESTATUS[0]}"
      done
    done ;;
  stall_loopback)
    # One GPU (when no x2 is lent): the stalled family's compiled code beside the N split's and
    # the TMA add's, in the loopback module (ablate.py, D = 2) and in the NVLink module built on
    # a one-device stand-in mesh (compile_probe.py: Mosaic GPU compiles it, XLA then refuses
    # it); PTX, ptxas and resource counts, with those runs' JSON and logs, tarred into
    # $out/stall_dumps.tgz (the device tool returns only a few files). Then the M split without the add checked in loopback at
    # D = 2, 4, 8 (the N split as the control), each in its own process with the hang watchdog.
    dumps=$(mktemp -d)
    for v in t64x256_wm_noadd t128x128_wn_noadd t64x256_wm_tadd; do
      mkdir -p "$dumps/loopback_$v" "$dumps/nvlink_$v"
      MOSAIC_GPU_DUMP_TO="$dumps/loopback_$v" MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1 \
        timeout 90 python3 experiments/ablate.py --num_devices=2 \
        --names=llama70b_o_proj_m2048 --configs=$v --ablations=fused --iterations=5 \
        --out="$dumps/stall_dump_$v.json" > "$dumps/stall_dump_$v.log" 2>&1
      echo "== loopback $v rc=$?"
      MOSAIC_GPU_DUMP_TO="$dumps/nvlink_$v" MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1 \
        timeout 150 python3 experiments/compile_probe.py --configs=$v --timeout_s=120 \
        --out="$dumps/compile_probe_$v.json" 2>&1 | tee "$dumps/compile_probe_$v.log" \
        | grep -E "^\{|Timeout" | cut -c1-160
    done
    (cd "$dumps" && tar czf "$out/stall_dumps.tgz" --exclude='*mlir-passes*' \
      --exclude='*constraint*' --exclude='*layout_inference*' .)
    for v in t64x256_wm_noadd t128x128_wn_noadd; do
      echo "== loopback $v"
      timeout 170 python3 experiments/multi_gpu_check.py --variant=$v --m=512,2048 \
        --nk=8192x8192 --stress_calls=4 --case_timeout_s=60 --out="$out/stall_loopback_$v.json" \
        2>&1 | tee "$out/stall_loopback_$v.log" | quiet | grep -E '^\{|^loopback|Timeout|File' \
        | cut -c1-200 | head -12
    done ;;
  *) echo "usage: $0 check|timer|sustained|sweep|proxy8|ablate|probe|numerics|model|layers_llama70b|layers_mixtral8x22b|ag|roofline|mesh2d|smallm|\
smallm_proxy8|issue19|timeline|tiles|order|owner|prefetch|spread|owner_pull|chains|pull_wm|alone|pingpong|pingpong_one|smallm_one|hang|stall|\
stall_which|stall_ablate|stall_loopback" >&2
     exit 2 ;;
esac
