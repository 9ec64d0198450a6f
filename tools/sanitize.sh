#!/usr/bin/env bash
# compute-sanitizer over tools/sanitize_gpu.py's cases: each tool in turn, a log per
# tool under $LOG_DIR, and one summary line per tool. From the repository root, on the GPU:
#
#   tools/sanitize.sh [TOOL ...] [-- sanitize_gpu.py options]      # e.g. racecheck -- --only decode/
#
# TOOL: plain (the script alone: its own checks, and every kernel JIT-compiled into the Triton
# cache so that each tool's run spends its time on the kernels, not in ptxas), memcheck,
# racecheck, synccheck, initcheck, poison (the script with --poison, no sanitizer: every
# allocation torch leaves uninitialized starts as NaN, so a read of a byte no kernel wrote shows
# in a case's result, where initcheck cannot see the write: TMA stores). Default: all six in
# that order. Exit status: 0 when every tool's run exited 0 (no sanitizer error, no case
# failed), else 1.
#
# Environment: LOG_DIR (default build/sanitize), PYTHON (python3), COMPUTE_SANITIZER (default:
# on PATH, else beside nvcc, as CUDA 13 installs it; docs/RELIABILITY.md says which version the
# results are from and how to bring a newer one), TRITON_CACHE_DIR (default
# build/sanitize/triton-cache: build/ stays on the GPU machine between calls).
set -uo pipefail
cd "$(dirname "$0")/.."

tools=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tools+=("$1"); shift; done
[ "${1-}" = "--" ] && shift
[ ${#tools[@]} -gt 0 ] || tools=(plain memcheck racecheck synccheck initcheck poison)
for t in "${tools[@]}"; do
  case $t in
    plain | memcheck | racecheck | synccheck | initcheck | poison) ;;
    *) echo "sanitize.sh: unknown tool $t (plain, memcheck, racecheck, synccheck, initcheck, poison)" >&2; exit 2 ;;
  esac
done

LOG_DIR=${LOG_DIR:-build/sanitize}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/sanitize/triton-cache}
export PYTHONUNBUFFERED=1     # the script's "-- case" lines interleave with the sanitizer's reports
mkdir -p "$LOG_DIR" "$TRITON_CACHE_DIR"

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER-}" ]; then echo "$COMPUTE_SANITIZER"; return; fi
  command -v compute-sanitizer && return
  local nvcc
  nvcc=$(command -v nvcc) || { echo "sanitize.sh: no compute-sanitizer on PATH and no nvcc beside it" >&2; return 1; }
  echo "$(dirname "$(readlink -f "$nvcc")")/compute-sanitizer"
}

# plain and poison run the script alone; the others under compute-sanitizer.
under_sanitizer() { [ "$1" != plain ] && [ "$1" != poison ]; }

# One tool's run; prints its summary line. Every tool runs under --error-exitcode 1, follows
# only python itself (not ptxas or the compilers Triton and FlashInfer start), and waits up to
# 300 s for the process to reach CUDA (importing torch and mla takes a while).
run_tool() {
  local tool=$1; shift
  local log="$LOG_DIR/$tool.log" envs=() flags=() args=("$@")
  case $tool in
    plain) ;;
    poison) args+=(--poison) ;;   # no sanitizer: every uninitialized allocation NaN (the script's --poison)
    memcheck)
      # The caching allocator hands tensors out of large cudaMalloc'd segments, and memcheck
      # knows only cudaMalloc's bounds: a read past a tensor into its neighbour in the same
      # segment would pass unseen. Without caching every tensor is its own allocation, and
      # --padding puts a guard after each: an access up to 1 KiB past a tensor is reported.
      envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); flags=(--padding 1024) ;;
    racecheck) flags=(--print-limit 0) ;;   # shared memory: the allocator does not matter; every
                                            # hazard's site (one line a pair of sites), not the first 100
    synccheck) ;;   # barriers: the allocator does not matter
    initcheck)
      # Without caching a tensor's bytes count as written only once its own writer wrote
      # them, not because an earlier tensor held the same memory. Unused-memory tracking stays
      # off (compute-sanitizer 2025.3 takes --track-unused-memory as a flag that turns it on):
      # the question is reads of unwritten bytes; allocations larger than what is used of them
      # (workspaces, padded buffers) are by design. --no-peers: cuDNN's, cuBLAS's and
      # FlashInfer's kernels manage their own workspaces, which is theirs to answer for;
      # every kernel of this library still runs under initcheck.
      envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); args+=(--no-peers) ;;
  esac
  local start=$SECONDS cmd=("$PYTHON" tools/sanitize_gpu.py ${args[@]+"${args[@]}"})
  if under_sanitizer "$tool"; then
    cmd=("$SANITIZER" --tool "$tool" --error-exitcode 1 --target-processes application-only --launch-timeout 300
         ${TENSOR_OPS[@]+"${TENSOR_OPS[@]}"} ${flags[@]+"${flags[@]}"} "${cmd[@]}")
  fi
  echo "\$ ${envs[*]+${envs[*]} }${cmd[*]}" > "$log"
  env ${envs[@]+"${envs[@]}"} "${cmd[@]}" >> "$log" 2>&1
  local rc=$?
  local found cases
  found=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1 | sed -E 's/^=+ *//')
  cases=$(grep -E '^sanitize_gpu(\.py)?: ' "$log" | tail -n 1)     # its summary, or why it stopped
  grep -E '^(FAIL|skip) ' "$log" | sed "s/^/  $tool: /"
  under_sanitizer "$tool" || found="no sanitizer"
  printf '%-9s %s | %s | exit %s | %ss | %s\n' "$tool:" "${found:-no sanitizer summary (see the log)}" \
    "${cases:-the script did not finish (see the log)}" "$rc" "$((SECONDS - start))" "$log"
  return $((rc != 0))
}

SANITIZER=plain
for t in "${tools[@]}"; do
  if under_sanitizer "$t" && [ "$SANITIZER" = plain ]; then SANITIZER=$(find_sanitizer) || exit 2; fi
done
# TMA copies (cp.async.bulk.tensor) are tracked from compute-sanitizer 2026.4 on, when asked
# (--check-tensor-ops, every tool): the Gluon kernels' tensor loads into shared memory and their
# stores to global memory. Older versions have no such option and see neither.
TENSOR_OPS=()
if [ "$SANITIZER" != plain ]; then
  echo "compute-sanitizer: $SANITIZER ($("$SANITIZER" --version | grep -m1 -i version))"
  if "$SANITIZER" --help | grep -q -- '--check-tensor-ops'; then TENSOR_OPS=(--check-tensor-ops yes); fi
fi
status=0
for t in "${tools[@]}"; do
  run_tool "$t" "$@" || status=1
done
exit $status
