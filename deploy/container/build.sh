#!/usr/bin/env bash
# Builds the edgestream worker image with buildah (no container daemon, no registry needed)
# and runs `edgestream --help` inside it.
#
#   deploy/container/build.sh [--archive FILE] [--rebuild-base]
#
# Steps, each cached under $EDGESTREAM_CACHE/container (default ~/.cache/edgestream/container):
#   1. buildah + debootstrap, installed with apt-get when missing (root only);
#   2. the base image localhost/edgestream-base:<suite>: a minimal Debian rootfs made with
#      `debootstrap --variant=minbase` (python3, python3-venv, ca-certificates), kept as a
#      tarball so a wiped container store re-imports it without downloading again;
#   3. a wheelhouse: `pip download` of the pinned runtime dependencies, made once per
#      version of requirements/runtime.txt + pyproject.toml, inside a throwaway container of
#      the base (same Python, same platform tags) - torch's CUDA wheels are several GB;
#   4. `buildah bud` of deploy/container/Containerfile with the wheelhouse bind-mounted at
#      /wheels: the image build itself is offline;
#   5. `buildah run` of the image's entry point with --help, its user, and the image size.
#
# --archive FILE also writes the image as an OCI archive (load it elsewhere with
# `podman load -i FILE` or `skopeo copy oci-archive:FILE docker-daemon:edgestream:TAG`).
#
# Environment: EDGESTREAM_CACHE, EDGESTREAM_IMAGE (default localhost/edgestream:<version>),
# DEBIAN_MIRROR (default: the host's apt mirror), EDGESTREAM_BASE_SUITE (bookworm);
# buildah's own STORAGE_DRIVER (e.g. vfs), BUILDAH_ISOLATION (oci|chroot) and BUILDAH_RUNTIME
# are honoured; when unset, the first of default runtime / runc / chroot isolation that can
# run a command here is used. PIP_INDEX_URL / PIP_EXTRA_INDEX_URL are passed to the
# wheelhouse download (e.g. a CPU-only torch index, where one is reachable).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
archive=""
rebuild_base=0
while [ $# -gt 0 ]; do
  case "$1" in
    --archive) archive="$(realpath -m "${2:?--archive needs a file name}")"; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1m[build.sh]\033[0m %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

suite="${EDGESTREAM_BASE_SUITE:-bookworm}"
# The host's own Debian mirror (the first URIs of its apt sources) unless DEBIAN_MIRROR says.
host_mirror() {
  { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources || true
    grep -hs '^deb ' /etc/apt/sources.list || true; } | awk '{print $2}' | { grep -v -- '-security' || true; } | head -n1
}
mirror="${DEBIAN_MIRROR:-$(host_mirror)}"
[ -n "$mirror" ] || { echo "build.sh: no Debian mirror in the host's apt sources: set DEBIAN_MIRROR" >&2; exit 1; }
base_packages="python3,python3-venv,ca-certificates"
cache="${EDGESTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgestream}/container"
version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n1)"
image="${EDGESTREAM_IMAGE:-localhost/edgestream:${version:-dev}}"
base_image="localhost/edgestream-base:$suite"
mkdir -p "$cache"
exec 8>"$cache/build.lock"
flock 8 || die "another build.sh holds $cache/build.lock"

# --- 1. tools ---------------------------------------------------------------------------
need=()
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${need[*]}: install them (apt-get install ${need[*]}) or run as root"
  command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get to install them"
  say "installing ${need[*]} with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi
[ "$(id -u)" = 0 ] || die "run as root: debootstrap and buildah mounts need it here (rootless buildah needs subuid/subgid set up and 'buildah unshare')"

# --- 2. base image ----------------------------------------------------------------------
base_key=$(printf '%s\n' "$suite" "$mirror" "$base_packages" minbase v1 | sha256sum | cut -c1-12)
base_tar="$cache/base-$suite-$base_key.tar"
if [ "$rebuild_base" = 1 ]; then
  rm -f "$base_tar"
  buildah rmi -f "$base_image" >/dev/null 2>&1 || true
fi
if [ ! -f "$base_tar" ]; then
  rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap $suite (minbase + $base_packages) from $mirror"
  debootstrap --variant=minbase --include="$base_packages" "$suite" "$rootfs" "$mirror" \
    > "$cache/debootstrap.log" 2>&1 || { tail -n 20 "$cache/debootstrap.log" >&2; die "debootstrap failed (log: $cache/debootstrap.log)"; }
  # Security updates too, for anyone who apt-gets in an image built FROM this base.
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s-security %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$mirror" "$suite" > "$rootfs/etc/apt/sources.list"
  # What a slim base leaves out: package caches and lists, docs, man pages, translations,
  # the host's resolver and name.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
         "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* "$rootfs"/tmp/* \
         "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  : > "$rootfs/etc/resolv.conf"
  echo edgestream > "$rootfs/etc/hostname"
  tar --numeric-owner --xattrs -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
    -cf "$base_tar.part" .
  mv "$base_tar.part" "$base_tar"
  rm -rf "$rootfs"; trap - EXIT
  buildah rmi -f "$base_image" >/dev/null 2>&1 || true
fi
if ! buildah inspect --type image "$base_image" >/dev/null 2>&1; then
  say "importing $base_tar as $base_image"
  ctr=$(buildah from scratch)
  buildah add --quiet "$ctr" "$base_tar" / >/dev/null   # a local tar archive is unpacked, owners kept
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/sh \
    --label "org.opencontainers.image.title=edgestream-base" \
    --label "org.opencontainers.image.description=debootstrap --variant=minbase $suite + $base_packages" \
    "$ctr"
  buildah commit --quiet --rm "$ctr" "$base_image" >/dev/null
fi

# How commands run here: a container runtime where it works, chroot isolation where it does
# not (nested sandboxes: no cgroup v2, hybrid cgroups, no namespaces).
probe() { buildah run "$@" "$probe_ctr" -- /bin/true >/dev/null 2>&1; }
if [ -z "${BUILDAH_ISOLATION:-}${BUILDAH_RUNTIME:-}" ]; then
  probe_ctr=$(buildah from --pull-never "$base_image")
  if probe; then :
  elif command -v runc >/dev/null && probe --runtime "$(command -v runc)"; then
    export BUILDAH_RUNTIME="$(command -v runc)"
  elif probe --isolation chroot; then
    export BUILDAH_ISOLATION=chroot
  else
    buildah rm "$probe_ctr" >/dev/null
    die "buildah cannot run a command in a container here, with the default runtime, runc or chroot isolation"
  fi
  buildah rm "$probe_ctr" >/dev/null
fi
say "buildah $(buildah --version | awk '{print $3}'): storage ${STORAGE_DRIVER:-$(buildah info --format '{{.store.GraphDriverName}}' 2>/dev/null || echo default)}, isolation ${BUILDAH_ISOLATION:-oci}${BUILDAH_RUNTIME:+, runtime $BUILDAH_RUNTIME}"

# --- 3. wheelhouse ----------------------------------------------------------------------
wheel_key=$( { cat "$repo/requirements/runtime.txt" "$repo/pyproject.toml"; echo "$base_key ${PIP_INDEX_URL:-} ${PIP_EXTRA_INDEX_URL:-}"; } | sha256sum | cut -c1-12)
wheels="$cache/wheels-$wheel_key"
if [ ! -f "$wheels/.complete" ]; then
  say "downloading the pinned runtime wheels into $wheels (torch: several GB, once)"
  mkdir -p "$wheels"
  run_args=(-v "$repo/pyproject.toml:/src/pyproject.toml:ro" -v "$repo/requirements:/src/requirements:ro" -v "$wheels:/wheels")
  # The host's CA bundle: trusts whatever TLS proxy the host trusts (pip's own bundle would not).
  for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    if [ -f "$ca" ]; then run_args+=(-v "$ca:/run/host-ca.crt:ro" --env PIP_CERT=/run/host-ca.crt); break; fi
  done
  for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL http_proxy https_proxy HTTP_PROXY HTTPS_PROXY no_proxy NO_PROXY; do
    [ -n "${!var:-}" ] && run_args+=(--env "$var=${!var}")
  done
  ctr=$(buildah from --pull-never "$base_image")
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  # The requirement set is pyproject.toml's [project.dependencies] (not the test tools in
  # runtime.txt), pinned by runtime.txt as constraints - as the Containerfile installs it -
  # plus setuptools for building the project's own wheel offline.
  buildah run --network host "${run_args[@]}" "$ctr" -- /bin/sh -ec '
    python3 -m venv /tmp/dl
    python3 -c "import tomllib; print(\"\n\".join(tomllib.load(open(\"/src/pyproject.toml\", \"rb\"))[\"project\"][\"dependencies\"]))" > /tmp/requirements.txt
    grep -q "^setuptools" /tmp/requirements.txt || python3 -c "import tomllib; print(\"\n\".join(tomllib.load(open(\"/src/pyproject.toml\", \"rb\"))[\"build-system\"][\"requires\"]))" >> /tmp/requirements.txt
    /tmp/dl/bin/pip download --disable-pip-version-check --no-cache-dir --progress-bar off \
      --dest /wheels --constraint /src/requirements/runtime.txt -r /tmp/requirements.txt wheel
  ' > "$cache/pip-download.log" 2>&1 || { tail -n 20 "$cache/pip-download.log" >&2; die "pip download failed (log: $cache/pip-download.log)"; }
  buildah rm "$ctr" >/dev/null; trap - EXIT
  if ls "$wheels"/*.tar.gz "$wheels"/*.zip >/dev/null 2>&1; then
    say "note: some dependencies are source distributions (built in the image's build stage): $(cd "$wheels" && ls ./*.tar.gz ./*.zip 2>/dev/null | tr '\n' ' ')"
  fi
  touch "$wheels/.complete"
fi
say "wheelhouse: $(find "$wheels" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels, $(du -sh "$wheels" | cut -f1)"

# --- 4. image ---------------------------------------------------------------------------
revision="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git -C "$repo" status --porcelain 2>/dev/null | head -n1)" ]; then revision="$revision-dirty"; fi
say "building $image from $base_image (revision $revision)"
previous=$(buildah images --noheading --format '{{.ID}}' "$image" 2>/dev/null | head -n1 || true)
start=$(date +%s)
buildah bud --layers --pull-never \
  -f "$here/Containerfile" \
  --build-arg "BASE=$base_image" \
  --build-arg "VERSION=${version:-dev}" \
  --build-arg "REVISION=$revision" \
  -v "$wheels:/wheels:ro" \
  -t "$image" \
  "$repo" >&2
say "image built in $(( $(date +%s) - start )) s"
# The image this build replaced (untagged now) holds its own copy of the virtualenv: drop
# it. The build stage's cached layers (--layers) stay, so the next build reuses them.
current=$(buildah images --noheading --format '{{.ID}}' "$image" | head -n1)
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  buildah rmi "$previous" >/dev/null 2>&1 || true
fi

# --- 5. check ---------------------------------------------------------------------------
ctr=$(buildah from --pull-never "$image")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
# The image's own ENTRYPOINT + CMD (`edgestream --help`), as its own user: what a container
# engine runs by default.
read -r -a argv <<<"$(buildah inspect --type container --format '{{range .OCIv1.Config.Entrypoint}}{{.}} {{end}}{{range .OCIv1.Config.Cmd}}{{.}} {{end}}' "$ctr")"
user=$(buildah inspect --type container --format '{{.OCIv1.Config.User}}' "$ctr")
say "running the image's entrypoint and command as user $user: ${argv[*]}"
buildah run --user "$user" "$ctr" -- "${argv[@]}"
buildah run --user "$user" "$ctr" -- /opt/edgestream/bin/python -c \
  'import os, torch, pipeline.worker; print(f"uid {os.getuid()}, torch {torch.__version__}, cuda build {torch.version.cuda}, threads {torch.get_num_threads()}")'
buildah rm "$ctr" >/dev/null; trap - EXIT
size=$(buildah images --format '{{.Size}}' "$image" | head -n1)
say "$image: $size (uncompressed)"
if [ -n "$archive" ]; then
  mkdir -p "$(dirname "$archive")"
  rm -f "$archive"
  buildah push --quiet "$image" "oci-archive:$archive:$image" >&2
  say "wrote $archive ($(du -h "$archive" | cut -f1))"
fi
