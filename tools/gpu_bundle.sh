#!/usr/bin/env bash
# Builds what runs on a GPU machine that has no Bazel - the gpu-tagged tests, the examples
# and the GPU benchmarks - with --config=cuda --config=portable (the GPU machine's CPU may
# lack AVX-512), and packs them with every shared library they need that such a machine may
# lack into one archive:
#
#   tools/gpu_bundle.sh                  # -> .gpu_bundle/tessera_gpu.tar.xz (git-ignored)
#   # there, from the repository root:   tar -xJf .gpu_bundle/tessera_gpu.tar.xz -C /tmp/tg
#   #                                    source tools/gpu_env.sh /tmp/tg; gpu_run cuda_copy_test
#
# The archive holds bin/ (the binaries) and lib/ (the
# libraries ldd resolves here, except the C library, the CUDA driver and the NVIDIA
# libraries - cudart, cuBLAS(Lt), cuDNN, NCCL - which tools/gpu_env.sh finds on the GPU
# machine: they are hundreds of MB and must match its driver). Extra targets: arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

# GPU_BUNDLE_FLAGS overrides the build flags (e.g. "--config=cuda" alone, when the GPU
# machine's CPU is known to run this machine's -march=native code).
read -r -a flags <<< "${GPU_BUNDLE_FLAGS:---config=cuda --config=portable}"
mapfile -t tests < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
targets=("${tests[@]}" //models/gpt:gpt //models/mnist:mnist //tools/bench:gpu_bench "$@")
echo "gpu_bundle: building ${#targets[@]} targets"
bazel build "${flags[@]}" "${targets[@]}"
bin_root=$(bazel info "${flags[@]}" bazel-bin 2>/dev/null)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
sources=()
for t in "${targets[@]}"; do
  pkg=${t#//}; pkg=${pkg%%:*}; name=${t##*:}
  src="$bin_root/$pkg/$name"
  [[ -f $src ]] || { echo "gpu_bundle: $t has no binary at $src" >&2; exit 1; }
  cp -L "$src" "$stage/bin/$name"
  sources+=("$src")
done

# Libraries: everything ldd resolves, except what every Linux or the GPU machine's own CUDA
# install provides.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libcuda\.so|libcudart|libcublas|libcudnn|libnccl|libnvidia|libnvrtc|libnvJitLink)'
# ldd runs on the binaries where Bazel left them: tests link the project's libraries
# dynamically through rpaths relative to their own location.
for f in "${sources[@]}"; do
  ldd "$f" | awk '/=> \//{print $1" "$3}'
done | sort -u | while read -r soname path; do
  if [[ $soname =~ $skip ]]; then continue; fi
  cp -Ln "$path" "$stage/lib/$soname"
done
# OpenMPI loads its components at run time; they are not on ldd's list (only needed by the
# MPI examples, which the GPU machine cannot launch without mpirun anyway).

mkdir -p .gpu_bundle
out=.gpu_bundle/tessera_gpu.tar.xz
tar -C "$stage" -cf - bin lib | xz -T2 -6 > "$out.tmp"
mv "$out.tmp" "$out"
echo "gpu_bundle: $(ls "$stage/bin" | wc -l) binaries, $(ls "$stage/lib" | wc -l) libraries," \
     "$(du -h "$out" | cut -f1) in $out"
