#!/usr/bin/env bash
# `pip install ./python` with no index (offline), libmoe.so bundled through
# MOE_LIBMOE, into a scratch target; then the installed package loads the
# bundled library (MOE_LIBRARY unset) and reports its ABI version.
set -euo pipefail
py=$1 src=$2 lib=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$src" "$scratch/src"   # pip may write build files next to the sources
MOE_LIBMOE=$lib "$py" -m pip install --no-index --no-deps --disable-pip-version-check -q \
  --target "$scratch/site" "$scratch/src"
test -f "$scratch/site/moe_expert_service/libmoe.so"
cd "$scratch"
env -u MOE_LIBRARY -u PYTHONPATH PYTHONPATH="$scratch/site" "$py" -c '
import moe_expert_service as m, moe_expert_service._lib as l
lib = l.lib()
assert lib._name.startswith("'"$scratch"'/site/"), lib._name
assert lib.moe_abi_version() == l.ABI_VERSION
try:
    m.Session(model="synthetic:tiny", bogus=1)
except m.InvalidArgumentError as e:
    assert "bogus" in str(e), e
else:
    raise SystemExit("no error for an unknown option")
print("installed offline:", lib._name)'
