#!/usr/bin/env bash
# Build the paramserver image and prove it works (the future `make image-test`):
#
#   1. base image: debootstrap bookworm + python3.11, `podman import` (reused when it exists)
#   2. wheels: torch==2.13.0 (CPU) and every dependency of paramserver[data], plus the project's own wheel
#   3. `podman build --pull=never --network none` of deploy/Dockerfile (layers cached between runs)
#   4. two shard containers (sync mode, 2 workers, checkpoints into host folders); waits for the HEALTHCHECK
#   5. two worker containers train the CNN on the built-in digits data; their --metrics-out JSON must show a
#      held-out test accuracy >= MIN_ACCURACY (0.95)
#   6. `podman stop` (SIGTERM) the shards: each must exit 0 having written its final checkpoint
#
# Needs root, podman, buildah, runc and debootstrap (apt-get install -y podman buildah runc debootstrap), and
# network only for debootstrap (the Debian mirror) and the wheels (pip). Everything podman keeps lives under
# build/image/ (see deploy/image/common.sh); the containers use the host network on free 127.0.0.1 ports.
# Every container is removed on exit; logs and outputs stay in build/image/test-run/. Exits non-zero on failure.
#
# Settings (environment): EPOCHS (10), MIN_ACCURACY (0.95), READY_TIMEOUT (180 s), TRAIN_TIMEOUT (900 s),
# and those of deploy/image/common.sh (IMAGE, BASE_IMAGE, ...).
set -euo pipefail
# shellcheck source=deploy/image/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/image/common.sh"
ps_isolate "$@"

EPOCHS=${EPOCHS:-10}
MIN_ACCURACY=${MIN_ACCURACY:-0.95}
READY_TIMEOUT=${READY_TIMEOUT:-180}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-900}
RUN=ps-image-test-$$
WORK=$PS_BUILD/test-run
CREATED=()       # every container this run created, removed on exit
PHASES=()
T_ALL=$(date +%s.%N)
PHASE=""
RESULT=FAIL

phase() { # phase NAME: close the running phase (recording its time), start the next
    local now
    now=$(date +%s.%N)
    if [[ -n $PHASE ]]; then PHASES+=("$(awk -v a="$PHASE_T0" -v b="$now" -v n="$PHASE" 'BEGIN { printf "  %-52s %7.1f s", n, b - a }')"); fi
    PHASE=$1
    PHASE_T0=$now
    [[ -n $PHASE ]] && log "== $PHASE"
    return 0
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    phase ""
    for c in "${CREATED[@]}"; do
        "${PODMAN[@]}" logs "$c" >"$WORK/$c.log" 2>&1 || true
        if [[ $rc != 0 ]]; then
            log "--- last lines of $c (full log: ${WORK#"$PS_REPO"/}/$c.log)"
            tail -n 15 "$WORK/$c.log" >&2 || true
        fi
        "${PODMAN[@]}" rm --force --time 0 "$c" >/dev/null 2>&1 || true
    done
    echo
    echo "paramserver image test: $RESULT"
    echo "  image: $IMAGE  size: ${SIZE:-unknown}"
    echo "  phases:"
    printf '%s\n' "${PHASES[@]}"
    awk -v a="$T_ALL" -v b="$(date +%s.%N)" 'BEGIN { printf "  %-52s %7.1f s\n", "total", b - a }'
    [[ -n ${ACCURACY_LINES:-} ]] && printf '  workers:\n%s\n' "$ACCURACY_LINES"
    echo "  outputs and logs: ${WORK#"$PS_REPO"/}/"
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

state() { "${PODMAN[@]}" inspect --format "$2" "$1"; }

# Podman runs a HEALTHCHECK periodically through systemd timers. Without systemd (as on the machine this was
# written on) `podman run` and `podman stop` log an error about it for each container (--health-interval disable
# does not stop that in podman 4.3); the message is filtered out, and the test runs the check itself with
# `podman healthcheck run`.
podman_q() { "${PODMAN[@]}" "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }

run_container() { # run_container NAME ARGS...: start a detached container, remembered for the cleanup
    local name=$1
    shift
    CREATED+=("$name")
    podman_q run --detach --name "$name" --network host "$@" >/dev/null
}

# ---------------------------------------------------------------------------------------------- build
ps_podman_env
rm -rf "$WORK"
mkdir -p "$WORK"
phase "base image (debootstrap + podman import, or reused)"
ps_base_image
phase "wheels (pip wheel into the build context)"
ps_context
phase "podman build --pull=never --network none"
ps_build_image
SIZE=$(human_size "$(ps_image_size)")
log "image $IMAGE: $SIZE"

# ---------------------------------------------------------------------------------------------- shards
phase "2 shard containers up and healthy"
read -r P0 P1 < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
PEERS=127.0.0.1:$P0,127.0.0.1:$P1
PORTS=("$P0" "$P1")
for i in 0 1; do
    mkdir -p "$WORK/ckpt-$i"
    # :U gives the mounted folder to the image's non-root user
    run_container "$RUN-shard-$i" --volume "$WORK/ckpt-$i:/ckpt:U" "$IMAGE" \
        ps-server --shard-index "$i" --peers "$PEERS" --port "${PORTS[$i]}" --mode sync --workers 2 \
        --checkpoint-dir /ckpt --checkpoint-every 0
done
log "shards on $PEERS; waiting for their health checks"
for i in 0 1; do
    c=$RUN-shard-$i
    deadline=$((SECONDS + READY_TIMEOUT))
    until out=$("${PODMAN[@]}" healthcheck run "$c" 2>&1); do
        [[ $(state "$c" '{{.State.Running}}') == true ]] || die "shard $i exited (status $(state "$c" '{{.State.ExitCode}}')) before it was healthy"
        ((SECONDS < deadline)) || die "shard $i not healthy after ${READY_TIMEOUT}s: $out"
        sleep 2
    done
    health=$(state "$c" '{{.State.Health.Status}}' 2>/dev/null || state "$c" '{{.State.Healthcheck.Status}}')
    log "shard $i: podman healthcheck run -> ${out:-healthy}; inspect health status: $health"
    [[ $health == healthy ]] || die "shard $i: health status is '$health'"
done
[[ $(state "$RUN-shard-0" '{{.Config.User}}') != "" ]] || die "the image runs as root"
log "shards run as user $(state "$RUN-shard-0" '{{.Config.User}}') (uid in the container: $("${PODMAN[@]}" exec "$RUN-shard-0" id -u))"
[[ $("${PODMAN[@]}" exec "$RUN-shard-0" id -u) != 0 ]] || die "the shard runs as root"

# ---------------------------------------------------------------------------------------------- workers
phase "2 worker containers train on digits ($EPOCHS epochs)"
mkdir -p "$WORK/out"
for i in 0 1; do
    # a worker container has no shard to check (its health check would just report healthy)
    run_container "$RUN-worker-$i" --no-healthcheck --volume "$WORK/out:/out:U" "$IMAGE" \
        ps-worker --server "127.0.0.1:$P0" --model cnn --dataset digits --epochs "$EPOCHS" \
        --metrics-out /out/worker.json --no-progress  # each rank's: worker-0.json, worker-1.json
done
for i in 0 1; do
    c=$RUN-worker-$i
    status=$(timeout "$TRAIN_TIMEOUT" "${PODMAN[@]}" wait "$c") || die "worker $i did not finish in ${TRAIN_TIMEOUT}s"
    [[ $status == 0 ]] || die "worker $i exited with status $status"
done
ACCURACY_LINES=$("$PYTHON" - "$WORK/out" "$MIN_ACCURACY" <<'EOF'
import json, pathlib, sys
out, target = pathlib.Path(sys.argv[1]), float(sys.argv[2])
bad = False
for rank in (0, 1):
    m = json.loads((out / f"worker-{rank}.json").read_text())
    acc = m["test_accuracy"]
    bad |= not acc >= target
    print(f"    worker rank {m['rank']}: {m['steps']} steps in {m['seconds']:.1f} s, "
          f"final loss {m['final_loss']:.4f}, test accuracy {acc:.4f} ({m['mode']} mode)")
sys.exit(1 if bad else 0)
EOF
) || { echo "$ACCURACY_LINES" >&2; die "a worker's test accuracy is below $MIN_ACCURACY"; }
echo "$ACCURACY_LINES" >&2

# ---------------------------------------------------------------------------------------------- stop
phase "SIGTERM the shards (podman stop), final checkpoints"
for i in 0 1; do
    c=$RUN-shard-$i
    podman_q stop --time 20 "$c" >/dev/null
    code=$(state "$c" '{{.State.ExitCode}}')
    [[ $code == 0 ]] || die "shard $i exited with status $code after SIGTERM (want 0)"
    version=$("${PODMAN[@]}" logs "$c" 2>&1 | sed -n 's/.*shard [0-9]* stopped at version \([0-9]*\).*/\1/p' | tail -1)
    [[ -n $version ]] || die "shard $i did not log its stop"
    ckpt=$(printf '%s/ckpt-%d/shard-%03d-v%012d.ckpt' "$WORK" "$i" "$i" "$version")
    [[ -s $ckpt ]] || die "shard $i stopped at version $version but wrote no ${ckpt#"$WORK"/}: $(ls "$WORK/ckpt-$i")"
    log "shard $i: exit status 0, final checkpoint ${ckpt#"$WORK"/} ($(stat -c %s "$ckpt") bytes)"
done
[[ $version -gt 0 ]] || die "the shards never applied an update (version 0)"

RESULT=PASS
