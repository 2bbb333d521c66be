"""Builds the C++ shared-memory transport extension (csrc/) during `pip install`.

The extension deliberately does not link libtorch: it moves raw bytes between POSIX shared-memory
rings and Python buffers, so it is independent of the torch ABI (see docs/transport.md#transports).
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
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
