#!/usr/bin/env bash
# Collects binaries built here (Debian 12) with the shared libraries they need, so that they run
# on a stock CUDA GPU host (Ubuntu 24.04 + CUDA 13, no gRPC/Abseil/prometheus-cpp/OpenBLAS):
# every library `ldd` lists except glibc, libstdc++/libgcc_s and the CUDA/NCCL libraries, which
# that host provides (docs/gpu-hosts.md).
#
#   scripts/bundle_gpu.sh OUT_DIR BINARY [BINARY ...]
#
# OUT_DIR/bin holds the binaries, OUT_DIR/lib the libraries, OUT_DIR/run.sh runs one of them with
# LD_LIBRARY_PATH set:  OUT_DIR/run.sh mobius bench engine --device cuda ...
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT_DIR BINARY [BINARY ...]" >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
# Provided by the GPU host (or by the C runtime every Linux has).
host_provided='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvJitLink)'
for binary in "$@"; do
  [ -x "$binary" ] || { echo "$0: $binary is not an executable" >&2; exit 1; }
  cp -f "$binary" "$out/bin/"
  ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if ! [[ $name =~ $host_provided ]]; then
      cp -fL "$path" "$out/lib/$name"
    fi
  done
done
cat >"$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs a bundled binary with its libraries: run.sh NAME [ARGS...]
here=$(cd "$(dirname "$0")" && pwd)
name=$1
shift
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/$name" "$@"
EOF
chmod +x "$out/run.sh"
echo "bundled $# binaries and $(ls "$out/lib" | wc -l) libraries ($(du -sh "$out" | cut -f1)) into $out"
