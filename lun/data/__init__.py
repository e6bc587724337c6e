"""lun.data: datasets (local folders, WebDataset / Parquet streams), aspect buckets, DataModule.

Config targets: lun.data.DataModule, lun.data.local.Local, lun.data.webdataset.WebDataset,
lun.data.webdataset.Parquet. Bad input is reported through the "lun.data" logger.

The names are imported on first use (PEP 562): a submodule such as the dataset report must not
pull Lightning and torch in with the package (`inspect_data.py --help` answers without them).
"""

import importlib

_HOME = {
    "DataModule": "lun.data.datamodule",
    "Local": "lun.data.local",
    "Parquet": "lun.data.webdataset",
    "WebDataset": "lun.data.webdataset",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
