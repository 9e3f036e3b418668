"""Compile the native kernel: the TensorFlow op and the JAX FFI library.

Used by setup.py at install time and, where the install could not build them
(no TensorFlow or jaxlib headers yet, as when pip installs them in the same
step), once at first use into a per-user cache directory.  Only the system C++
compiler (``$CXX``, else ``c++``/``g++``) and the headers that the installed
tensorflow (``tf.sysconfig``) and jaxlib (``jax.ffi.include_dir()``) ship are
needed.  No TensorFlow or JAX import here: their flags are asked for in a
subprocess, so this module also runs inside an isolated build environment.
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TF_SOURCE = os.path.join("tf_stable_moments", "_native", "stable_moments_op.cc")
JAX_SOURCE = os.path.join("jax_kernel", "_native", "stable_moments_ffi.cc")
TF_LIBRARY = os.path.join("tf_stable_moments", "_native", "_stable_moments_op.so")
JAX_LIBRARY = os.path.join("jax_kernel", "_native", "_stable_moments_ffi.so")

# -ffp-contract=off: TwoSum and the splitting need every rounding (no FMA contraction; the
# float64 sums of y**2 use an explicit FMA where the machine has one, moments.h
# square_add, which the bounds allow); no -ffast-math.  -march=native: the library is
# built on the machine that runs it.
FLAGS = ["-shared", "-fPIC", "-O3", "-ffp-contract=off", "-std=c++17", "-w", "-pthread"]

_QUERY = {
    # Python's headers too: the op StableStallCheck calls back into Python (a warning).
    # libtensorflow_cc holds XLA's custom-call registry (the kernels inside jit_compile).
    "tensorflow": (
        "import json, sysconfig, tensorflow as tf; "
        "print(json.dumps([tf.sysconfig.get_compile_flags() + "
        "['-I' + sysconfig.get_paths()['include']], "
        "tf.sysconfig.get_link_flags() + ['-l:libtensorflow_cc.so.2']]))"
    ),
    "jax": "import json, jax; print(json.dumps([['-I' + jax.ffi.include_dir()], []]))",
}


def _clean_env():
    """The environment without pip's build isolation (its PYTHONPATH hides site-packages)."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONSTARTUP"):
        env.pop(key, None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def framework_flags(framework, in_process=False):
    """(compile flags, link flags) for `framework` ("tensorflow" or "jax"), or None."""
    if in_process:
        namespace = {}
        try:
            exec(_QUERY[framework].replace("print(", "_out = ("), namespace)  # noqa: S102
        except Exception:  # noqa: BLE001 - any failure means: not available
            return None
        return tuple(json.loads(namespace["_out"]))
    for env in (dict(os.environ), _clean_env()):
        try:
            out = subprocess.run(
                [sys.executable, "-c", _QUERY[framework]],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return tuple(json.loads(out.stdout.strip().splitlines()[-1]))
    return None


def compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_library(source, target, flags, root=ROOT):
    """Compile `source` (relative to root) into the shared library `target`.

    Returns None on success, else the reason (a string).  The library is written
    to a temporary name and renamed, so a concurrent reader never sees half a file.
    """
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX)"
    if flags is None:
        return "the framework's headers were not found"
    compile_flags, link_flags = flags
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(os.path.abspath(target)))
    os.close(fd)
    last = None
    # -mno-avx512fp16: TensorFlow 2.21's Eigen headers do not compile with g++ 12 where
    # the machine has AVX512-FP16 (PacketMathFP16.h); without it the op library fell back
    # to the generic x86-64 target (SSE2: no FMA, and every rounding of mean_lo's terms a
    # libm call, 0.7 ms of a BN layer's [1024, 256] float32).
    for arch in (["-march=native"], ["-march=native", "-mno-avx512fp16"], []):
        cmd = [
            cxx,
            *FLAGS,
            *arch,
            *compile_flags,
            "-I" + HERE,
            os.path.join(root, source),
            "-o",
            tmp,
            *link_flags,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            return None
        last = out.stderr.strip().splitlines()[-5:]
    os.unlink(tmp)
    return "compilation failed: " + " | ".join(last or [])


def build_all(out_root, in_process=False, log=print):
    """Build both libraries under out_root (a build or source tree); report each."""
    for framework, source, target in (
        ("tensorflow", TF_SOURCE, TF_LIBRARY),
        ("jax", JAX_SOURCE, JAX_LIBRARY),
    ):
        flags = framework_flags(framework, in_process)
        err = compile_library(source, os.path.join(out_root, target), flags)
        if err:
            log(
                f"tf_stable_moments: native {framework} kernel not built ({err}); "
                "it will be built at first use, or the XLA path is used"
            )
        else:
            log(f"tf_stable_moments: native {framework} kernel built")


def cache_dir(tag):
    """A per-user directory for libraries built at first use, one per framework version."""
    base = os.environ.get("TF_STABLE_MOMENTS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tf_stable_moments",
    )
    return os.path.join(base, tag)


def cached_library(framework, version, source, name):
    """(path, None) of `name` built from `source` in the cache, building it if missing, or
    (None, reason).  One directory per framework version, machine and source text, so a
    changed kernel is never served by a library built from an older one."""
    digest = hashlib.sha256()
    try:
        for path in (os.path.join(ROOT, source), os.path.join(HERE, "moments.h")):
            with open(path, "rb") as f:
                digest.update(f.read())
    except OSError as e:
        return None, f"the native sources are missing ({e})"
    tag = f"{framework}-{version}-{platform.machine()}-{digest.hexdigest()[:12]}"
    target = os.path.join(cache_dir(tag), name)
    if os.path.exists(target):
        return target, None
    err = compile_library(source, target, framework_flags(framework, in_process=True))
    return (None, err) if err else (target, None)


if __name__ == "__main__":  # python -m moments_core.native.build: build into the source tree
    build_all(ROOT)
