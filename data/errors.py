"""Exception types raised by :mod:`data`.

* :class:`DataFormatError` (a :class:`ValueError`) -- a file exists but its
  content does not follow the expected format (wrong IDX magic number or size,
  truncated gzip stream, CIFAR pickle without a required key, HDF5 cache of
  another format version or without required attributes, labels outside
  ``[0, num_classes)``).  The message always names the file and the offending
  value together with what is allowed.
* Missing files raise the built-in :class:`FileNotFoundError`; the message names
  the file, the places searched and how to obtain it.
* Invalid arguments (unknown data set name, bad fractions, bad sharding
  parameters) raise :class:`ValueError` naming the value and what is allowed.
"""


class DataFormatError(ValueError):
    """A data file exists but is malformed; the message names the file and value."""
