"""Builds the C++ transport extensions (csrc/) during `pip install`.

The extensions deliberately link neither libtorch nor libcuda: they move raw bytes between POSIX
shared-memory rings and Python buffers, or queue CUDA driver calls on raw handles, so they are
independent of the torch ABI (see docs/transport.md#transports).
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "trainer.transport._shm_ring",
        ["csrc/shm_ring.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        libraries=["rt"],
    ),
    # The host side of a same-node GPU hop through the CUDA driver (dlopen'ed at first use, so it
    # builds and imports without CUDA): trainer/transport/gpu_signals.py.
    Pybind11Extension(
        "trainer.transport._cuda_hop",
        ["csrc/cuda_hop.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        libraries=["dl"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
