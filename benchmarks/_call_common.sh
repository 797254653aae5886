# Sourced by the GPU call scripts (gpu_check.sh, issue32_call.sh). Marks this call's processes
# and kills only its own multiprocessing workers left by a cut step: a plain
# `pkill -f "from multiprocessing.spawn import"` also killed other jobs' workers on a shared box
# (the test suite runs these scripts' smokes beside other work).
export DELTAFLOW_CALL_TAG="${DELTAFLOW_CALL_TAG:-call_$$_$RANDOM}"

kill_own_spawned() {
  local pid
  for pid in $(pgrep -f "from multiprocessing.spawn import" 2> /dev/null); do
    if grep -qz "^DELTAFLOW_CALL_TAG=$DELTAFLOW_CALL_TAG\$" "/proc/$pid/environ" 2> /dev/null; then
      kill -9 "$pid" 2> /dev/null
    fi
  done
  return 0
}
