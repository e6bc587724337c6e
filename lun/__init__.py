"""lun: training infrastructure around the ldm models (config, data, callbacks, strategies)."""
