"""lun.data: datasets (local folders, WebDataset / Parquet streams), aspect buckets, DataModule.

Config targets: lun.data.DataModule, lun.data.local.Local, lun.data.webdataset.WebDataset,
lun.data.webdataset.Parquet. Bad input is reported through the "lun.data" logger.
"""

from lun.data.datamodule import DataModule
from lun.data.local import Local
from lun.data.webdataset import Parquet, WebDataset

__all__ = ["DataModule", "Local", "Parquet", "WebDataset"]
