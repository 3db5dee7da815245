"""Turns a SchedulerOutput into tensors, runs the model, samples."""
