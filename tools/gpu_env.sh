# Sourced on the GPU machine (no Bazel there), from the repository root, after unpacking the
# archive tools/gpu_bundle.sh made:
#
#   source tools/gpu_env.sh /tmp/tg        # unpacked bundle dir
#   gpu_run cuda_copy_test                 # runs bin/cuda_copy_test from the repo root
#
# Finds the NVIDIA libraries the bundle leaves out (CUDA toolkit under /usr/local/cuda, and
# the cuDNN/NCCL/cuBLAS wheels that PyTorch's environment carries) and puts them, then the
# bundle's lib/, on LD_LIBRARY_PATH.
GPU_BUNDLE=${1:?usage: source tools/gpu_env.sh BUNDLE_DIR}
_dirs=""
for _lib in libcudart.so.13 libcublasLt.so.13 libcublas.so.13 libcudnn.so.9 libnccl.so.2; do
  _found=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets /usr/lib/x86_64-linux-gnu \
             /opt /usr/local/lib -name "$_lib" 2>/dev/null | head -1)
  if [[ -n $_found ]]; then
    _dirs="$_dirs:$(dirname "$_found")"
  else
    echo "gpu_env: $_lib not found" >&2
  fi
done
export LD_LIBRARY_PATH="$GPU_BUNDLE/lib${_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$GPU_BUNDLE/bin:$PATH"
gpu_run() { local b=$1; shift; "$GPU_BUNDLE/bin/$b" "$@"; }
