"""The parts of scripts/benchmark_gpu.py (the GPU table of issue 30): how a figure is taken
(`measure`), the model rows (`model`) and the run rows (`runs`)."""
