"""The "auto" choices and their measurements: device, precision, workers, FLOPs, memory."""
