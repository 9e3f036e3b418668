"""`python -m tf_stable_moments`: the report of tf_stable_moments/_report.py."""

import sys

from tf_stable_moments._report import main

if __name__ == "__main__":
    sys.exit(main())
