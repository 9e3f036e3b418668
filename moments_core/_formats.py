"""Target formats of the contract (docs/algorithm.md, section 2).

A result is rounded once to its *target format*: the format of the input (or of
its parts, for complex input).  Each format is described by its precision p
(significant bits), the exponent of its smallest normal number emin and the
exponent emax at which it overflows (values >= 2**emax round to inf).
"""

from typing import NamedTuple


class Format(NamedTuple):
    name: str  # the dtype name of the target format
    precision: int  # p: significant bits, the leading one included
    emin: int  # smallest normal number 2**emin; below it inputs and results flush to 0
    emax: int  # results >= 2**emax overflow to inf
    bits: int  # storage width; the integer type of the same width holds its bit pattern

    @property
    def bias(self):
        return 1 - self.emin

    @property
    def wide(self):
        """True when the fast path sums in float64 (precision <= 24); else in float64 pairs."""
        return self.precision <= 24

    @property
    def base(self):
        """Exponent of the lowest bit an input of this format can have, as a float64.

        The exact path (section 7) reads inputs as float64: M * 2**E with a
        53-bit integer M; a normal input of this format has E >= emin - 52.
        """
        return self.emin - 52

    @property
    def top(self):
        """Largest E - base of a finite input: (emax - 1 - 52) - base."""
        return self.emax - 1 - self.emin


FORMATS = {
    "float16": Format("float16", 11, -14, 16, 16),
    "bfloat16": Format("bfloat16", 8, -126, 128, 16),
    "float32": Format("float32", 24, -126, 128, 32),
    "float64": Format("float64", 53, -1022, 1024, 64),
}
