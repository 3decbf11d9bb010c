#!/usr/bin/env bash
# CI's check of deploy/ without a Docker daemon or a cluster (.ci/run runs it
# with --build):
#   1. hadolint on every Dockerfile (deploy/docker/), shellcheck on the scripts
#   2. every kustomize overlay rendered (kubectl kustomize) and validated
#      offline against the Kubernetes schemas, strictly (kubernetes-validate),
#      for the oldest and the newest Kubernetes we support (1.29, 1.37)
#   3. deploy/check_manifests.py: probes, drain timings, env names, metric
#      names, GPU resources, security settings agree with moed's sources
# --build also configures from exactly the files .dockerignore admits to the
# build context, runs the images' recipe (deploy/build.sh cpu) and starts the
# staged moed as the image would (uid 10001, the rendered CPU Deployment's
# environment): ready, serving, taking an upload, draining on SIGTERM; with
# nvcc and hipcc present, the CUDA and HIP variants are configured (the
# kernels themselves are compiled by `make test`).
# The tools (pinned in deploy/requirements-check.txt) live in .venv-deploy,
# installed when missing or when that file changes. Idempotent; the lint part
# takes seconds once the tools are there.
set -euo pipefail
cd "$(dirname "$0")/.."

want_build=0
jobs="$(nproc)"
for a in "$@"; do
  case "$a" in
    --build) want_build=1 ;;
    --jobs=*) jobs="${a#--jobs=}" ;;
    *) echo "deploy/check.sh: unknown option $a (--build, --jobs=N)" >&2; exit 2 ;;
  esac
done

venv=.venv-deploy
req=deploy/requirements-check.txt
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$stamp"; then
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  cp "$req" "$stamp"
fi
bin="$venv/bin"

echo "== hadolint"
"$bin/hadolint" --failure-threshold info deploy/docker/*.Dockerfile
echo "ok: deploy/docker/*.Dockerfile"

echo "== shellcheck"
if command -v shellcheck >/dev/null; then
  shellcheck deploy/*.sh
  echo "ok: deploy/*.sh"
else
  echo "skipped: shellcheck not installed (scripts/deps.sh installs it)"
fi

echo "== kustomize + kubernetes-validate --strict"
out=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$out"
}
trap cleanup EXIT
n=0
for o in deploy/k8s/overlays/*/; do
  name=$(basename "$o")
  "$bin/kubectl" kustomize "$o" > "$out/$name.yaml"
  for v in 1.29.0 1.37.0; do
    # warnings are the CRDs without a schema (PodMonitor): check_manifests.py checks those
    "$bin/kubernetes-validate" --strict --quiet --no-warn -k "$v" "$out/$name.yaml"
  done
  n=$((n + 1))
done
echo "ok: $n overlays rendered and valid for Kubernetes 1.29 and 1.37"

echo "== check_manifests.py"
"$bin/python" deploy/check_manifests.py "$out"

[ "$want_build" = 1 ] || exit 0

echo "== the Docker build context (.dockerignore's allowlist) is enough to configure"
ctx="$out/context"
mkdir -p "$ctx"
sed -n 's/^!//p' .dockerignore | while read -r path; do
  git ls-files -z -- "$path" | xargs -0 -r cp --parents -t "$ctx"
done
(cd "$ctx" && bash deploy/build.sh cpu --configure-only --build-dir "$out/context-build" > "$out/context.log" 2>&1) ||
  { cat "$out/context.log"; echo "FAIL: the build context lacks files (.dockerignore)"; exit 1; }
echo "ok: $(find "$ctx" -type f | wc -l) files, $(du -sh "$ctx" | cut -f1)"

echo "== deploy/build.sh cpu (the images' recipe)"
bash deploy/build.sh cpu --jobs "$jobs"
stage=build-deploy-cpu/stage

echo "== the staged moed as the image runs it: the CPU Deployment's environment, uid 10001"
stage=$(cd "$stage" && pwd)
chmod 755 "$out"
run="$out/run" repo="$out/models"
mkdir -p "$run" "$repo"
LD_LIBRARY_PATH="$stage/lib" "$stage/bin/moe-mkset" --out "$repo/demo" --scheme bf16 --experts 8 \
  --hidden 256 --intermediate 128 --top-k 2 --seed 1 >/dev/null
LD_LIBRARY_PATH="$stage/lib" "$stage/bin/moe-mkset" --out "$out/upload" --scheme bf16 --experts 4 \
  --hidden 128 --intermediate 64 --top-k 2 --seed 2 >/dev/null
# the images' user (numeric, no passwd entry), where this shell may switch to it
as_user=()
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null &&
  setpriv --reuid 10001 --regid 10001 --clear-groups test -x "$stage/bin/moed"; then
  as_user=(setpriv --reuid 10001 --regid 10001 --clear-groups)
  chown -R 10001:10001 "$run" "$repo"
else
  echo "note: running as $(id -un), not uid 10001"
fi
env_args=()
while IFS= read -r kv; do env_args+=("$kv"); done < <("$bin/python" deploy/check_manifests.py --env "$out/cpu.yaml")
env_args+=("MOED_MODEL_REPOSITORY=$repo" "MOED_GRPC_PORT=0" "MOED_HTTP_PORT=0" "MOED_DRAIN_TIMEOUT=5" "HOME=/tmp")
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$stage/lib" "${env_args[@]}" \
  "${as_user[@]}" "$stage/bin/moed" --port-file "$run/ports" > "$out/moed.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -s "$run/ports" ] && break; sleep 0.1; done
if [ ! -s "$run/ports" ]; then
  cat "$out/moed.log"; kill "$pid" 2>/dev/null || true
  echo "FAIL: the staged moed did not start"; exit 1
fi
read -r gport _ < "$run/ports"
moec() { LD_LIBRARY_PATH="$stage/lib" "$stage/bin/moec" -a "127.0.0.1:$gport" --timeout-ms 10000 "$@"; }
moec health
moec models | grep -q '^demo '
# an ExpertStore upload lands in the repository volume (written as that user)
moec upload "$out/upload" --name uploaded >/dev/null
moec models | grep -q '^uploaded '
[ -f "$repo/uploaded/config.json" ]
if [ "${#as_user[@]}" -gt 0 ] && [ "$(stat -c %u "$repo/uploaded/config.json")" != 10001 ]; then
  echo "FAIL: the upload was not written as uid 10001"; exit 1
fi
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
pid=""
if [ "$rc" != 0 ]; then cat "$out/moed.log"; echo "FAIL: moed exited $rc after SIGTERM"; exit 1; fi
echo "ok: ready, serves the demo set, takes an upload into the repository, drains and exits 0 on SIGTERM"

for b in cuda hip; do
  tool=$([ "$b" = cuda ] && echo nvcc || echo hipcc)
  if command -v "$tool" >/dev/null || { [ "$b" = cuda ] && [ -x /usr/local/cuda/bin/nvcc ]; }; then
    echo "== deploy/build.sh $b --configure-only"
    bash deploy/build.sh "$b" --configure-only > "$out/configure-$b.log" 2>&1 || { cat "$out/configure-$b.log"; exit 1; }
    tail -1 "$out/configure-$b.log"
  else
    echo "== deploy/build.sh $b: skipped ($tool not installed)"
  fi
done
