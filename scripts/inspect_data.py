"""Know your data before you train: counts per filter rule, captions and token lengths, scores,
buckets and (with --decode) image sizes, modes, slow files and duplicates.

    python scripts/inspect_data.py --base configs/my.yaml [key=value ...] [--decode] \\
        [--out reports/mine] [--world-size 8]

The configs merge as main.py merges them; the datasets are built as training builds them (no
model). Writes summary.txt, report.json and report.html (plots embedded) under --out. See
lun/data/dataset_report.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lun.data.dataset_report import main  # noqa: E402

if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    sys.exit(main())
