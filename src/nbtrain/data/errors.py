"""Errors shared by nbtrain's packed data formats (TFRecord, LMDB)."""


class CorruptRecordError(ValueError):
    """A record or sample whose checksum, length or contents do not match what its format
    requires: the file is damaged, and reading it again will not help; write it again."""
