"""nbtrain's own loop in this process: the setup, the step, a failure explained."""
