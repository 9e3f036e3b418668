"""The algorithm of docs/algorithm.md in numpy, one rounding per operation.

numpy performs every operation separately (no FMA) and keeps subnormal
numbers; TensorFlow and JAX on CPU flush them to zero.  This mirror flushes
every result below the smallest normal number, so it computes the canonical
bits that both kernels must reproduce.  It is written level by level, for
clarity rather than speed.
"""

import numpy as np

SPEC = {
    np.dtype(np.float32): (np.int32, 23, 127, ~0xFFF, 0x800),
    np.dtype(np.float64): (np.int64, 52, 1023, ~((1 << 27) - 1), 1 << 26),
}


class Mirror:
    def __init__(self, dtype):
        self.f = np.dtype(dtype).type
        self.i, self.mbits, self.bias, self.mask, self.half = SPEC[np.dtype(dtype)]
        self.tiny = np.finfo(dtype).tiny

    # every arithmetic result goes through ftz
    def ftz(self, v):
        v = np.asarray(v, self.f)
        return np.where(np.abs(v) < self.tiny, np.copysign(self.f(0), v), v).astype(self.f)

    def add(self, a, b):
        return self.ftz(np.add(a, b, dtype=self.f))

    def sub(self, a, b):
        return self.ftz(np.subtract(a, b, dtype=self.f))

    def mul(self, a, b):
        return self.ftz(np.multiply(a, b, dtype=self.f))

    def two_sum(self, a, b):
        s = self.add(a, b)
        bb = self.sub(s, a)
        return s, self.add(self.sub(a, self.sub(s, bb)), self.sub(b, bb))

    def fast_two_sum(self, a, b):
        s = self.add(a, b)
        return s, self.sub(b, self.sub(s, a))

    def split(self, a):
        bits = np.asarray(a, self.f).view(self.i)
        hi = ((bits + self.i(self.half)) & self.i(self.mask)).astype(self.i).view(self.f)
        return hi, self.sub(a, hi)

    def two_prod(self, a, b):
        ah, al = self.split(a)
        bh, bl = self.split(b)
        p, e1 = self.two_sum(self.mul(ah, bh), self.mul(ah, bl))
        p, e2 = self.two_sum(p, self.mul(al, bh))
        return p, self.add(self.add(e1, e2), self.mul(al, bl))

    def df_add(self, ah, al, bh, bl):
        s, e = self.two_sum(ah, bh)
        return self.fast_two_sum(s, self.add(e, self.add(al, bl)))

    def df_mul(self, ah, al, bh, bl):
        p, e = self.two_prod(ah, bh)
        cross = self.add(self.two_prod(ah, bl)[0], self.two_prod(al, bh)[0])
        return self.fast_two_sum(p, self.add(e, cross))

    def pow2(self, k):
        return ((np.asarray(k, self.i) + self.bias) << self.mbits).astype(self.i).view(self.f)

    def exponent(self, a):
        bits = np.asarray(a, self.f).view(self.i)
        return ((bits >> self.mbits) & (2 * self.bias + 1)) - self.bias

    def scale_exponent(self, amax):
        """e such that max|x| * 2**e lies in [2, 4) (step 1)."""
        return np.clip(1 - self.exponent(amax), 1 - self.bias, self.bias).astype(self.i)

    def reciprocal(self, n):
        n = max(int(n), 1)
        f, c, t = self.f, (self.mbits + 1) // 2, int(n).bit_length()
        digit, r = divmod(1 << t, n)
        digits = [digit]
        for _ in range(4):
            digit, r = divmod(r << c, n)
            digits.append(digit)
        a = self.add(f(digits[0]), self.mul(f(digits[1]), f(2.0**-c)))
        b = self.add(
            self.mul(f(digits[2]), f(2.0 ** (-2 * c))), self.mul(f(digits[3]), f(2.0 ** (-3 * c)))
        )
        h, l = self.two_sum(a, b)
        l = self.add(l, self.mul(f(digits[4]), f(2.0 ** (-4 * c))))
        return self.mul(h, f(2.0**-t)), self.mul(l, f(2.0**-t))

    def tree_sum(self, h, l):
        """Compensated halving tree over the last axis, zero padded to a power of two."""
        n = h.shape[-1]
        size = 1 << max(n - 1, 0).bit_length()
        pad = [(0, 0)] * (h.ndim - 1) + [(0, size - n)]
        h, l = np.pad(h, pad), np.pad(l, pad)
        while h.shape[-1] > 1:
            half = h.shape[-1] // 2
            h, e = self.two_sum(h[..., :half], h[..., half:])
            l = self.add(self.add(l[..., :half], l[..., half:]), e)
        return h[..., 0], l[..., 0]

    def square(self, dh, dl):
        ah, al = self.split(dh)
        ch, cl = self.split(dl)
        a2 = self.add(ah, ah)
        qh, q1 = self.two_sum(self.mul(ah, ah), self.mul(a2, al))
        inner = self.add(
            self.add(self.mul(al, al), self.mul(a2, ch)),
            self.add(self.mul(a2, cl), self.mul(self.add(al, al), ch)),
        )
        return qh, self.add(q1, inner)

    def part_sums(self, x, e, n):
        threshold = self.pow2(np.maximum(-e, 0) + 1 - self.bias)
        dropped = (np.abs(x) < threshold) | (np.abs(x) == np.inf)
        xs = self.mul(np.where(dropped, self.f(0), x), self.pow2(e))
        k = xs[:, :1]
        yh, yl = self.two_sum(xs, -k)
        sy = self.two_sum(*self.tree_sum(yh, yl))
        k = k[:, 0]
        mean = self.df_add(k, np.zeros_like(k), *self.df_mul(*sy, *self.reciprocal(n)))
        dh, dl = self.two_sum(xs, -mean[0][:, None])
        qh, ql = self.square(dh, dl)
        return mean, k, sy, self.two_sum(*self.tree_sum(qh, ql))

    def finish(self, parts, e, n, ddof):
        rn, rd = self.reciprocal(n), self.reciprocal(n - ddof)
        count = (self.f(n), self.f(n - int(self.f(n))))
        means, num = [], None
        for (mh, ml), k, sy, s2 in parts:
            shift = self.df_mul(*count, *self.two_sum(mh, -k))
            s1 = self.df_add(*sy, -shift[0], -shift[1])
            corr = self.df_mul(*self.df_mul(*s1, *rn), *s1)
            term = self.df_add(*s2, -corr[0], -corr[1])
            num = term if num is None else self.df_add(*num, *term)
            means.append((mh, ml))
        vh, _ = self.df_mul(*num, *rd)
        var = np.where(vh > 0, vh, self.f(0))
        e1 = e >> 1
        u1, u2 = self.pow2(-e1), self.pow2(e1 - e)
        var = self.mul(self.mul(self.mul(self.mul(var, u1), u1), u2), u2)
        means = [
            (self.mul(self.mul(mh, u1), u2), self.mul(self.mul(ml, u1), u2)) for mh, ml in means
        ]
        return means, var


def slice_moments(parts_x, ddof=0):
    """parts_x: 2-D arrays [slices, n].  Returns ([(mean_hi, mean_lo)], var)."""
    parts_x = [np.asarray(p) for p in parts_x]
    m = Mirror(parts_x[0].dtype)
    kept, n = parts_x[0].shape
    nan = np.full(kept, np.nan, m.f)
    if n == 0:
        return [(nan, np.zeros_like(nan)) for _ in parts_x], nan
    his = [np.max(p, axis=1) for p in parts_x]
    los = [np.min(p, axis=1) for p in parts_x]
    amax = np.max([np.maximum(np.abs(h), np.abs(l)) for h, l in zip(his, los)], axis=0)
    e = m.scale_exponent(amax)
    with np.errstate(all="ignore"):
        parts = [m.part_sums(p, e[:, None], n) for p in parts_x]
        means, var = m.finish(parts, e, n, ddof)
    out, all_finite = [], np.ones(kept, bool)
    for (mh, ml), hi, lo, (_, _, sy, _) in zip(means, his, los, parts):
        pos, neg, has_nan = hi == np.inf, lo == -np.inf, np.isnan(sy[0])
        finite = ~(has_nan | pos | neg)
        all_finite &= finite
        special = np.where(has_nan | (pos & neg), nan, np.where(pos, np.inf, -np.inf))
        mh = np.where(finite, np.where(mh == 0, m.f(0), mh), special)
        out.append((mh.astype(m.f), np.where(finite, ml, m.f(0))))
    return out, np.where(all_finite & (n - ddof > 0), var, nan).astype(m.f)


def moments(x, axes, ddof=0):
    """numpy mirror of the public moments: (mean, var), reduced axes removed."""
    x = np.asarray(x)
    axes = tuple(sorted(a % x.ndim for a in np.atleast_1d(axes))) if x.ndim else ()
    kept = [a for a in range(x.ndim) if a not in axes]
    shape = [x.shape[a] for a in kept]
    n = int(np.prod([x.shape[a] for a in axes]))
    complex_ = np.iscomplexobj(x)
    work = {np.complex64: np.float32, np.complex128: np.float64, np.float16: np.float32}.get(
        x.dtype.type, x.dtype
    )
    flat = np.transpose(x, kept + list(axes)).reshape(int(np.prod(shape)), n)
    parts = [flat.real.astype(work), flat.imag.astype(work)] if complex_ else [flat.astype(work)]
    means, var = slice_moments(parts, ddof)
    mean = means[0][0] + 1j * means[1][0] if complex_ else means[0][0]
    if complex_:
        mean = mean.astype(x.dtype)
    else:
        mean, var = mean.astype(x.dtype), var.astype(x.dtype)
    return mean.reshape(shape), var.reshape(shape)
