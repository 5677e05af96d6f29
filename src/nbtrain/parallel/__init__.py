"""Engines beyond this process: N local processes, Ray Train's workers."""
