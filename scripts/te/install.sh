# Sourced on a GPU machine after scripts/device/env.sh: installs the Transformer Engine wheel built by
# scripts/te/build.sh (carried in .te/wheel) with its run-time wheels (.te/whl) into /tmp/site, which
# env.sh put on PYTHONPATH, and checks that transformer_engine.pytorch imports. The wheel fits only
# the torch it was built against (te-wheel.name records it): another torch is refused here.
_te_whl=$(ls .te/wheel/*.whl 2>/dev/null | head -n1)
if [[ -z $_te_whl ]]; then
    echo "te install: no .te/wheel/*.whl (build it: docs/transformer_engine.md; carry .te/whl and .te/wheel)"
    return 1 2>/dev/null || exit 1
fi
_te_torch=$(sed -n 's/.*torch=\([^ ]*\).*/\1/p' .te/wheel/te-wheel.name 2>/dev/null)
_torch=$(python3 -c 'import torch; print(torch.__version__)')
if [[ -n $_te_torch && $_te_torch != "$_torch" ]]; then
    echo "te install: $(basename "$_te_whl") was built against torch $_te_torch, this machine has $_torch: rebuild it"
    return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .te/whl/*.whl "$_te_whl" || { echo "te install: pip failed"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:${PYTHONPATH#/tmp/site:}}
python3 -c "import transformer_engine.pytorch as te, transformer_engine as t; print('transformer_engine', t.__version__)" \
    || { echo "te install: transformer_engine.pytorch does not import"; return 1 2>/dev/null || exit 1; }
unset _te_whl _te_torch _torch
