# scripts/cuda-env.sh -- `source` me before `cargo build --release --features cuda`.
# Provides a CUDA 13.0 toolchain from PyPI (no system CUDA, no GPU/driver needed):
#   nvcc/cicc/ptxas + headers + libcudart/libcublas(Lt)/libcurand/libnvrtc, all under
#   <venv>/lib/python3.X/site-packages/nvidia/cu13/{bin,nvvm/bin,include,lib},
# plus unversioned lib*.so symlinks (wheels ship only lib*.so.N) and a generated
# link-time stub libcuda.so (the driver library is not on PyPI).
# CUDA 13.0 is chosen on purpose: the H200 device machines run driver 580 (CUDA 13.0);
# PTX from a newer nvcc (13.1+) would be rejected there (CUDA_ERROR_UNSUPPORTED_PTX_VERSION),
# and cudarc 0.19.10 knows CUDA <= 13.4 only. PyPI's *-cu12 nvcc wheels ship ptxas only, no nvcc.
# Overridable: CUDA_VENV, CUDA_TOOLKIT_VERSION, CUDA_COMPUTE_CAP (default 90 -> sm_90a).

_cuda_env_main() {
  local venv="${CUDA_VENV:-$HOME/.cache/ravnest-cuda}"
  local ver="${CUDA_TOOLKIT_VERSION:-13.0.2}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || return 1
  fi
  local site root
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
  root="$site/nvidia/cu13"
  if [ ! -x "$root/bin/nvcc" ] || [ ! -e "$root/lib/libcublasLt.so.13" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      "cuda-toolkit[nvcc,nvvm,crt,cudart,cublas,curand,nvrtc,cccl]==$ver" || return 1
  fi

  # -l<name> needs an unversioned lib<name>.so; the wheels ship only the SONAME files.
  local n f
  for n in cudart cublas cublasLt curand nvrtc; do
    f="$(cd "$root/lib" && ls lib$n.so.* 2>/dev/null | grep -E "^lib$n\.so\.[0-9]+$" | head -1)"
    [ -n "$f" ] && ln -sfn "$f" "$root/lib/lib$n.so"
  done

  # Link-time stub for the driver (cudarc `dynamic-linking` + `driver` emits -lcuda).
  # Every cu* entry point of cuda.h (macro-expanded _v2/_v3 names and raw names) and of
  # cudarc's bindings (if fetched) returns CUDA_ERROR_STUB_LIBRARY (34).
  local stub="$root/lib/stubs" rtstub="$venv/cuda-stub-runtime"
  if [ ! -e "$stub/libcuda.so" ]; then
    mkdir -p "$stub" "$rtstub" || return 1
    {
      echo '#include <cuda.h>' | gcc -E -P -x c -I"$root/include" - \
        | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | sed -E 's/[[:space:]]*\($//'
      grep -hoE 'CUDAAPI[[:space:]]+cu[A-Za-z0-9_]+' "$root/include/cuda.h" | awk '{print $2}'
      cat "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null \
        | grep -oE '^[[:space:]]+fn cu[A-Za-z0-9_]+\(' | sed -E 's/^[[:space:]]+fn //; s/\($//'
    } | sort -u | awk '{print "int " $1 "(void) { return 34; }"}' > "$stub/libcuda_stub.c"
    gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/libcuda_stub.c" || return 1
    cp "$stub/libcuda.so" "$rtstub/libcuda.so.1"
  fi

  export CUDA_ROOT="$root" CUDA_HOME="$root" CUDA_PATH="$root"   # cudarc link search, cudaforge
  export PATH="$root/bin:$PATH"                                  # nvcc (cudarc runs `nvcc --version`)
  export LIBRARY_PATH="$root/lib:$stub${LIBRARY_PATH:+:$LIBRARY_PATH}"  # -lcudart from candle-kernels
  export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"              # else cudaforge runs nvidia-smi and fails
  export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"      # parallel nvcc jobs (default is 50% of cores)
  # Machine without a driver: let cuda-enabled binaries start (CUDA calls then fail with error 34).
  if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && [ ! -e /usr/local/nvidia/lib64/libcuda.so.1 ]; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$rtstub"
  fi
}
_cuda_env_main; _cuda_env_rc=$?
unset -f _cuda_env_main
[ "$_cuda_env_rc" -eq 0 ] || echo "cuda-env.sh: setup failed (rc=$_cuda_env_rc)" >&2
unset _cuda_env_rc
