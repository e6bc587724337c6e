#!/usr/bin/env bash
# Run lun-diffusion in a container with every GPU of the host, with docker or podman.
#
#   docker/start.sh [cuda|rocm] [--build] [COMMAND...]
#
#   docker/start.sh cuda --build                  # build the CUDA image, then open a shell
#   docker/start.sh rocm python main.py --base configs/stable-diffusion/v1-finetune.yaml \
#       configs/lightning/ddp.yaml -t             # train on AMD GPUs
#
# cuda (the default) or rocm picks docker/Dockerfile or docker/Dockerfile.rocm and the image
# lun-diffusion:<cuda|rocm>; --build builds it first. COMMAND (default: bash) runs in the
# repository folder inside the container, where the repository is mounted, so edits need no
# rebuild. Also mounted: the data folder (read-only) and the logs folder, at data/ and logs/
# of the repository. The container shares the host's IPC namespace (--ipc=host: DataLoader
# workers and NCCL/RCCL need more shared memory than the default 64 MB).
#
# Environment:
#   CONTAINER_ENGINE  docker or podman (default: docker if installed, else podman)
#   LUN_IMAGE         image name (default: lun-diffusion:<cuda|rocm>)
#   LUN_DATA          host data folder, mounted read-only (default: <repo>/data)
#   LUN_LOGS          host logs folder (default: <repo>/logs)
#   LUN_RUN_ARGS      extra arguments for `<engine> run`, split on spaces (e.g. "--shm-size 16g")
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target=cuda
case "${1:-}" in
    cuda | rocm)
        target=$1
        shift
        ;;
    -h | --help) usage ;;
esac
build=false
if [[ "${1:-}" == "--build" ]]; then
    build=true
    shift
fi
if [[ "${1:-}" == -* ]]; then
    echo "start.sh: unknown option '$1' (expected [cuda|rocm] [--build] [COMMAND...])" >&2
    exit 2
fi

engine=${CONTAINER_ENGINE:-}
if [[ -z "$engine" ]]; then
    if command -v docker >/dev/null 2>&1; then
        engine=docker
    elif command -v podman >/dev/null 2>&1; then
        engine=podman
    else
        echo "start.sh: neither docker nor podman is installed (or set CONTAINER_ENGINE)" >&2
        exit 1
    fi
fi
engine_name=$(basename "$engine")

image=${LUN_IMAGE:-lun-diffusion:$target}
dockerfile="$repo/docker/Dockerfile"
[[ "$target" == rocm ]] && dockerfile="$repo/docker/Dockerfile.rocm"
data=${LUN_DATA:-$repo/data}
logs=${LUN_LOGS:-$repo/logs}
mkdir -p "$logs"
[[ -d "$data" ]] || mkdir -p "$data"

if $build; then
    "$engine" build -f "$dockerfile" -t "$image" "$repo"
fi

workdir=/workspace/lun-diffusion
args=(run --rm --ipc=host
    -v "$repo:$workdir" -v "$data:$workdir/data:ro" -v "$logs:$workdir/logs"
    -w "$workdir")
# A terminal gets an interactive session; scripts and CI get plain pipes.
if [[ -t 0 && -t 1 ]]; then
    args+=(-it)
else
    args+=(-i)
fi

# Every GPU: NVIDIA through docker's --gpus or CDI (podman); AMD through the kernel driver
# (/dev/kfd) and the render nodes (/dev/dri), whose groups the container user must be in.
if [[ "$target" == cuda ]]; then
    if [[ "$engine_name" == podman ]]; then
        args+=(--device nvidia.com/gpu=all --security-opt label=disable)
    else
        args+=(--gpus all)
    fi
else
    args+=(--device /dev/kfd --device /dev/dri --security-opt seccomp=unconfined)
    if [[ "$engine_name" == podman ]]; then
        args+=(--group-add keep-groups)  # rootless: keep the user's video/render groups
    else
        for group in video render; do
            gid=$(getent group "$group" | cut -d: -f3 || true)
            if [[ -n "$gid" ]]; then
                args+=(--group-add "$gid")  # by number: the image may not know the name
            fi
        done
    fi
fi

# Files written to the mounts belong to the host user (rootless podman maps root to it).
if [[ "$engine_name" != podman ]]; then
    args+=(--user "$(id -u):$(id -g)" -e HOME=/tmp)
fi

if [[ -n "${LUN_RUN_ARGS:-}" ]]; then
    read -ra extra <<<"$LUN_RUN_ARGS"
    args+=("${extra[@]}")
fi

if [[ $# -eq 0 ]]; then
    set -- bash
fi
exec "$engine" "${args[@]}" "$image" "$@"
