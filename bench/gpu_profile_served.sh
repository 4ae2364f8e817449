#!/usr/bin/env bash
# Where the served path spends its CPU on the H200 (issue 25): py-spy samples the worker actor, its engine process and the gateway
# replicas while bench/served.py holds C clients on `pulse serve --backend cupy` (h200 profile, greedy story
# prompts, 128 tokens, PER_CLIENT requests per client). Staged as for bench/gpu_served.sh, plus py-spy (a static
# binary) at $PULSE_DEVICE_HOME/py-spy. One call:
#
#   CLIENTS="64 256" bash bench/gpu_profile_served.sh     # -> $OUT/profile-c<C>/stacks.tgz: spy-<pid>.txt (raw stacks)
#   CLIENTS=1000 SAMPLING=t1 SERVED_EXTRA="--profile-batch --client-procs 4" bash bench/gpu_profile_served.sh
#                                                         # past saturation: the profile's batch, the rest queued
#   CLIENTS=1 WORKLOAD=code PROFILE=cuda PER_CLIENT=300 SPY_S=8 PY_SPY=$home/site/bin/py-spy bash bench/gpu_profile_served.sh
#                                                         # one stream's speculative steps on an H100 (cuda profile)
#
# py-spy starts once the warm-up run has landed in records.jsonl, so it samples the first measured run
# (--nonblocking: it never pauses the process it reads; --threads: the engine thread and the event loop's apart).
# Each process's CPU time over the sampled window is read from /proc beside it (cpu-<pid>.txt).
set -u
source "$(dirname "$0")/gpu_env.sh"
spy=${PY_SPY:-$home/py-spy}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }  # utime + stime, clock ticks

for clients in ${CLIENTS:-256}; do
  out=${OUT:-/tmp}/profile-c$clients
  mkdir -p "$out"
  (
    for i in $(seq 1 300); do
      ls "$out"/served-logs-*/records.jsonl >/dev/null 2>&1 && break
      sleep 1
    done
    pids="$(pgrep -f 'ray::WorkerActor') $(pgrep -f 'workers.cupy.engine_process') $(pgrep -f 'ServeReplica')"
    for pid in $pids; do
      echo "$pid $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-120)" >> "$out/pids.txt"
      echo "start $(ticks "$pid") $(date +%s.%N)" > "$out/cpu-$pid.txt"
      "$spy" record --pid "$pid" --duration "${SPY_S:-12}" --rate 250 --nonblocking --threads --format raw \
        -o "$out/spy-$pid.txt" > "$out/spy-$pid.log" 2>&1 &
    done
    wait
    for pid in $pids; do echo "end $(ticks "$pid") $(date +%s.%N) hz $(getconf CLK_TCK)" >> "$out/cpu-$pid.txt"; done
  ) &
  timeout "${BENCH_TIMEOUT_S:-240}" python3 -m bench.served --model "$model" --device cuda --profile "${PROFILE:-h200}" \
    --targets pulse --workloads "${WORKLOAD:-story}" --sampling "${SAMPLING:-greedy}" --clients "$clients" --tokens 128 \
    ${SERVED_EXTRA:-} \
    --per-client "${PER_CLIENT:-8}" --repeats 1 --warmup 1 --duration 60 --timeout 120 --out "$out" --quiet \
    2>&1 | grep -v "^warning" | tail -4
  wait
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  for f in "$out"/cpu-*.txt; do echo "$f: $(tr '\n' ' ' < "$f")"; done
  # one file for the stacks and logs: the device call brings back only so many files
  (cd "$out" && tar czf stacks.tgz spy-* served-logs-* served-*.md && rm -rf spy-* served-logs-* served-*.png)
done
