"""moments_state against moments: the exact state's cost (docs section 13, "The state in
one pass").

    python benchmarks/state.py [--reps 15]

Per framework (a TensorFlow graph function, JAX `jit`) and native kernel setting (on, and
off: `TF_STABLE_MOMENTS_NATIVE=0`, what accelerators run), each in a process of its own:
the best of `reps` calls of `moments` and of `moments_state` (its values) on float32
N(0, 1) and N(1e6, 1), [4096, 256] over axis 0 and [64, 32, 32, 64] over axes 0, 1, 2
(compiled first), and their ratio, measured in the same process.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [((4096, 256), (0,)), ((64, 32, 32, 64), (0, 1, 2))]
DATA = {"N(0,1)": (0.0, 1.0), "N(1e6,1)": (1e6, 1.0)}


def _best(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _measure(framework, reps):
    sys.path.insert(0, ROOT)  # this tree, not an installed copy
    rows = []
    rng = np.random.default_rng(0)
    if framework == "tf":
        import tensorflow as tf

        import tf_stable_moments as tsm

        def make(x, axes):
            x = tf.constant(x)
            m = tf.function(lambda v: tsm.moments(v, list(axes)))
            s = tf.function(lambda v: tsm.moments_state(v, list(axes)).values)
            return (lambda: [t.numpy() for t in m(x)]), (lambda: s(x).numpy())

    else:
        import jax

        import jax_kernel as jk

        def make(x, axes):
            x = jax.numpy.asarray(x)
            m = jax.jit(lambda v: jk.moments(v, axes))
            s = jax.jit(lambda v: jk.moments_state(v, axes).values)
            return (lambda: jax.block_until_ready(m(x))), (lambda: jax.block_until_ready(s(x)))

    for shape, axes in CASES:
        for name, (loc, scale) in DATA.items():
            x = rng.normal(loc, scale, shape).astype(np.float32)
            moments, state = make(x, axes)
            t_m, t_s = _best(moments, reps), _best(state, reps)
            rows.append(dict(shape=list(shape), data=name, moments=t_m, state=t_s))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], args.reps)))
        return
    print("| framework | native | shape | data | moments (ms) | moments_state (ms) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for framework in ("tf", "jax"):
        for native in ("1", "0"):
            env = dict(os.environ, TF_STABLE_MOMENTS_NATIVE=native, TF_CPP_MIN_LOG_LEVEL="2")
            out = subprocess.run(
                [sys.executable, __file__, "--reps", str(args.reps), "--child", framework, native],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for r in json.loads(out.strip().splitlines()[-1]):
                print(
                    f"| {framework} | {'on' if native == '1' else 'off'} | {r['shape']} | "
                    f"{r['data']} | {r['moments'] * 1e3:.2f} | {r['state'] * 1e3:.2f} | "
                    f"{r['state'] / r['moments']:.1f}x |"
                )


if __name__ == "__main__":
    main()
