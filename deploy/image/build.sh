#!/usr/bin/env bash
# Build the paramserver image with podman, offline: base image (debootstrap, reused when present), wheels,
# `podman build --pull=never --network none`. Prints the image size. Settings: see deploy/image/common.sh.
set -euo pipefail
# shellcheck source=deploy/image/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ps_isolate "$@"

ps_podman_env
ps_base_image
ps_context
ps_build_image
log "built $IMAGE: $(human_size "$(ps_image_size)")"
