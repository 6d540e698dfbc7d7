"""Rebuild the study summary shipped with the package (``longca_triton/data/study_summary.jsonl.gz``)
from the committed results, so a pip-installed ``longca-triton recommend`` answers from them.

    python experiments/study_summary.py                       # experiments/results/** -> the package
    python experiments/study_summary.py --results a.jsonl b.jsonl.gz --out /tmp/summary.jsonl.gz

Run it from the checkout's root after committing a study run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longca_triton.study.recommend import default_results  # noqa: E402 - after the path above
from longca_triton.study.summary import summary_path, write_summary  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", nargs="*", default=None,
                   help="results files (default: experiments/results/**/results.jsonl and .jsonl.gz)")
    p.add_argument("--out", default=None, help=f"the summary to write (default: {summary_path()})")
    a = p.parse_args()
    paths = a.results or default_results()
    if not paths:
        p.error("no results files: run from the checkout's root or pass --results")
    out = a.out or summary_path()
    n = write_summary(paths, out)
    print(f"{out}: {n} rows from {len(paths)} results files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
