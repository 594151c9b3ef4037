"""Least squares on the device: one fit or a batch of K as one compiled program."""
