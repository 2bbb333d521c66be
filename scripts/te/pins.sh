# Transformer Engine build recipe: what is built, pinned (sourced by fetch.sh and build.sh).
# TE's release tag and the commit it must name; the CUTLASS commit that tag's 3rdparty/cutlass
# submodule pins (only its headers are used: include/ and tools/util/include/).
TE_TAG=v2.18
TE_COMMIT=27486e03cfc1fa41f6932dcecdc47c71c47eac3e
TE_VERSION=2.18.0
CUTLASS_COMMIT=57e3cfb47a2d9e0d46eb6335c3dc411498efa198
# Python packages the GPU machines' image lacks, for Python 3.12 (x86-64), with the versions that
# were downloaded when the recipe was written. build/: needed to compile (cudnn_frontend.h);
# run/: needed to import transformer_engine.pytorch.
TE_BUILD_WHEELS=("nvidia-cudnn-frontend==1.32.0")
TE_RUN_WHEELS=("pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
               "typing-extensions==4.16.0" "nvdlfw-inspect==0.2.2")
