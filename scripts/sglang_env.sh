#!/bin/bash
# On the GPU machine, from the repo root: run a Python script with SGLang 0.5.16 importable.
#   bash scripts/sglang_env.sh [WHEEL_DIR ...] -- SCRIPT ARGS...
# The wheels come from shared/sglang-kit/prepare_wheels.sh (copied into the ignored .sglang-kit/, its output in
# .sglang-whl/). They may arrive split over several calls on one warm machine: each call unpacks the folders it
# names into /tmp/sglsite; the script runs once the kit's stamp and sglang are both there.
set -e
dirs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done; shift
S=/tmp/sglsite; mkdir -p $S
python3 - "$S" "${dirs[@]}" <<'PY'
import glob, sys, tarfile, zipfile
site = sys.argv[1]
for d in sys.argv[2:]:
    for f in sorted(glob.glob(d + "/*.whl")):
        zipfile.ZipFile(f).extractall(site)
    for f in glob.glob(d + "/*.tar.gz"):
        tarfile.open(f).extractall(site)
PY
# the two patches of the kit: sglang pins tokenizers<=0.23.0 (the device has 0.23.2); flashinfer's JIT sources are
# left out of the wheels, so sgl_kernel uses its AOT-compiled norm kernels
[ -f $S/transformers/dependency_versions_table.py ] && \
  sed -i 's/tokenizers>=0.22.0,<=0.23.0/tokenizers>=0.22.0/' $S/transformers/dependency_versions_table.py
[ -f $S/sgl_kernel/elementwise.py ] && \
  sed -i 's/^    _has_flashinfer = True$/    _has_flashinfer = False  # kit patch/' $S/sgl_kernel/elementwise.py
[ $# -eq 0 ] && exit 0
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/jitcache} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tritoncache}
NV=$(python3 -c "
import glob, os, site
ds = {d for sp in site.getsitepackages() for pat in ('nvidia/*/lib', 'nvidia/*/*/lib', 'nvidia/cu13/lib')
      for d in glob.glob(os.path.join(sp, pat)) if glob.glob(d + '/lib*.so*')}
print(':'.join(sorted(ds)))")
PYTHONPATH=$S:$PWD/.sglang-kit/sgstub:$PWD LD_LIBRARY_PATH=$NV:$LD_LIBRARY_PATH exec python3 "$@"
