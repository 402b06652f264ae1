# shellcheck shell=bash
# Shared by deploy/image/build.sh and deploy/image-test.sh (source it; bash).
#
# Everything podman/buildah keep lives under build/image/ (git-ignored): containers.conf, storage.conf and
# registries.conf are written there and passed through CONTAINERS_CONF / CONTAINERS_STORAGE_CONF /
# CONTAINERS_REGISTRIES_CONF, and the scripts run in a private mount namespace where writes to /var/lib land in
# build/image/state/var-lib (ps_isolate), so nothing in /etc or /var/lib/containers is used.
#
# Settings (environment):
#   IMAGE          the image to build      (default localhost/paramserver:latest)
#   BASE_IMAGE     the FROM image          (default localhost/paramserver-base:bookworm)
#   TORCH_VARIANT  cpu | cuda              (default cpu; cuda: see deploy/IMAGE.md, not built here)
#   DEBIAN_MIRROR  mirror for debootstrap  (default: the bookworm URI of /etc/apt/sources.list*)
#   PYTHON         host python 3.11 whose pip prepares the wheels (default python3)

PS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PS_BUILD=${PS_BUILD:-$PS_REPO/build/image}
PS_DOCKERFILE=$PS_REPO/deploy/Dockerfile
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/paramserver-base:bookworm}
if [[ $TORCH_VARIANT == cpu ]]; then
    IMAGE=${IMAGE:-localhost/paramserver:latest}
    PS_CONTEXT=$PS_BUILD/context
else
    IMAGE=${IMAGE:-localhost/paramserver:$TORCH_VARIANT}
    PS_CONTEXT=$PS_BUILD/context-$TORCH_VARIANT
fi
PYTHON=${PYTHON:-python3}
# podman with the quirks of this kind of machine: runc (crun refuses the cgroup layout), explicit rlimits.
PODMAN=(podman --runtime runc)

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

human_size() { # bytes -> "1.23 GB (1234567890 bytes)"
    awk -v b="$1" 'BEGIN { printf "%.2f GB / %.0f MiB (%d bytes)", b / 1e9, b / 1048576, b }'
}

# Re-run the calling script in a private mount namespace in which /var/lib is an overlay whose writes land in
# build/image/state/var-lib: as root, podman 4.3 writes its blob-info cache to /var/lib/containers/cache whatever
# is configured. The containers' conmon processes stay in this namespace, so the script that starts containers
# must also stop and remove them (image-test.sh does). PS_ISOLATE=0 skips this.
ps_isolate() {
    [[ -n ${PS_IMAGE_NS:-} || ${PS_ISOLATE:-1} == 0 ]] && return 0
    [[ $(id -u) == 0 ]] || return 0
    if ! unshare --mount true 2>/dev/null; then
        log "warning: no private mount namespace here (unshare --mount failed); podman may write /var/lib/containers/cache"
        return 0
    fi
    local d=$PS_BUILD/state/var-lib
    mkdir -p "$d/upper" "$d/work"
    exec unshare --mount --propagation private env PS_IMAGE_NS=1 bash -c '
        mount -t overlay overlay -o "lowerdir=/var/lib,upperdir=$1/upper,workdir=$1/work" /var/lib || exit 1
        shift; exec bash "$@"' ps-isolate "$d" "$0" "$@"
}

ps_podman_env() {
    mkdir -p "$PS_BUILD"/{storage,state/run,state/tmp,state/copytmp,state/networks}
    cat >"$PS_BUILD/containers.conf" <<EOF
# Written by deploy/image/common.sh: podman/buildah settings for the paramserver image (CONTAINERS_CONF).
[containers]
# root may not raise rlimits here, so give the containers explicit ones instead of podman's defaults
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
# crun refuses this machine's cgroup (v1) layout
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$PS_BUILD/state/events.log"
tmp_dir = "$PS_BUILD/state/tmp"
image_copy_tmp_dir = "$PS_BUILD/state/copytmp"

[network]
# CNI, not netavark: netavark keeps its state in /run/containers/networks whatever is configured
network_backend = "cni"
network_config_dir = "$PS_BUILD/state/networks"
EOF
    cat >"$PS_BUILD/storage.conf" <<EOF
# Written by deploy/image/common.sh: image and container storage under build/image/ (CONTAINERS_STORAGE_CONF).
[storage]
driver = "${PS_STORAGE_DRIVER:-overlay}"
graphroot = "$PS_BUILD/storage"
runroot = "$PS_BUILD/state/run"
EOF
    # only fully qualified names (localhost/...): no short-name search in registries
    printf 'unqualified-search-registries = []\n' >"$PS_BUILD/registries.conf"
    export CONTAINERS_REGISTRIES_CONF=$PS_BUILD/registries.conf
    export CONTAINERS_CONF=$PS_BUILD/containers.conf
    export CONTAINERS_STORAGE_CONF=$PS_BUILD/storage.conf
    export TMPDIR=$PS_BUILD/state/tmp
    command -v podman >/dev/null || die "podman is not installed (apt-get install -y podman buildah runc debootstrap)"
    command -v runc >/dev/null || die "runc is not installed (apt-get install -y runc)"
}

# The bookworm mirror that apt on this host uses (deb822 .sources or one-line .list), unless DEBIAN_MIRROR is set.
ps_debian_mirror() {
    if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
    "$PYTHON" - <<'EOF'
import glob, re
found = []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
    try:
        text = open(path).read()
    except OSError:
        continue
    if path.endswith(".sources"):
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
            if "deb" in fields.get("Types", "").split() and "bookworm" in fields.get("Suites", "").split():
                found += fields.get("URIs", "").split()
    elif path.endswith(".list"):
        for line in text.splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                found.append(parts[1])
print(found[0] if found else "http://deb.debian.org/debian")
EOF
}

# The base image: a minimal Debian bookworm (debootstrap --variant=minbase) with python3.11 and venv, trimmed of
# docs, man pages, locales and apt's caches, imported as $BASE_IMAGE. Reused when it exists.
ps_base_image() {
    if "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
        log "base image $BASE_IMAGE exists; reused"
        return
    fi
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
    [[ $(id -u) == 0 ]] || die "debootstrap needs root"
    local dir=$PS_BUILD/base rootfs=$PS_BUILD/base/rootfs mirror
    mkdir -p "$dir"
    if [[ ! -f $rootfs/.paramserver-base-done ]]; then
        mirror=$(ps_debian_mirror)
        log "debootstrap bookworm (minbase + python3, python3-venv, ca-certificates) from $mirror"
        rm -rf "$rootfs" "$dir/rootfs.tmp"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$dir/rootfs.tmp" "$mirror" >"$dir/debootstrap.log" 2>&1 \
            || { tail -20 "$dir/debootstrap.log" >&2; die "debootstrap failed (log: $dir/debootstrap.log)"; }
        local r=$dir/rootfs.tmp
        rm -rf "$r"/var/cache/apt/* "$r"/var/lib/apt/lists/* "$r"/var/log/* "$r"/usr/share/man/* \
            "$r"/usr/share/info/* "$r"/usr/share/locale/* "$r"/usr/share/doc-base
        # docs: keep only the copyright files
        find "$r/usr/share/doc" -mindepth 1 \( -type f -o -type l \) ! -name copyright -delete
        find "$r/usr/share/doc" -mindepth 1 -type d -empty -delete
        : >"$r/etc/machine-id"
        touch "$r/.paramserver-base-done"
        mv "$r" "$rootfs"
    fi
    log "importing $rootfs as $BASE_IMAGE"
    tar --numeric-owner --xattrs --exclude=./.paramserver-base-done -C "$rootfs" -cf "$dir/rootfs.tar" .
    "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
        --message "debian bookworm minbase + python3.11 (deploy/image/common.sh)" \
        "$dir/rootfs.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$dir/rootfs.tar"
}

# The build context: wheels/deps (every dependency of paramserver[data], torch==2.13.0 included),
# wheels/project (paramserver itself, built from a copy of the sources) and healthcheck.py.
ps_context() {
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
        || die "$PYTHON is not Python 3.11 (the image's python is bookworm's 3.11; the wheels must match)"
    local src=$PS_BUILD/src
    rm -rf "$src" "$PS_CONTEXT/wheels/project"
    mkdir -p "$src" "$PS_CONTEXT/wheels/deps" "$PS_CONTEXT/wheels/project"
    (cd "$PS_REPO" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml README.md paramserver worker protos) \
        | tar -xf - -C "$src"
    local pip=("$PYTHON" -m pip wheel --quiet --wheel-dir "$PS_CONTEXT/wheels/deps" --find-links "$PS_CONTEXT/wheels/deps")
    if [[ $TORCH_VARIANT != cpu ]]; then
        # CUDA torch from PyPI (torch 2.13.0 there is the CUDA 13 build; the CUDA libraries come as nvidia-*
        # wheels), not this host's local CPU wheel: --isolated ignores this host's pip.conf and PIP_FIND_LINKS.
        # TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu126) adds an index with other CUDA builds;
        # pip then prefers its 2.13.0+cuXXX over PyPI's 2.13.0.
        pip+=(--isolated --index-url https://pypi.org/simple)
        [[ -n ${TORCH_INDEX_URL:-} ]] && pip+=(--extra-index-url "$TORCH_INDEX_URL")
    fi
    log "wheels for paramserver[data] into ${PS_CONTEXT#"$PS_REPO"/}/wheels ($TORCH_VARIANT torch)"
    # SOURCE_DATE_EPOCH: the same sources give the same project wheel, so the image's layers stay cached.
    # (pip's complaints about the missing file:// extra indexes of this host's pip.conf are filtered out)
    SOURCE_DATE_EPOCH=315532800 "${pip[@]}" "$src[data]" 2> >(grep -v "^WARNING: Location 'file:" >&2) \
        || die "pip wheel failed"
    mv "$PS_CONTEXT"/wheels/deps/paramserver-*.whl "$PS_CONTEXT/wheels/project/"
    if [[ $TORCH_VARIANT == cpu ]] && ! ls "$PS_CONTEXT"/wheels/deps/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        die "no CPU torch 2.13.0 wheel in the context (pip took $(cd "$PS_CONTEXT/wheels/deps" && ls torch-*))"
    fi
    cp "$PS_REPO/deploy/image/healthcheck.py" "$PS_CONTEXT/healthcheck.py"
}

ps_build_image() {
    local old
    old=$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
    log "podman build $IMAGE (offline: --pull=never --network none)"
    "${PODMAN[@]}" build --pull=never --network none --format docker --layers \
        --build-arg BASE_IMAGE="$BASE_IMAGE" -f "$PS_DOCKERFILE" -t "$IMAGE" "$PS_CONTEXT" \
        || die "podman build failed"
    local new
    new=$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$IMAGE")
    # the previous build of $IMAGE, now untagged, is dropped (its cached parent layers stay)
    if [[ -n $old && $old != "$new" ]]; then "${PODMAN[@]}" rmi "$old" >/dev/null 2>&1 || true; fi
}

ps_image_size() {
    "${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE"
}
