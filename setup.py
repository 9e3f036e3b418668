from setuptools import setup

setup(
    name="tf_stable_moments",
    version="0.1.0",
    description="Correctly rounded mean and variance for TensorFlow, Keras and JAX",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=["tf_stable_moments", "jax_kernel", "moments_core"],
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "jax>=0.4.30", "jaxlib>=0.4.30", "numpy>=1.26"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "matplotlib>=3.8"],
        "bench": ["matplotlib>=3.8"],
    },
)
