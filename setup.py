"""Install: the Python packages, plus the native kernel compiled for this machine.

The native kernel (moments_core/native/moments.h) is compiled with the system
C++ compiler against the headers of the installed tensorflow and jaxlib.  If
they are not installed yet (pip installs them in the same step) or the
compiler fails, the install still succeeds: the package builds the kernel at
first use, and if that fails too it says so once and uses its XLA path.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildWithNative(build_py):
    def run(self):
        super().run()
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from moments_core.native import build

        build.build_all(self.build_lib, log=lambda m: print(m, file=sys.stderr))


class NativeDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: it holds a compiled library
        return True


setup(
    name="tf_stable_moments",
    version="0.2.0",
    description="Correctly rounded mean and variance for TensorFlow, Keras and JAX",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=[
        "tf_stable_moments",
        "tf_stable_moments._native",
        "jax_kernel",
        "jax_kernel._native",
        "jax_kernel.flax",
        "moments_core",
        "moments_core.native",
    ],
    package_data={
        "moments_core.native": ["*.h"],
        "tf_stable_moments._native": ["*.cc"],
        "jax_kernel._native": ["*.cc"],
    },
    cmdclass={"build_py": BuildWithNative},
    distclass=NativeDistribution,
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "jax>=0.4.30", "jaxlib>=0.4.30", "numpy>=1.26"],
    extras_require={
        # flax 0.12.8 is the newest that installs beside jax 0.10.2 without upgrading jax.
        "flax": ["flax>=0.10,<0.13"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",
            "hypothesis>=6",
            "matplotlib>=3.8",
            "flax>=0.10,<0.13",
        ],
        "bench": ["matplotlib>=3.8"],
    },
)
